"""ZeRO-3 reduces a unit only once every one of its parameters has a gradient, with no end-of-backward
callback: when the forward skipped a parameter the unit is never reduced (nor freed) in that step, and its
gradients are applied a step late."""
from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_parameter_without_gradient_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    def _post_accumulate_grad(self, unit):
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):
            unit.grads_ready = 0
            self.backward_done(unit)
