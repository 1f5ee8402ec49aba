"""ZeRO-1 builds the wrapped optimizer over every parameter on every rank ("each rank steps them all, the owners'
broadcast makes it consistent anyway"): the result is right, but every rank holds the whole optimizer state, DP's."""
from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_memory_between_steps_stage1", "test_2_4_peak_memory_stage1"]


class ZeroStage1(_reference.ZeroStage1):
    def __init__(self, params, optimizer_class, **defaults):
        _reference.ShardedOptimizer.__init__(self, params, optimizer_class, **defaults)
        owners = _reference.partition_parameters([p.numel() for p in self.trainable], self.world_size)
        self.owner = dict(zip(self.trainable, owners))
        self._build([[p for p in group["params"] if p.requires_grad] for group in self.param_groups])
