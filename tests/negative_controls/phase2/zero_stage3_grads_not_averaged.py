"""ZeRO-3 adds the reduce-scattered gradient to the shard's .grad without dividing by N (a sum over ranks): an SGD step goes N times too far."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_gradient_is_averaged_over_ranks_stage3", "test_2_4_two_ranks_match_one_process_bitwise_stage3"]


class ZeroStage3(_reference.ZeroStage3):
    @torch.no_grad()
    def reduce_gradients(self, unit):
        mine = torch.empty_like(unit.shard)
        dist.reduce_scatter_single(mine, unit.flat_grad().to(unit.shard.dtype))
        if unit.shard.grad is None:
            unit.shard.grad = mine
        else:
            unit.shard.grad.add_(mine)
        for p in unit.params:
            p.grad = None
