"""LossScaler.step always calls optimizer.step(): an overflowing step writes inf/nan into the weights."""
from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_loss_scaler_matches_torch_grad_scaler", "test_2_2_bf16_step_keeps_fp32_master_weights",
             "test_2_2_found_inf_is_agreed_across_ranks"]


class LossScaler(_reference.LossScaler):
    def step(self, optimizer):
        if self._found_inf is None:
            self.unscale_(optimizer)
        return optimizer.step()
