"""ZeRO-1 step updates this rank's slice but never all-gathers: every other slice keeps its old
values on this rank, and the replicas drift apart."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_trains_like_data_parallel_adam_stage1"]


class ZeroStage1(_reference.ZeroStage1):
    @torch.no_grad()
    def step(self):
        self.step_count += 1
        flat, grad = self.flat, self.flat_grad
        dist.all_reduce(grad)
        grad.div_(self.world_size)
        self.adam(flat.data[flat.lo:flat.hi], grad[flat.lo:flat.hi], self.exp_avg, self.exp_avg_sq)
        grad.zero_()
