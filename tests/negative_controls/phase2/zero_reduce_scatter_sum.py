"""ZeRO-2 reduce-scatters the gradients with SUM and forgets to divide by N: Adam normalises most of the
factor away (m / sqrt(v)), so only a run whose update is proportional to the gradient shows it N times too far."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_gradient_is_averaged_over_ranks_stage2", "test_2_4_gradients_accumulate_over_backward_passes_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    def reduce_gradients(self, unit):
        shard = torch.empty_like(unit.grad_shard)
        dist.reduce_scatter_tensor(shard, unit.flat_grad())  # summed over N ranks
        unit.grad_shard.add_(shard)
        for p in unit.params:
            p.grad = None
