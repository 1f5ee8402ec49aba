"""ZeRO-2 reduce-scatters each gradient into its slice but leaves every full p.grad allocated (zeroed for the
next backward, as a normal optimizer's zero_grad would): the result is right, the gradient memory is stage 1's."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_memory_between_steps_stage2", "test_2_4_peak_memory_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    @torch.no_grad()
    def _grad_ready(self, p):
        padded = torch.zeros_like(self.flat[p])
        padded[:p.numel()].copy_(p.grad.reshape(-1))
        mine = torch.empty_like(self.shard[p])
        dist.reduce_scatter_single(mine, padded)
        mine.div_(self.world_size)
        shard = self.shard[p]
        if shard.grad is None:
            shard.grad = mine
        else:
            shard.grad.add_(mine)
        p.grad.zero_()  # "zero_grad" instead of freeing

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none)  # the model's gradients stay, zeroed
