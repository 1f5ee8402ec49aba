"""ZeRO-3 reduces a unit's gradients after its backward but does not free its gathered parameters: training is right, and after every step each rank holds the whole model again, gathered."""
from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_memory_between_steps_stage3", "test_2_4_peak_memory_stage3", "test_2_4_matches_fully_shard_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    def backward_done(self, unit):
        self.reduce_gradients(unit)
        unit.done = True
