"""LossScaler.update backs off on overflow but keeps the growth counter: the scale grows again too early."""
from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_loss_scaler_matches_torch_grad_scaler", "test_2_2_found_inf_is_agreed_across_ranks"]


class LossScaler(_reference.LossScaler):
    def update(self):
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_()/step()")
        if self._found_inf:
            self._scale *= self.backoff_factor
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
