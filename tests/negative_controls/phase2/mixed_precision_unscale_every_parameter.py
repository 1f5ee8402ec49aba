"""LossScaler.unscale_ divides the .grad of every parameter of the optimizer: a frozen or unused parameter has none, and the step crashes."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_step_with_frozen_and_unused_parameters"]


class LossScaler(_reference.LossScaler):
    def unscale_(self, optimizer):
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update(): gradients would be divided twice")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        found = torch.zeros(1, device=params[0].device)
        for param in params:
            param.grad.mul_(1.0 / self._scale)
            found = torch.maximum(found, (~torch.isfinite(param.grad)).any().float())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._found_inf = bool(found.item())
