"""LossScaler.step checks for inf/nan but steps on the still-scaled gradients (S times too large)."""
import torch

from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_loss_scaler_matches_torch_grad_scaler", "test_2_2_bf16_step_keeps_fp32_master_weights",
             "test_2_2_found_inf_is_agreed_across_ranks"]


class LossScaler(_reference.LossScaler):
    def step(self, optimizer):
        if self._found_inf is None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self._found_inf = any(not torch.isfinite(g).all() for g in grads)
        if self._found_inf:
            return None
        return optimizer.step()
