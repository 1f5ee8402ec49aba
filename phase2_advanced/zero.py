"""Exercise 2.4: ZeRO-style sharding of optimizer state, gradients and parameters, by hand.

Data parallelism on N ranks keeps N identical copies of everything. Adam in fp32 costs,
per rank, 4 bytes of parameter + 4 of gradient + 8 of state (exp_avg, exp_avg_sq) for
each of the Ψ parameters: 16Ψ. ZeRO keeps 1/N of it on each rank instead.

Stages 1 and 2 wrap ANY torch.optim optimizer, the way torch's ZeroRedundancyOptimizer
does: they are torch optimizers themselves (param_groups, zero_grad, LR schedulers),
built from parameters (or param-group dicts), an optimizer class and its keyword
arguments; each rank builds that class (`self.optim`) over its own share only:

    optimizer = ZeroStage2(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    for inputs, targets in batches:               # this rank's share of each batch
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()  # no DDP: the stage averages the gradients
        optimizer.step()                            # every rank ends with the same parameters

How a share is cut is the design choice (guidelines, 2.4, "Whole parameters or slices"):

    ZeroStage1  whole parameters, each owned by one rank (largest first, to the least loaded):
                the wrapped optimizer sees whole tensors, so any optimizer works (Adafactor's
                factored moments, LAMB's per-tensor norms); shares balance only to within
                the largest parameter; after the step each owner broadcasts its parameters.
    ZeroStage2  every parameter cut into N equal flat slices, rank r owning slice r of each:
                exactly 1/N, gradients reduce-scattered as backward produces them (DP's
                traffic), but the wrapped optimizer sees slices: it must be element-wise
                (SGD, Adam, AdamW, ...: ZeroStage2.ELEMENTWISE); others are refused.
    ZeroStage3  parameters sharded too, flat slices per unit (each child of `model` that has
                parameters, as FSDP wraps them), stepped by its own Adam (`adam_update`):
                its slices exist only inside hooks it owns, and between steps the model's
                parameters have no storage for a torch optimizer to hold.

                         parameters        gradients                 optimizer state   bytes per rank, Adam
    DataParallelOptimizer all              all (all-reduce)          all               16Ψ
    ZeroStage1           all               all (all-reduce)          my parameters     4Ψ + 4Ψ + 8Ψ/N (+ imbalance)
    ZeroStage2           all               my slices (reduce-scatter my slices         4Ψ + 12Ψ/N
                                           per parameter in backward)
    ZeroStage3           my slices (+ the  my slices (same, per      my slices         16Ψ/N
                         running unit's)   unit)

Communication per step, elements each rank sends (ring algorithms): DP's all-reduce is
2Ψ(N-1)/N = a reduce-scatter plus an all-gather; stage 2 is exactly those two; stage 1
all-reduces then broadcasts every parameter from its owner (a broadcast sends the whole
tensor: 2Ψ(N-1)/N + Ψ); stage 3 all-gathers twice and reduce-scatters once: 1.5x DP. On
gloo (torch 2.14) reduce_scatter_tensor runs an all-reduce inside and keeps one chunk
(all-reduce's traffic); NCCL runs a real ring reduce-scatter.

`zero_state_bytes` gives the bytes per rank, padding included; common.measure's
`training_memory(model, optimizer)` measures them (phase2_advanced/guidelines.md, 2.4).

Production: torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, whole parameters),
DeepSpeed ZeRO stages 1-3 (flat partitions), torch.distributed.fsdp.fully_shard (FSDP2,
torch >= 2.6 under that name: stage 3, every parameter sharded on dim 0).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

# Runs a callback once the current backward pass has finished (public in recent torch;
# older versions only have the engine's method, which DDP and FSDP call).
queue_callback = getattr(torch.autograd.graph, "queue_callback", None) \
    or torch.autograd.Variable._execution_engine.queue_callback


def _require_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{who} needs a process group: call common.distributed.init_distributed() first "
                         "(or run under common.launch.run_world / torchrun)")


def _hyperparameters(group: dict) -> dict:
    """A param group's settings: everything but its parameters (and their names)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


