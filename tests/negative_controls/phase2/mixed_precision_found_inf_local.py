"""LossScaler.unscale_ decides found_inf from this rank's gradients only: ranks skip different steps and drift apart."""
import torch

from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_found_inf_is_agreed_across_ranks"]


class LossScaler(_reference.LossScaler):
    def unscale_(self, optimizer):
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self._scale)
                    found = found or not bool(torch.isfinite(p.grad).all())
        self._found_inf = found
