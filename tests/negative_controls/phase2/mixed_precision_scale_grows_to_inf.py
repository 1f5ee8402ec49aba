"""LossScaler.update grows the scale without checking the result: a scale near the top of the float range becomes inf, and every later step overflows."""
from solutions.phase2_advanced import mixed_precision as _reference
from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_scale_that_would_overflow_does_not_grow"]


class LossScaler(_reference.LossScaler):
    def update(self):
        if self._found_inf is None:
            raise RuntimeError("update() before unscale_()/step(): no inf check was recorded in this step")
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