# ---------------------------------------------------------------- stages 0-2: any torch.optim optimizer


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
        raise NotImplementedError('TODO 2.4: self.optim (built by self._build: one list per group of self.param_groups) steps exactly the parameters self.owner gives this rank, each in the group it was given in')

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        raise NotImplementedError("TODO 2.4: every rank ends with the parameters one process would reach with optimizer_class on the rank-averaged gradients, having stepped only its own (self.optim); a parameter without .grad is skipped, as torch.optim does. Collectives: dist.all_reduce, dist.broadcast from each parameter's owner")
        return loss


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
        raise NotImplementedError("TODO 2.4: a ValueError for an optimizer_class that is not element-wise (self.ELEMENTWISE); per trainable parameter p: self.flat[p], a zero-padded 1-D buffer of N equal slices holding p's values (p becomes a view of it, as in FlatParams), self.shard[p] this rank's slice (a view), a hook calling self._grad_ready(p) (pointer: register_post_accumulate_grad_hook); then self.optim over the slices (self._build)")

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        """Hook: p.grad holds p's whole gradient of this backward pass."""
        raise NotImplementedError("TODO 2.4: self.shard[p].grad (None: from zero) += this rank's slice of (the sum over ranks of p.grad, padded like self.flat[p]) / N; then p.grad is None. Collective: dist.reduce_scatter_tensor")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward accumulates from zero, in the model's gradients and in my slices'."""
        raise NotImplementedError("TODO 2.4: as torch.optim's zero_grad, for the model's parameters AND for the slices self.optim steps (None when set_to_none, else zeros)")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        raise NotImplementedError("TODO 2.4: self.optim steps my slices (their .grad: what the hooks reduced); then every rank holds every parameter's updated slices. Collective: dist.all_gather_into_tensor (its input: a copy of my slice, or my slice of its output itself, in place)")
        return loss


# ---------------------------------------------------------------- stage 3: its own Adam


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0) -> None:
    """One torch.optim.Adam step (amsgrad=False), in place, on same-shaped tensors; `step` counts from 1.

        g = grad + weight_decay * param          m = b1*m + (1-b1)*g      v = b2*v + (1-b2)*g*g
        param -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)

    Element-wise: updating a slice of a flat vector is updating those parameters. `grad`
    is not modified.
    """
    raise NotImplementedError('TODO 2.4: update param, exp_avg and exp_avg_sq in place as the docstring says, to float32 rounding of torch.optim.Adam (compute it in the same order: torch/optim/adam.py, _single_tensor_adam)')


class FlatParams:
    """Parameters laid end to end in one 1-D buffer, padded to N equal shards.

    After construction each parameter IS a view into `data` (`p.data = data[o:o+n]`), so
    writing `data` (e.g. an all-gather into it) writes the parameters, and freeing its
    storage frees them. Rank r owns `data[lo:hi]`, hi - lo = shard_size = ceil(numel / N).
    """

    def __init__(self, params: Sequence[nn.Parameter], world_size: int, rank: int):
        params = list(params)
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        first = params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            raise ValueError("all parameters of a sharded unit must share one dtype and device; cast the model first")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard_size = -(-self.numel // world_size)
        self.padded = self.shard_size * world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.data = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.slices = []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.data[offset:offset + n].copy_(p.reshape(-1))
                p.data = self.data[offset:offset + n].view_as(p)
                self.slices.append((offset, offset + n))
                offset += n

    def flat_grad(self) -> torch.Tensor:
        """A NEW padded 1-D tensor: every p.grad (zeros where None) end to end, then zeros."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in self.params]
        parts.append(torch.zeros(self.padded - self.numel, dtype=self.data.dtype, device=self.data.device))
        return torch.cat(parts)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a padded flat tensor shaped like each parameter."""
        return [flat[a:b].view_as(p) for p, (a, b) in zip(self.params, self.slices)]


def sharding_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(child, its trainable parameters) for each child of `model` that has some: the units of stage 3.

    A parameter shared by two children (tied weights) is refused: each unit gathers and
    frees its own buffer, so one Parameter cannot live in two (FSDP asks the same: put
    both users under one wrapped module)."""
    if any(p.requires_grad for p in model.parameters(recurse=False)):
        raise ValueError("ZeRO stage 3 shards per child module: move the parameters registered on the root "
                         "module into a child (e.g. wrap the layers in nn.Sequential)")
    units, owner = [], {}
    for name, child in model.named_children():
        params = [p for p in child.parameters() if p.requires_grad]
        for p in params:
            if p in owner:
                raise ValueError(f"ZeRO stage 3: a parameter of `{name}` is also one of `{owner[p]}` (tied weights); "
                                 "put every user of a shared parameter under one child module")
            owner[p] = name
        if params:
            units.append((child, params))
    return units


