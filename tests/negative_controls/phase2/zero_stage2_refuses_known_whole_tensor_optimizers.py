"""ZeroStage2 refuses the optimizers it knows to need whole tensors (a blacklist: Adafactor, LBFGS) and steps any other on slices, where the docstring refuses everything that is not a subclass of one of ELEMENTWISE."""
import torch

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_documented_errors_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    ELEMENTWISE = (torch.optim.Optimizer,)

    def __init__(self, params, optimizer_class, **defaults):
        if issubclass(optimizer_class, (torch.optim.Adafactor, torch.optim.LBFGS)):
            raise ValueError(f"{optimizer_class.__name__} needs whole parameters: use ZeroStage1")
        super().__init__(params, optimizer_class, **defaults)
