"""ZeRO-2 reduce-scatters each gradient with SUM and forgets to divide by N: Adam would normalise most of the
factor away (m / sqrt(v)), but SGD's step is proportional to the gradient, so it goes N times too far."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_gradient_is_averaged_over_ranks_stage2", "test_2_4_gradients_accumulate_over_backward_passes_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    @torch.no_grad()
    def _grad_ready(self, p):
        padded = torch.zeros_like(self.flat[p])
        padded[:p.numel()].copy_(p.grad.reshape(-1))
        mine = torch.empty_like(self.shard[p])
        dist.reduce_scatter_single(mine, padded)  # summed over N ranks
        shard = self.shard[p]
        if shard.grad is None:
            shard.grad = mine
        else:
            shard.grad.add_(mine)
        p.grad = None
