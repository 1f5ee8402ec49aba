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

Stage 3 shards the parameters too, so between uses no rank holds a whole one: it is a
MODULE wrapper, as both FSDP generations are, whose parameters are this rank's shards, and
any element-wise torch.optim optimizer steps them:

    sharded = ZeroStage3(model, compute_dtype=torch.bfloat16)    # optional: gather and compute in bf16
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ... optimizer.zero_grad(); loss_fn(sharded(inputs).float(), targets).backward(); optimizer.step()

    ZeroStage3  each unit (each child of `model` that has trainable parameters, as FSDP wraps
                them) laid out in one flat buffer padded to N equal slices (FSDP1's flat
                parameter): rank r's slice, an fp32 nn.Parameter, replaces the unit's
                parameters in the model; hooks gather the unit just before it runs (forward,
                and again for backward) and free it after, and reduce-scatter its gradients
                into the slice's .grad as soon as backward has produced them.

                         parameters        gradients                 optimizer state   bytes per rank, Adam
    DataParallelOptimizer all              all (all-reduce)          all               16Ψ
    ZeroStage1           all               all (all-reduce)          my parameters     4Ψ + 4Ψ + 8Ψ/N (+ imbalance)
    ZeroStage2           all               my slices (reduce-scatter my slices         4Ψ + 12Ψ/N
                                           per parameter in backward)
    ZeroStage3           my slices (+ the  my slices (same, per      my slices         16Ψ/N
                         running unit's)   unit)                     (the optimizer's)

Communication per step, elements each rank sends (ring algorithms): DP's all-reduce is
2Ψ(N-1)/N = a reduce-scatter plus an all-gather; stage 2 is exactly those two; stage 1
all-reduces then broadcasts every parameter from its owner (a broadcast sends the whole
tensor: 2Ψ(N-1)/N + Ψ); stage 3 all-gathers twice and reduce-scatters once: 1.5x DP. On
gloo (torch 2.14) reduce_scatter_single runs an all-reduce inside and keeps one chunk
(all-reduce's traffic); NCCL runs a real ring reduce-scatter.

`zero_state_bytes` gives the bytes per rank, padding included; common.measure's
`training_memory(model, optimizer)` measures them (phase2_advanced/guidelines.md, 2.4).

Production: torch.distributed.optim.ZeroRedundancyOptimizer (stage 1, whole parameters),
DeepSpeed ZeRO stages 1-3 (flat partitions), torch.distributed.fsdp.fully_shard (FSDP2,
torch >= 2.6 under that name: stage 3, every parameter a DTensor sharded on dim 0; the
guidelines, 2.4, "From ZeRO-3 to FSDP2", map this file onto it).
"""

from __future__ import annotations

from functools import partial
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
        # EXERCISE 2.4: self.optim (built by self._build: one list per group of self.param_groups) steps exactly the parameters self.owner gives this rank, each in the group it was given in
        self._build([[p for p in dict.fromkeys(group["params"]) if self.owner.get(p) == self.rank]
                     for group in self.param_groups])
        # END EXERCISE

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        # EXERCISE 2.4: every rank ends with the parameters one process would reach with optimizer_class on the rank-averaged gradients, having stepped only its own (self.optim); a parameter without .grad is skipped, as torch.optim does. Collectives: dist.all_reduce, dist.broadcast from each parameter's owner
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        self.optim.step()
        for p in self.trainable:
            dist.broadcast(p.detach(), src=self.owner[p])
        # END EXERCISE
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
        # EXERCISE 2.4: a ValueError for an optimizer_class that is not element-wise (self.ELEMENTWISE); per trainable parameter p: self.flat[p], a zero-padded 1-D buffer of N equal slices holding p's values (p becomes a view of it, as in FlatParams), self.shard[p] this rank's slice (a view), a hook calling self._grad_ready(p) (pointer: register_post_accumulate_grad_hook); then self.optim over the slices (self._build)
        if not issubclass(optimizer_class, self.ELEMENTWISE):
            raise ValueError(f"ZeroStage2 steps {optimizer_class.__name__} on flat slices of each parameter, right only "
                             "for element-wise updates (ZeroStage2.ELEMENTWISE); one that needs whole parameters "
                             "(Adafactor's factored moments, LAMB's per-tensor norms) needs ZeroStage1")
        for p in self.trainable:
            size = -(-p.numel() // self.world_size)
            flat = torch.zeros(size * self.world_size, dtype=p.dtype, device=p.device)
            flat[:p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[:p.numel()].view_as(p)
            self.flat[p], self.shard[p] = flat, flat[self.rank * size:(self.rank + 1) * size]
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._build([[self.shard[p] for p in dict.fromkeys(group["params"]) if p in self.shard]
                     for group in self.param_groups])
        # END EXERCISE

    @torch.no_grad()
    def _grad_ready(self, p: nn.Parameter) -> None:
        """Hook: p.grad holds p's whole gradient of this backward pass."""
        # EXERCISE 2.4: self.shard[p].grad (None: from zero) += this rank's slice of (the sum over ranks of p.grad, padded like self.flat[p]) / N; then p.grad is None. Collective: dist.reduce_scatter_single
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
        p.grad = None
        # END EXERCISE

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward accumulates from zero, in the model's gradients and in my slices'."""
        # EXERCISE 2.4: as torch.optim's zero_grad, for the model's parameters AND for the slices self.optim steps (None when set_to_none, else zeros)
        super().zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)
        # END EXERCISE

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._evaluate(closure)
        self._sync_hyperparameters()
        # EXERCISE 2.4: self.optim steps my slices (their .grad: what the hooks reduced); then every rank holds every parameter's updated slices. Collective: dist.all_gather_single (its input: a copy of my slice, or my slice of its output itself, in place)
        self.optim.step()
        for p in self.trainable:
            dist.all_gather_single(self.flat[p], self.shard[p].clone())
        # END EXERCISE
        return loss


# ---------------------------------------------------------------- stage 3: a module wrapper


class FlatParams:
    """One unit's trainable parameters laid end to end in one 1-D buffer, padded to N equal shards (FSDP1's
    flat parameter).

    `shard`: this rank's slice (elements lo:hi of the padded concatenation, hi - lo = shard_size =
    ceil(numel / N)) as an nn.Parameter of its own, in the parameters' dtype: the master copy the
    optimizer steps. `data`: the whole buffer, `padded` elements in `dtype` (the compute dtype; default
    the parameters' own). `params`: one tensor per parameter, shaped like it (`shapes`), each a view of
    `data` (`full.data = data[a:b].view(shape)`, `slices[i] = (a, b)`) and a leaf that requires grad:
    writing `data` (an all-gather into it) writes them, freeing its storage frees them, and backward
    accumulates their gradients in their .grad. Padding is zeros.
    """

    def __init__(self, params: Sequence[nn.Parameter], world_size: int, rank: int, dtype: torch.dtype | None = None):
        params = list(params)
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        first = params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            raise ValueError("all trainable parameters of a sharded unit must share one dtype and device; cast the "
                             "model first")
        self.numel = sum(p.numel() for p in params)
        self.shard_size = -(-self.numel // world_size)
        self.padded = self.shard_size * world_size
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.shapes = [p.shape for p in params]
        self.slices: list[tuple[int, int]] = []
        values = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for p in params:
                values[offset:offset + p.numel()].copy_(p.reshape(-1))
                self.slices.append((offset, offset + p.numel()))
                offset += p.numel()
        self.shard = nn.Parameter(values[self.lo:self.hi].clone())
        self.data = values.to(dtype or first.dtype)
        self.params: list[torch.Tensor] = []
        for (a, b), shape in zip(self.slices, self.shapes):
            full = torch.empty(0, dtype=self.data.dtype, device=self.data.device)
            full.data = self.data[a:b].view(shape)  # its own version counter: refilling `data` is no in-place edit
            self.params.append(full.requires_grad_())

    def flat_grad(self) -> torch.Tensor:
        """A NEW padded 1-D tensor in data's dtype: every full parameter's .grad (zeros where None) end to end, then
        zeros."""
        parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in self.params]
        parts.append(torch.zeros(self.padded - self.numel, dtype=self.data.dtype, device=self.data.device))
        return torch.cat(parts)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a padded flat tensor shaped like each parameter."""
        return [flat[a:b].view(shape) for (a, b), shape in zip(self.slices, self.shapes)]


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


def _cast_floats(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if type(value) in (tuple, list):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if type(value) is dict:
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class ZeroStage3(nn.Module):
    """Parameters, gradients and optimizer state sharded: a module wrapper whose parameters are this rank's shards.

        sharded = ZeroStage3(model, compute_dtype=torch.bfloat16)   # None: compute in the parameters' dtype
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)  # any element-wise torch.optim optimizer
        for inputs, targets in batches:                               # this rank's share of each batch
            optimizer.zero_grad()
            loss_fn(sharded(inputs).float(), targets).backward()       # shard.grad: my slice of the average
            optimizer.step()
        weights = sharded.full_state_dict()                           # every rank calls it (it gathers)

    Each unit (sharding_units: a child of `model` with trainable parameters) becomes a
    FlatParams: its `shard`, an fp32 nn.Parameter (FSDP1's flat parameter: one per unit), is
    registered on the child as `flat_param` in place of the unit's trainable parameters, which
    become plain attributes of their modules, views of `unit.data` whose storage is freed (0
    bytes) except while the unit runs. So `sharded.parameters()` (and `model.parameters()`)
    yield this rank's shards, plus frozen parameters (whole, untouched) and replicated ones
    (below): hand them to the optimizer. The optimizer sees 1-D slices that cut across
    parameters, so it must be element-wise (ZeroStage2.ELEMENTWISE); one that looks at a whole
    tensor (Adafactor, LAMB, a gradient-norm clip) runs on the slices and trains differently.
    After a backward pass each shard's .grad holds this rank's slice of the rank-averaged
    gradient, in the shard's dtype (added: passes accumulate until the optimizer's zero_grad);
    nothing needs calling after backward, nor after the step (the next forward gathers).

    `compute_dtype` (bf16 or fp16; None: the parameters' own): a unit gathers its parameters in
    it and runs forward and backward in it, its floating-point inputs cast to it; the shards
    stay in their dtype (fp32 masters), and gradients are upcast before being reduced (the
    reduce-scatter runs in the shards' dtype: MixedPrecisionPolicy(param_dtype=..., reduce_dtype=
    torch.float32) in FSDP2's words). Frozen parameters of a sharded unit must already be in it.
    `replicate_below`: a unit with fewer trainable elements stays whole on every rank, as in DDP
    (a norm layer: gathering a few hundred numbers costs a collective's latency for nothing;
    DeepSpeed's stage3_param_persistence_threshold, per unit here): its parameters stay its
    own, their gradients are all-reduced and averaged as backward produces them, and it
    computes in its parameters' dtype (its floating-point inputs cast to it when a compute
    dtype is set).

    Build the model on its device first (the full views do not move with .to()); every rank
    must hold the same initial parameters. Between steps read the weights with
    `full_state_dict()` ({name: full parameter, fp32}, on every rank); `state_dict()` is this
    rank's shards. A unit's forward may return a tensor or a tuple/list of tensors. Raises
    ValueError for a compute_dtype that is not a floating-point dtype, parameters registered on
    the root module, a parameter shared by two units, a sharded unit whose trainable parameters
    differ in dtype or device, a frozen parameter of a sharded unit not in the compute dtype,
    and if no parameter requires a gradient.

        forward pre-hook      _pre_forward     unshard (all-gather)
        forward hook          _post_forward    reshard (free); hook the output for backward
        output's grad ready   _pre_backward    unshard (backward needs W for dL/dx)
        a full parameter's    _post_accumulate_grad   the unit's last one: backward_done(unit)
          .grad is accumulated                 = reduce-scatter into shard.grad, free grads, reshard
        backward has ended    _end_of_backward units not done (a parameter got no gradient
                                               this time): backward_done now

    Every unit is reduced exactly once per backward pass, in the same order on every rank.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = None, replicate_below: int = 0):
        super().__init__()
        _require_process_group(type(self).__name__)
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
            raise ValueError(f"ZeroStage3: compute_dtype must be a floating-point dtype (torch.bfloat16, "
                             f"torch.float16) or None, got {compute_dtype!r}")
        self.module = model
        self.compute_dtype = compute_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.named = list(model.named_parameters())  # (name, parameter) as the model had them, for full_state_dict
        names = {p: name for name, p in self.named}
        self.units: list[FlatParams] = []
        self.replicated: list[nn.Parameter] = []
        for child, params in sharding_units(model):
            if sum(p.numel() for p in params) < replicate_below:
                self._replicate(child, params)
                continue
            frozen = [p for p in child.parameters() if not p.requires_grad]
            if compute_dtype is not None and any(p.dtype != compute_dtype for p in frozen):
                raise ValueError(f"ZeroStage3: `{names[frozen[0]]}` is frozen (it stays whole) in {frozen[0].dtype}, "
                                 f"but its unit computes in {compute_dtype}: cast the frozen parameters first")
            unit = FlatParams(params, self.world_size, self.rank, compute_dtype)
            unit.names = [names[p] for p in params]
            unit.grads_ready = 0  # full parameters of the unit whose gradient this backward pass produced
            unit.done = False  # backward_done(unit) ran in this backward pass
            for p, full in zip(params, unit.params):
                _replace_parameter(child, p, full)
                full.register_post_accumulate_grad_hook(lambda tensor, unit=unit: self._post_accumulate_grad(unit))
            child.register_parameter("flat_param", unit.shard)
            child.register_forward_pre_hook(partial(self._forward_pre_hook, unit), with_kwargs=True)
            child.register_forward_hook(lambda module, args, output, unit=unit: self._post_forward(unit, output))
            self.units.append(unit)
        if not self.units and not self.replicated:
            raise ValueError("ZeroStage3: the model has no parameter that requires a gradient")
        for unit in self.units:
            self.reshard(unit)
        self.end_queued = False  # _end_of_backward is queued for the running backward pass

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _replicate(self, child: nn.Module, params: list[nn.Parameter]) -> None:
        """A unit kept whole on every rank: DDP's averaged gradients, its own dtype."""
        for p in params:
            p.register_post_accumulate_grad_hook(self._replicated_grad_ready)
        self.replicated += params
        if self.compute_dtype is not None:
            dtype = params[0].dtype
            child.register_forward_pre_hook(lambda module, args, kwargs: _cast_floats((args, kwargs), dtype),
                                            with_kwargs=True)

    @torch.no_grad()
    def _replicated_grad_ready(self, p: torch.Tensor) -> None:
        """Hook: a replicated parameter's gradient of this pass is accumulated: average it over the ranks (what
        earlier passes left there is already the same on every rank, so averaging keeps it)."""
        dist.all_reduce(p.grad)
        p.grad.div_(self.world_size)

    def _forward_pre_hook(self, unit: FlatParams, module: nn.Module, args: tuple, kwargs: dict):
        self._pre_forward(unit)
        if self.compute_dtype is not None:
            return _cast_floats((args, kwargs), self.compute_dtype)
        return None

    @staticmethod
    def is_unsharded(unit: FlatParams) -> bool:
        return unit.data.untyped_storage().nbytes() > 0

    def unshard(self, unit: FlatParams) -> None:
        """Make the unit's parameters whole: unit.data gets its storage back, filled with every rank's shard."""
        # EXERCISE 2.4: re-grow the SAME storage under unit.data (the full parameters and the views autograd saved point into it), then fill it with every rank's unit.shard in unit.data's dtype; the shard itself stays as it is (the fp32 master, a Parameter that requires grad: the collective takes a tensor that does not). Pointer: Tensor.untyped_storage
        unit.data.untyped_storage().resize_(unit.padded * unit.data.element_size())
        dist.all_gather_single(unit.data, unit.shard.detach().to(unit.data.dtype))
        # END EXERCISE

    def reshard(self, unit: FlatParams) -> None:
        """Free the full parameters of the unit (its shard stays)."""
        # EXERCISE 2.4: the memory under unit.data, hence under every full parameter and every view autograd saved of them, is released (0 bytes) while those tensors stay valid objects to refill later (pointer: Tensor.untyped_storage)
        unit.data.untyped_storage().resize_(0)
        # END EXERCISE

    def _pre_forward(self, unit: FlatParams) -> None:
        """Forward pre-hook: the unit is about to run."""
        # EXERCISE 2.4: its parameters must be whole
        self.unshard(unit)
        # END EXERCISE

    def _post_forward(self, unit: FlatParams, output) -> None:
        """Forward hook: the unit has run; `output` is a tensor or a tuple/list of them."""
        # EXERCISE 2.4: free its parameters, and make _pre_backward(unit) run when backward reaches the unit (pointer: Tensor.register_hook on the outputs that require grad)
        self.reshard(unit)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        # END EXERCISE

    def _pre_backward(self, unit: FlatParams) -> None:
        """Tensor hook: the gradient of one of the unit's outputs is ready; the unit's backward is next."""
        # EXERCISE 2.4: its parameters must be whole again, gathered once even when several outputs call this
        if not self.is_unsharded(unit):
            self.unshard(unit)
        # END EXERCISE

    @torch.no_grad()
    def reduce_gradients(self, unit: FlatParams) -> None:
        """Add the rank-average of the unit's gradients (None = zeros) to unit.shard.grad; free every full .grad."""
        # EXERCISE 2.4: unit.shard.grad (None: from zero) += this rank's slice of (the sum over ranks of the unit's flat gradient, in the shard's dtype) / N; then every .grad of unit.params is None. Collective: dist.reduce_scatter_single (unit.flat_grad() builds its input)
        mine = torch.empty_like(unit.shard)
        dist.reduce_scatter_single(mine, unit.flat_grad().to(unit.shard.dtype))
        mine.div_(self.world_size)
        if unit.shard.grad is None:
            unit.shard.grad = mine
        else:
            unit.shard.grad.add_(mine)
        for p in unit.params:
            p.grad = None
        # END EXERCISE

    def backward_done(self, unit: FlatParams) -> None:
        """The unit has all the gradients this backward pass will give it."""
        # EXERCISE 2.4: its gradients are reduced (reduce_gradients), its full parameters freed again, and it counts as done for this pass
        self.reduce_gradients(unit)
        self.reshard(unit)
        unit.done = True
        # END EXERCISE

    def _post_accumulate_grad(self, unit: FlatParams) -> None:
        """Hook: one full parameter of `unit` has its gradient of this backward pass in .grad."""
        # EXERCISE 2.4: call backward_done(unit) once every parameter of the unit has its gradient of this pass, and make sure _end_of_backward runs once when this backward pass ends (pointer: queue_callback, above)
        if not self.end_queued:
            self.end_queued = True
            queue_callback(self._end_of_backward)
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):
            self.backward_done(unit)
        # END EXERCISE

    def _end_of_backward(self) -> None:
        """Callback after the backward pass: finish the units some parameter of which got no gradient."""
        # EXERCISE 2.4: every unit not done in this pass is done now (in self.units order, the same on every rank); then reset the per-pass bookkeeping for the next backward
        for unit in self.units:
            if not unit.done:
                self.backward_done(unit)
            unit.grads_ready, unit.done = 0, False
        self.end_queued = False
        # END EXERCISE

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full parameter} as `model.named_parameters()` named them before wrapping, a copy, sharded (in
        the shards' dtype), replicated and frozen ones alike. Call it on every rank (it gathers)."""
        gathered = {}
        for unit in self.units:
            full = unit.shard.new_empty(unit.padded)
            dist.all_gather_single(full, unit.shard.detach())
            gathered.update(zip(unit.names, unit.split(full)))
        return {name: (gathered[name] if name in gathered else p.detach()).clone() for name, p in self.named}


def _replace_parameter(root: nn.Module, old: nn.Parameter, new: torch.Tensor) -> None:
    """Wherever `old` is registered under `root`, it is unregistered and `new` set as a plain attribute."""
    for module in root.modules():
        for attr, value in list(module._parameters.items()):
            if value is old:
                del module._parameters[attr]
                setattr(module, attr, new)


STAGES = {0: DataParallelOptimizer, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


# ---------------------------------------------------------------- the formulas


def layer_numels(model: nn.Module) -> list[int]:
    """Trainable parameter counts of the children of `model` that have some: the units of stage 3 (call it on the
    model before wrapping it: ZeroStage3 replaces a unit's parameters by its shard)."""
    counts = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model.children()]
    return [c for c in counts if c]


def zero_state_bytes(stage: int, model: nn.Module, world_size: int, rank: int = 0,
                     element_size: int = 4) -> dict[str, int]:
    """Bytes `rank` holds after a step (before zero_grad()) with torch.optim.Adam, for the classes above.

    Keys 'params', 'grads', 'optimizer', 'total', the kinds of common.measure.training_memory:
    'params' and 'grads' are the parameters of the model (stage 3: of the ZeroStage3 wrapping
    it, i.e. this rank's shards) and their .grad; 'optimizer' is what the optimizer keeps
    besides (stage 2's slices of parameters and gradients, Adam's state, with its `step`, a
    4-byte scalar per tensor it steps). Ψ counts the trainable parameters (frozen ones add
    their bytes to 'params' everywhere), e = element_size, N = world_size:
      stage 0 (DP):  eΨ params, eΨ grads, 2eΨ Adam                                    = 16Ψ
      stage 1:       eΨ params, eΨ grads, 2e x (the elements `rank` owns)              ~ 4Ψ + 4Ψ + 8Ψ/N
      stage 2:       each parameter padded to N*S_p, S_p = ceil(numel/N), S = sum of S_p:
                     eNS params, 0 grads, 3eS (grad slices + Adam)                      ~ 4Ψ + 12Ψ/N
      stage 3:       each unit (layer_numels; all sharded) padded likewise, S3 = sum of its slices:
                     eS3 params (the shards), eS3 grads, 2eS3 Adam                      ~ 16Ψ/N
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
        units = layer_numels(model)
        s3 = sum(-(-u // n) for u in units)
        params, grads, optim = e * s3, e * s3, 2 * e * s3 + step * len(units)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
