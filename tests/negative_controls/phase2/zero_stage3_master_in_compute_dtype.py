"""With a compute dtype, ZeRO-3 casts the shard itself to it before the all-gather (in place, "so the gather sends half the bytes"): from the first forward on, the optimizer steps fp16/bf16 master weights, and small updates round away."""

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_compute_dtype_with_fp32_master_shards_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    def unshard(self, unit):
        unit.shard.data = unit.shard.data.to(unit.data.dtype)
        super().unshard(unit)
