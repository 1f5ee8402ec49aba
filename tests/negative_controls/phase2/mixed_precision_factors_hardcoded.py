"""LossScaler.update doubles and halves the scale whatever growth_factor and backoff_factor say (GradScaler's defaults, hard-coded)."""
from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_loss_scaler_rules_for_any_factors_and_interval"]


class LossScaler(_reference.LossScaler):
    def update(self):
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_()/step(): no inf check was recorded in this step")
        if self._found_inf:
            self._scale *= 0.5
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= 2.0
                self._growth_tracker = 0
        self._found_inf = None