class ZeroStage3:
    """Parameters, gradients and Adam state sharded: between uses a unit keeps only `unit.shard`.

    ZeroStage3(model, lr, betas, eps, weight_decay): torch.optim.Adam's hyperparameters
    (L2 weight decay), stepped by `adam_update` on flat slices. Per unit (sharding_units)
    a FlatParams whose `data` storage is freed (0 bytes) except while the unit runs, with
    `shard` (my slice, a copy), `grad_shard`, and Adam's `exp_avg`, `exp_avg_sq`. Frozen
    parameters stay whole and unchanged. Use: zero_grad(), forward, backward (several
    accumulate), step(). Between steps the model's parameters have no storage: read them
    with `full_state_dict()` (on every rank), not `model.state_dict()`. A unit's forward may
    return a tensor or a tuple/list of tensors. Raises ValueError for what torch.optim.Adam
    refuses (lr, eps or weight_decay < 0, betas outside [0, 1)), for parameters registered
    on the root module, for a parameter shared by two units, and if none requires a gradient.

        forward pre-hook      _pre_forward     unshard (all-gather)
        forward hook          _post_forward    reshard (free); hook the output for backward
        output's grad ready   _pre_backward    unshard (backward needs W for dL/dx)
        a parameter's .grad   _post_accumulate_grad   the unit's last one: backward_done(unit)
          is accumulated                       = reduce-scatter into grad_shard, free grads, reshard
        backward has ended    _end_of_backward units not done (a parameter got no gradient
                                               this time): backward_done now

    Every unit is reduced exactly once per backward pass, in the same order on every rank.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        _require_process_group(type(self).__name__)
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"need lr >= 0, eps >= 0, weight_decay >= 0 and 0 <= betas < 1; got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.names = {p: name for name, p in model.named_parameters()}
        self.step_count = 0
        self.units: list[FlatParams] = []
        for child, params in sharding_units(model):
            unit = FlatParams(params, self.world_size, self.rank)
            unit.grad_shard = torch.zeros(unit.shard_size, dtype=unit.data.dtype, device=unit.data.device)
            unit.exp_avg = torch.zeros_like(unit.grad_shard)
            unit.exp_avg_sq = torch.zeros_like(unit.grad_shard)
            unit.grads_ready = 0  # parameters of the unit whose gradient this backward pass produced
            unit.done = False  # backward_done(unit) ran in this backward pass
            unit.shard = unit.data[unit.lo:unit.hi].clone()
            for p in params:
                p.register_post_accumulate_grad_hook(lambda param, unit=unit: self._post_accumulate_grad(unit))
            child.register_forward_pre_hook(lambda module, args, unit=unit: self._pre_forward(unit))
            child.register_forward_hook(lambda module, args, output, unit=unit: self._post_forward(unit, output))
            self.units.append(unit)
        if not self.units:
            raise ValueError("ZeroStage3: the model has no parameter that requires a gradient")
        for unit in self.units:
            self.reshard(unit)
        self.end_queued = False  # _end_of_backward is queued for the running backward pass

    @staticmethod
    def is_unsharded(unit: FlatParams) -> bool:
        return unit.data.untyped_storage().nbytes() > 0

    def unshard(self, unit: FlatParams) -> None:
        """Make the unit's parameters whole: unit.data gets its storage back, filled with every rank's shard."""
        raise NotImplementedError("TODO 2.4: re-grow the SAME storage under unit.data (the parameters and the views autograd saved point into it), then fill it from every rank's unit.shard (pointer: Tensor.untyped_storage)")

    def reshard(self, unit: FlatParams) -> None:
        """Free the full parameters of the unit (its shard stays)."""
        raise NotImplementedError('TODO 2.4: the memory under unit.data, hence under every parameter and every view autograd saved of them, is released (0 bytes) while those tensors stay valid objects to refill later (pointer: Tensor.untyped_storage)')

    def _pre_forward(self, unit: FlatParams) -> None:
        """Forward pre-hook: the unit is about to run."""
        raise NotImplementedError('TODO 2.4: its parameters must be whole')

    def _post_forward(self, unit: FlatParams, output) -> None:
        """Forward hook: the unit has run; `output` is a tensor or a tuple/list of them."""
        raise NotImplementedError('TODO 2.4: free its parameters, and make _pre_backward(unit) run when backward reaches the unit (pointer: Tensor.register_hook on the outputs that require grad)')

    def _pre_backward(self, unit: FlatParams) -> None:
        """Tensor hook: the gradient of one of the unit's outputs is ready; the unit's backward is next."""
        raise NotImplementedError('TODO 2.4: its parameters must be whole again, gathered once even when several outputs call this')

    def reduce_gradients(self, unit: FlatParams) -> None:
        """Add the rank-average of the unit's gradients (None = zeros) to unit.grad_shard; free every p.grad."""
        raise NotImplementedError("TODO 2.4: unit.grad_shard += this rank's shard of (sum over ranks of the unit's flat gradient) / N, then every p.grad of the unit is None. Collective: dist.reduce_scatter_tensor (unit.flat_grad() builds its input)")

    def backward_done(self, unit: FlatParams) -> None:
        """The unit has all the gradients this backward pass will give it."""
        raise NotImplementedError('TODO 2.4: its gradients are reduced (reduce_gradients), its full parameters freed again, and it counts as done for this pass')

    def _post_accumulate_grad(self, unit: FlatParams) -> None:
        """Hook: one parameter of `unit` has its gradient of this backward pass in .grad."""
        raise NotImplementedError('TODO 2.4: call backward_done(unit) once every parameter of the unit has its gradient of this pass, and make sure _end_of_backward runs once when this backward pass ends (pointer: queue_callback, above)')

    def _end_of_backward(self) -> None:
        """Callback after the backward pass: finish the units some parameter of which got no gradient."""
        raise NotImplementedError('TODO 2.4: every unit not done in this pass is done now (in self.units order, the same on every rank); then reset the per-pass bookkeeping for the next backward')

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward accumulates from zero (the gradient shards stay allocated, zeroed)."""
        for unit in self.units:
            unit.grad_shard.zero_()
            for p in unit.params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        raise NotImplementedError("TODO 2.4: for every unit: adam_update on unit.shard with unit.grad_shard and the unit's state (self.step_count and the hyperparameters above); nothing to gather: the next forward does")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full parameter}, a copy, sharded and frozen ones alike. Call it on every rank (it gathers)."""
        result = {}
        for unit in self.units:
            full = unit.shard.new_empty(unit.padded)
            dist.all_gather_into_tensor(full, unit.shard)
            for p, value in zip(unit.params, unit.split(full)):
                result[self.names[p]] = value.clone()
        return {name: result[name] if name in result else p.detach().clone()
                for name, p in self.model.named_parameters()}


