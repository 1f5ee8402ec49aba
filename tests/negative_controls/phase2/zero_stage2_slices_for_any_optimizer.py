"""ZeRO-2 accepts any optimizer class and steps it on flat slices: Adafactor then keeps unfactored moments of
1-D slices and clips each slice's update by its own RMS instead of the whole tensor's: it trains, silently
differently from Adafactor on whole parameters."""
import torch

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_optimizer_needing_whole_parameters_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    ELEMENTWISE = (torch.optim.Optimizer,)  # "every optimizer steps tensors"
