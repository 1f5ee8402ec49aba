"""ZeRO stage 2 (exercise 2.4): + gradients sharded, every parameter cut into N equal flat slices.

Rank r owns slice r of every parameter: exactly 1/N. Each parameter's gradient is
reduce-scattered the moment backward has produced it (and the full one freed), so a rank
keeps only its slices' gradients; after the step the slices are all-gathered back into the
parameters. The wrapped optimizer sees slices: it must be element-wise (SGD, Adam, AdamW,
...: ZeroStage2.ELEMENTWISE); others are refused.

    bytes per rank, Adam:     4Ψ parameters + 12Ψ/N (my slices' gradients and state)
    elements sent per step:   a reduce-scatter and an all-gather: DP's all-reduce, 2Ψ(N-1)/N
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .stage0 import ShardedOptimizer


class ZeroStage2(ShardedOptimizer):
    """+ gradients sharded: every trainable parameter cut into N equal flat slices (DeepSpeed's, FSDP's layout).

    Each trainable parameter p becomes a view of `self.flat[p]`, a 1-D buffer padded with
    zeros to N * ceil(numel / N); this rank owns `self.shard[p]`, slice `rank` of it (a
    view too: stepping the slice steps p); `self.optim` steps this rank's slices, in the
    user's groups. The wrapped optimizer sees slices, so it must be element-wise
    (a subclass of one of ELEMENTWISE; add yours to the tuple if it is); others are refused
    with a ValueError at construction.

    Backward: a hook on each parameter fires once its gradient of this pass is accumulated
    (every use summed: a tied weight fires once); `_grad_ready` reduce-scatters it into the
    .grad of my slice (averaged over ranks, ADDED: backward passes accumulate until
    zero_grad()) and frees p.grad, so about one parameter's full gradient exists at a time.
    A parameter without gradient fires nothing: its slice keeps .grad None and the wrapped
    optimizer skips it, as torch.optim does. step(): step my slices, all-gather every parameter.
    """

    ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
        torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
        torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
        torch.optim.ASGD)

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer], **defaults: Any):
        super().__init__(params, optimizer_class, **defaults)
        self.flat: dict[nn.Parameter, torch.Tensor] = {}
        self.shard: dict[nn.Parameter, torch.Tensor] = {}
        raise NotImplementedError('TODO 2.4: ValueError unless element-wise; per p: self.flat[p] (p a view of it), self.shard[p] (my slice), a hook; _build on slices')

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        """Hook: p.grad holds p's whole gradient of this backward pass."""
        raise NotImplementedError('TODO 2.4: self.shard[p].grad (None: 0) += my slice of the rank-average of p.grad, padded; then p.grad = None; reduce_scatter')

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward accumulates from zero, in the model's gradients and in my slices'."""
        raise NotImplementedError("TODO 2.4: as torch.optim's zero_grad, for the model's parameters AND the slices self.optim steps (None if set_to_none, else zeros)")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        raise NotImplementedError('TODO 2.4: self.optim steps my slices (.grad: what the hooks reduced); then all ranks hold every updated slice; all_gather_single')
        return loss
