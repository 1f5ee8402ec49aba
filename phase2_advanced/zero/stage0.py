"""ZeRO, stage 0 and what stages 1 and 2 share: a torch optimizer that wraps any torch.optim optimizer (given).

Stages 0-2 wrap ANY torch.optim optimizer, the way torch's ZeroRedundancyOptimizer does:
they are torch optimizers themselves (param_groups, zero_grad, LR schedulers), built from
parameters (or param-group dicts), an optimizer class and its keyword arguments; each rank
builds that class (`self.optim`) over its own share only:

    optimizer = ZeroStage2(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    for inputs, targets in batches:               # this rank's share of each batch
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()  # no DDP: the stage averages the gradients
        optimizer.step()                            # every rank ends with the same parameters

ShardedOptimizer does the plumbing; DataParallelOptimizer, stage 0, shards nothing: the
baseline (16Ψ bytes per rank with Adam) that stages 1-3 are measured against.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


def _require_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{who} needs a process group: call common.distributed.init_distributed() first "
                         "(or run under common.launch.run_world / torchrun)")


def _hyperparameters(group: dict) -> dict:
    """A param group's settings: everything but its parameters (and their names)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


class ShardedOptimizer(torch.optim.Optimizer):
    """What stages 0-2 share: a torch optimizer over ALL of `params` (so `param_groups`,
    `zero_grad()` and LR schedulers see every parameter, as with one process) that steps
    through `self.optim`, an `optimizer_class(..., **defaults)` this rank builds over its
    own share only (`_build`).

    Trainable parameters (requires_grad; each once, however often it is listed or used:
    a tied weight is one parameter) are `self.trainable`, in group order; frozen ones are
    left alone, as torch.optim leaves a parameter that has no .grad. Every rank must hold
    the same initial parameters (same seed, or broadcast them first), see its own share of
    each batch with local batches of equal size (gradients are plainly averaged), and skip
    the same parameters in a backward (they run the same model). `step()` averages the
    gradients itself: do not wrap the model in DDP too.

    Not supported (a one-line error): add_param_group after construction (NotImplementedError);
    loading a state_dict saved by another rank or world size (ValueError); a process group
    other than the world. Raises TypeError unless optimizer_class is a torch.optim.Optimizer
    subclass, and ValueError if no parameter requires a gradient.
    """

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer], **defaults: Any):
        _require_process_group(type(self).__name__)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"{type(self).__name__} wraps a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                            f"got {optimizer_class!r}")
        self.optimizer_class = optimizer_class
        self.optim: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.trainable: list[nn.Parameter] = list(dict.fromkeys(
            p for group in self.param_groups for p in group["params"] if p.requires_grad))
        if not self.trainable:
            raise ValueError(f"{type(self).__name__}: no parameter requires a gradient")

    def _build(self, params_per_group: Sequence[Sequence[torch.Tensor]]) -> None:
        """self.optim = optimizer_class over these tensors, list g in a group with self.param_groups[g]'s settings
        (an empty list keeps the group). self.param_groups then shows every setting the optimizer uses."""
        groups = [{**_hyperparameters(group), "params": list(params)}
                  for group, params in zip(self.param_groups, params_per_group, strict=True)]
        self.optim = self.optimizer_class(groups, **self.defaults)
        for ours, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in _hyperparameters(local).items():
                ours.setdefault(key, value)

    def _sync_hyperparameters(self) -> None:
        """What was set on self.param_groups (an LR scheduler, by hand) reaches the wrapped optimizer."""
        for ours, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update(_hyperparameters(ours))

    @staticmethod
    def _evaluate(closure: Callable[[], Any] | None) -> Any:
        """As torch.optim: the closure (forward and backward) runs once, with autograd on, before the step."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.optim is not None:
            raise NotImplementedError(f"{type(self).__name__}.add_param_group after construction is not supported: "
                                      "build a new optimizer with every group")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """THIS rank's share: the wrapped optimizer's state_dict, with the rank and world size it belongs to.
        Save one per rank; load it into the same rank of a world of the same size, same parameters."""
        self._sync_hyperparameters()
        return {"world_size": self.world_size, "rank": self.rank, "local": self.optim.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("rank"), state_dict.get("world_size"))
        if saved != (self.rank, self.world_size):
            raise ValueError(f"{type(self).__name__}.load_state_dict: this is the share of rank {saved[0]} of "
                             f"{saved[1]}, this rank is {self.rank} of {self.world_size}; resharding is not supported")
        self.optim.load_state_dict(state_dict["local"])
        for ours, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            ours.update(_hyperparameters(local))


class DataParallelOptimizer(ShardedOptimizer):
    """Stage 0, the baseline: every rank steps every parameter on the all-reduced gradients (16Ψ with Adam)."""

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer], **defaults: Any):
        super().__init__(params, optimizer_class, **defaults)
        self._build([[p for p in dict.fromkeys(group["params"]) if p.requires_grad] for group in self.param_groups])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        self.optim.step()
        return loss
