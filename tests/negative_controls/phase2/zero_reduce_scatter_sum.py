"""ZeRO-2 reduce-scatters the gradients with SUM and forgets to divide by N: Adam mostly normalises the
scale away, but not against the weight decay (and eps): the steps differ from data parallelism."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_trains_like_data_parallel_adam"]


class ZeroStage2(_reference.ZeroStage2):
    @torch.no_grad()
    def step(self):
        self.step_count += 1
        flat = self.flat
        dist.reduce_scatter_tensor(self.grad_shard, flat.flat_grad())  # summed over N ranks
        for p in self.params:
            p.grad = None
        mine = flat.data[flat.lo:flat.hi]
        self.adam(mine, self.grad_shard, self.exp_avg, self.exp_avg_sq)
        dist.all_gather_into_tensor(flat.data, mine.clone())
