"""ZeRO-2 all-reduces each gradient and keeps its slice, instead of reduce-scattering: the result and the
memory are right, but it sends twice a reduce-scatter's bytes (1.5x DP per step in all)."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_communication_per_step_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    @torch.no_grad()
    def _grad_ready(self, p):
        full = torch.zeros_like(self.flat[p])
        full[:p.numel()].copy_(p.grad.reshape(-1))
        dist.all_reduce(full)
        size = self.shard[p].numel()
        mine = full[self.rank * size:(self.rank + 1) * size] / self.world_size
        shard = self.shard[p]
        if shard.grad is None:
            shard.grad = mine
        else:
            shard.grad.add_(mine)
        p.grad = None
