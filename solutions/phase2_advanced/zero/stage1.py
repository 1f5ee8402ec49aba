"""ZeRO stage 1 (exercise 2.4): optimizer state sharded by WHOLE parameters, any optimizer.

Each parameter is owned by one rank (partition_parameters: largest first, to the least
loaded), and each rank's wrapped optimizer steps only the parameters it owns. It sees whole
tensors, so any optimizer works (Adafactor's factored moments, LAMB's per-tensor norms);
shares balance only to within the largest parameter. A step: average every gradient over
the ranks (all-reduce, as in data parallelism), step my parameters, then each owner
broadcasts its parameters to the others.

    bytes per rank, Adam:     4Ψ parameters + 4Ψ gradients + 8Ψ/N state (+ the imbalance)
    elements sent per step:   2Ψ(N-1)/N (all-reduce) + Ψ (a broadcast sends the whole tensor)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .stage0 import ShardedOptimizer


def partition_parameters(numels: Sequence[int], world_size: int) -> list[int]:
    """The owner rank of each parameter: largest first, each to the rank that holds the fewest elements so far
    (the lowest such rank), as torch's ZeroRedundancyOptimizer. A rank then holds at most sum/N + the largest."""
    owners, load = [0] * len(numels), [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owners[i] = min(range(world_size), key=load.__getitem__)
        load[owners[i]] += numels[i]
    return owners


class ZeroStage1(ShardedOptimizer):
    """Optimizer state sharded by WHOLE parameters (torch's ZeroRedundancyOptimizer): any optimizer.

    `self.owner[p]` is the rank owning trainable parameter p (partition_parameters); this
    rank's `self.optim` steps the parameters it owns, in the user's groups. step(): every
    gradient is averaged over the ranks, each rank steps its own parameters, then each
    owner sends its parameters to the others. Full parameters and gradients stay on every
    rank; the optimizer state of the others' parameters is never built.
    """

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer], **defaults: Any):
        super().__init__(params, optimizer_class, **defaults)
        owners = partition_parameters([p.numel() for p in self.trainable], self.world_size)
        self.owner: dict[nn.Parameter, int] = dict(zip(self.trainable, owners))
        # EXERCISE 2.4: self.optim steps exactly the parameters self.owner gives this rank, each in the group it was given in; see self._build
        self._build([[p for p in dict.fromkeys(group["params"]) if self.owner.get(p) == self.rank]
                     for group in self.param_groups])
        # END EXERCISE

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        # EXERCISE 2.4: all ranks end as one process would on the rank-averaged gradients, each stepping its own (no .grad: skip); see broadcast
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        self.optim.step()
        for p in self.trainable:
            dist.broadcast(p.detach(), src=self.owner[p])
        # END EXERCISE
        return loss