STAGES = {0: DataParallelOptimizer, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


# ---------------------------------------------------------------- the formulas


def layer_numels(model: nn.Module) -> list[int]:
    """Trainable parameter counts of the children of `model` that have some: the units of stage 3."""
    counts = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model.children()]
    return [c for c in counts if c]


def zero_state_bytes(stage: int, model: nn.Module, world_size: int, rank: int = 0,
                     element_size: int = 4) -> dict[str, int]:
    """Bytes `rank` holds after step() (before zero_grad()) with Adam, for the classes above.

    Keys 'params', 'grads', 'optimizer', 'total', the kinds of common.measure.training_memory:
    'params' and 'grads' are the model's parameters and their .grad; 'optimizer' is what
    the optimizer keeps besides (slices of parameters and gradients, Adam's state; for
    stages 0-2 torch.optim.Adam's, with its `step`, a 4-byte scalar per tensor it steps).
    Ψ counts the trainable parameters (frozen ones add their bytes to 'params' everywhere),
    e = element_size, N = world_size:
      stage 0 (DP):  eΨ params, eΨ grads, 2eΨ Adam                                    = 16Ψ
      stage 1:       eΨ params, eΨ grads, 2e x (the elements `rank` owns)              ~ 4Ψ + 4Ψ + 8Ψ/N
      stage 2:       each parameter padded to N*S_p, S_p = ceil(numel/N), S = sum of S_p:
                     eNS params, 0 grads, 3eS (grad slices + Adam)                      ~ 4Ψ + 12Ψ/N
      stage 3:       each unit padded likewise, S3 = sum of its slices:
                     0 params, 0 grads, 4eS3 (parameter and gradient slices + Adam)      ~ 16Ψ/N
    """
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    if stage not in STAGES or world_size < 1 or not 0 <= rank < world_size or not numels:
        raise ValueError(f"need a stage in 0..3, world_size >= 1, 0 <= rank < world_size and a model with trainable "
                         f"parameters; got {stage}, {world_size}, {rank}")
    psi, e, n, step = sum(numels), element_size, world_size, 4
    if stage == 0:
        params, grads, optim = e * psi, e * psi, 2 * e * psi + step * len(numels)
    elif stage == 1:
        mine = [k for k, owner in zip(numels, partition_parameters(numels, n)) if owner == rank]
        params, grads, optim = e * psi, e * psi, 2 * e * sum(mine) + step * len(mine)
    elif stage == 2:
        s = sum(-(-k // n) for k in numels)
        params, grads, optim = e * n * s, 0, 3 * e * s + step * len(numels)
    else:
        params, grads, optim = 0, 0, 4 * e * sum(-(-u // n) for u in layer_numels(model))
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
