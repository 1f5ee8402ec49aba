"""LossScaler counts clean steps in an attribute of its own and never updates _growth_tracker: the scale is right, but state_dict() saves a tracker of 0 and a resumed run grows late."""
from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_loss_scaler_rules_for_any_factors_and_interval"]


class LossScaler(_reference.LossScaler):
    def update(self):
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_()/step(): no inf check was recorded in this step")
        good = getattr(self, "good_steps", 0)
        if self._found_inf:
            self._scale *= self.backoff_factor
            good = 0
        else:
            good += 1
            if good == self.growth_interval:
                self._scale *= self.growth_factor
                good = 0
        self.good_steps = good
        self._found_inf = None
