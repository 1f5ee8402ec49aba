"""With a compute dtype, ZeRO-3 reduce-scatters the gradients in it and hands that fp16/bf16 result to the fp32 shard's .grad without upcasting it (torch refuses a .grad whose dtype differs from its tensor's)."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_compute_dtype_with_fp32_master_shards_stage3", "test_2_4_shard_gradients_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    @torch.no_grad()
    def reduce_gradients(self, unit):
        flat = unit.flat_grad()
        mine = torch.empty(unit.shard_size, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(mine, flat)
        mine.div_(self.world_size)
        if unit.shard.grad is None:
            unit.shard.grad = mine
        else:
            unit.shard.grad.add_(mine)
        for p in unit.params:
            p.grad = None
