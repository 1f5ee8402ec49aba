"""ZeRO-2 reduce-scatters each unit into its gradient shard but leaves every full p.grad allocated (zeroed for
the next step, as a normal optimizer's zero_grad would): the result is right, the gradient memory is stage 1's."""
import torch
import torch.distributed as dist

from solutions.phase2_advanced import zero as _reference
from solutions.phase2_advanced.zero import *  # noqa: F401,F403

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_memory_between_steps_stage2", "test_2_4_peak_memory_stage2"]


class ZeroStage2(_reference.ZeroStage2):
    def reduce_gradients(self, unit):
        shard = torch.empty_like(unit.grad_shard)
        dist.reduce_scatter_tensor(shard, unit.flat_grad())
        unit.grad_shard.add_(shard, alpha=1.0 / self.world_size)
        for p in unit.params:
            if p.grad is not None:
                p.grad.zero_()  # "zero_grad" instead of freeing
