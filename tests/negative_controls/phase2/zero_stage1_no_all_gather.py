"""ZeRO-1 step updates the parameters this rank owns but never sends them: every other rank keeps their old
values, and the replicas drift apart."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_trains_like_data_parallel_adam_stage1"]


class ZeroStage1(_reference.ZeroStage1):
    @torch.no_grad()
    def step(self, closure=None):
        self._sync_hyperparameters()
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        self.optim.step()
