"""Exercise 2.4: ZeRO-style sharding of optimizer state, gradients and parameters, by hand.

Data parallelism on N ranks keeps N identical copies of everything. Adam in fp32 costs,
per rank, 4 bytes of parameter + 4 of gradient + 8 of state (exp_avg, exp_avg_sq) for
each of the Ψ parameters: 16Ψ. ZeRO keeps 1/N of it on each rank instead. Parameters
are laid end to end in flat vectors padded to N equal shards, rank r owning shard r:
stage 1 has one vector for the model, stages 2 and 3 one per *unit* (each child of
`model` that has parameters: a layer, a transformer block, as FSDP wraps them).

                      parameters        gradients                 Adam state  bytes per rank
    DataParallelAdam  all               all (all-reduce)          all         16Ψ
    ZeroStage1        all               all (all-reduce)          my shard    4Ψ + 4Ψ + 8Ψ/N
    ZeroStage2        all               my shard (reduce-scatter  my shard    4Ψ + 12Ψ/N
                                        unit by unit in backward)
    ZeroStage3        my shard (+ the   my shard (same)           my shard    16Ψ/N
                      running unit's)

    stage 1 step:  all-reduce the gradient; Adam on my shard; all-gather the parameters
    stage 2:       during backward, as soon as a unit's gradients all exist, reduce-scatter
                   them into my gradient shard and free them (the full gradient never
                   exists at once); step: Adam on my shards; all-gather the parameters
    stage 3:       + a unit's parameters are all-gathered just before it runs (forward AND
                   backward) and freed right after; step: Adam on my shards, no gather

Communication per step, elements each rank sends (ring algorithms): DP's all-reduce is
2Ψ(N-1)/N = a reduce-scatter plus an all-gather; stage 2 is exactly those two; stage 1
as written here all-reduces THEN all-gathers (3Ψ(N-1)/N; a reduce-scatter would do);
stage 3 all-gathers twice and reduce-scatters once: 1.5x DP. On gloo (torch 2.15)
reduce_scatter_tensor runs an all-reduce inside and keeps one chunk (all-reduce's
traffic); NCCL runs a real ring reduce-scatter.

`zero_state_bytes` gives the bytes per rank, padding included; common.measure's
`training_memory(model, optimizer)` measures them (phase2_advanced/guidelines.md, 2.4).

Production: torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6 under that name:
stage 3, per-parameter shards), DeepSpeed ZeRO stages 1-3,
torch.distributed.optim.ZeroRedundancyOptimizer (stage 1).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

# Runs a callback once the current backward pass has finished (public in recent torch;
# older versions only have the engine's method, which DDP and FSDP call).
queue_callback = getattr(torch.autograd.graph, "queue_callback", None) \
    or torch.autograd.Variable._execution_engine.queue_callback


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
    """(child, its trainable parameters) for each child of `model` that has some: the units of stages 2 and 3."""
    if any(p.requires_grad for p in model.parameters(recurse=False)):
        raise ValueError("ZeRO stages 2 and 3 shard per child module: move the parameters registered on the root "
                         "module into a child (e.g. wrap the layers in nn.Sequential)")
    units = [(child, [p for p in child.parameters() if p.requires_grad]) for child in model.children()]
    return [(child, params) for child, params in units if params]


class AdamBase:
    """What DataParallelAdam and every ZeRO stage share: the model, Adam's hyperparameters, the step count.

    Use: forward and loss.backward() as usual (several backward passes accumulate, as
    .grad does), then `step()`; `step()` leaves the gradients zeroed or freed for the
    next step (do not call model.zero_grad()). Every rank must hold the same initial
    parameters (build the model with the same seed, or broadcast it first, as in phase 1)
    and see its own share of each batch, with the local batches of equal size (the
    gradients are plainly averaged). A parameter that gets no gradient in a backward
    counts as a zero gradient (the same parameters on every rank).
    """

    stage = -1

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{type(self).__name__} needs a process group: call common.distributed.init_distributed() "
                             "first (or run under common.launch.run_world / torchrun)")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"need lr >= 0, eps >= 0, weight_decay >= 0 and 0 <= betas < 1; got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameter that requires a gradient")
        self.names = {p: name for name, p in model.named_parameters()}
        self.step_count = 0

    def adam(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        adam_update(param, grad, exp_avg, exp_avg_sq, self.step_count, self.lr, self.betas, self.eps, self.weight_decay)

    def step(self) -> None:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full parameter}, a copy. Call it on every rank (stage 3 gathers)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


class DataParallelAdam(AdamBase):
    """Stage 0, the baseline: every rank keeps everything and all-reduces the gradients (16Ψ)."""

    stage = 0

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        for p in self.params:  # gradients live for the whole run, as in DDP's buckets
            p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for p, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq):
            dist.all_reduce(p.grad)
            p.grad.div_(self.world_size)
            self.adam(p, p.grad, exp_avg, exp_avg_sq)
            p.grad.zero_()


class ZeroStage1(AdamBase):
    """Optimizer state sharded: full params, full (persistent) grads, Adam state for my shard only.

    The parameters are views into `self.flat.data`, their .grad views into `self.flat_grad`
    (so backward accumulates straight into one flat vector).
    """

    stage = 1

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        self.flat = FlatParams(self.params, self.world_size, self.rank)
        self.flat_grad = torch.zeros_like(self.flat.data)
        for p, grad in zip(self.params, self.flat.split(self.flat_grad)):
            p.grad = grad
        self.exp_avg = torch.zeros(self.flat.shard_size, dtype=self.flat.data.dtype, device=self.flat.data.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)

    @torch.no_grad()
    def step(self) -> None:
        _check_grad_views(self.params, self.flat_grad)
        self.step_count += 1
        raise NotImplementedError('TODO 2.4: every rank ends with the parameters DP would have, having run Adam on its own shard only (state: self.exp_avg, self.exp_avg_sq); the gradient is left zeroed. Collectives: all-reduce, then dist.all_gather_into_tensor')


class ZeroStage2(AdamBase):
    """+ gradients sharded, unit by unit during backward: each rank keeps only its shard of them.

    `self.units` holds one FlatParams per unit (sharding_units), with `grad_shard` and
    Adam's `exp_avg`, `exp_avg_sq` for this rank's shard. Backward hooks reduce a unit's
    gradients as soon as they all exist, so about one unit's full gradients exist at a
    time, never the whole model's:

        a parameter's .grad is accumulated   _post_accumulate_grad   the unit's last one: backward_done(unit)
        the backward pass has finished       _end_of_backward        units not done (a parameter got no
                                                                     gradient this time): backward_done now

    Every unit is reduced exactly once per backward pass, in the same order on every
    rank. The shards accumulate over backward passes until step(), as .grad would.
    """

    stage = 2

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        self.units: list[FlatParams] = []
        for _, params in sharding_units(model):
            unit = FlatParams(params, self.world_size, self.rank)
            unit.grad_shard = torch.zeros(unit.shard_size, dtype=unit.data.dtype, device=unit.data.device)
            unit.exp_avg = torch.zeros_like(unit.grad_shard)
            unit.exp_avg_sq = torch.zeros_like(unit.grad_shard)
            unit.grads_ready = 0  # parameters of the unit whose gradient this backward pass produced
            unit.done = False  # backward_done(unit) ran in this backward pass
            for p in params:
                p.register_post_accumulate_grad_hook(lambda param, unit=unit: self._post_accumulate_grad(unit))
            self.units.append(unit)
        self.end_queued = False  # _end_of_backward is queued for the running backward pass

    def reduce_gradients(self, unit: FlatParams) -> None:
        """Add the rank-average of the unit's gradients (None = zeros) to unit.grad_shard; free every p.grad."""
        raise NotImplementedError("TODO 2.4: unit.grad_shard += this rank's shard of (sum over ranks of the unit's flat gradient) / N, then every p.grad of the unit is None. Collective: dist.reduce_scatter_tensor (unit.flat_grad() builds its input)")

    def backward_done(self, unit: FlatParams) -> None:
        """The unit has all the gradients this backward pass will give it."""
        self.reduce_gradients(unit)
        unit.done = True

    def _post_accumulate_grad(self, unit: FlatParams) -> None:
        """Hook: one parameter of `unit` has its gradient of this backward pass in .grad."""
        raise NotImplementedError('TODO 2.4: call backward_done(unit) once every parameter of the unit has its gradient of this pass, and make sure _end_of_backward runs once when this backward pass ends (pointer: queue_callback, above)')

    def _end_of_backward(self) -> None:
        """Callback after the backward pass: finish the units some parameter of which got no gradient."""
        raise NotImplementedError('TODO 2.4: every unit not done in this pass is done now (in self.units order, the same on every rank); then reset the per-pass bookkeeping for the next backward')

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        raise NotImplementedError("TODO 2.4: for every unit: Adam on this rank's slice of unit.data with unit.grad_shard and the unit's state; every rank then gets every updated slice (dist.all_gather_into_tensor); the shard is zeroed for the next step")


class ZeroStage3(ZeroStage2):
    """+ parameters sharded: between uses a unit keeps only `unit.shard` (its slice, a copy).

    The storage of `unit.data` (the flat buffer its parameters are views of) is freed,
    0 bytes, except while the unit runs. Stage 2's gradient hooks, plus:

        forward pre-hook      _pre_forward     unshard (all-gather)
        forward hook          _post_forward    reshard (free); hook the output for backward
        output's grad ready   _pre_backward    unshard (backward needs W for dL/dx)
        backward_done(unit)                    reduce the gradients (stage 2), then reshard

    Between steps the model's parameters have no storage: read them with
    `full_state_dict()` (on every rank), not `model.state_dict()`.
    """

    stage = 3

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        for (child, _), unit in zip(sharding_units(model), self.units):
            unit.shard = unit.data[unit.lo:unit.hi].clone()
            self.reshard(unit)
            child.register_forward_pre_hook(lambda module, args, unit=unit: self._pre_forward(unit))
            child.register_forward_hook(lambda module, args, output, unit=unit: self._post_forward(unit, output))

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

    def backward_done(self, unit: FlatParams) -> None:
        raise NotImplementedError("TODO 2.4: as in stage 2, and the unit's full parameters are freed again")

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        raise NotImplementedError('TODO 2.4: for every unit: Adam on unit.shard with unit.grad_shard and its state, then the grad shard is zeroed (nothing to gather: the next forward does)')

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        result = {}
        for unit in self.units:
            full = unit.shard.new_empty(unit.padded)
            dist.all_gather_into_tensor(full, unit.shard)
            for p, value in zip(unit.params, unit.split(full)):
                result[self.names[p]] = value.clone()
        return {name: result[name] for name, _ in self.model.named_parameters()}


STAGES = {0: DataParallelAdam, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def _check_grad_views(params: Sequence[nn.Parameter], flat_grad: torch.Tensor) -> None:
    ptr = flat_grad.untyped_storage().data_ptr()
    if any(p.grad is None or p.grad.untyped_storage().data_ptr() != ptr for p in params):
        raise RuntimeError("a parameter's .grad is no longer a view into flat_grad (model.zero_grad() or "
                           "optimizer.zero_grad() replaced it): let ZeroStage1.step() zero the gradients")


# ---------------------------------------------------------------- the formulas


def layer_numels(model: nn.Module) -> list[int]:
    """Trainable parameter counts of the children of `model` that have some: the units of stages 2 and 3."""
    counts = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model.children()]
    return [c for c in counts if c]


def zero_state_bytes(stage: int, unit_numels: Sequence[int], world_size: int, element_size: int = 4) -> dict[str, int]:
    """Bytes one rank holds between steps, for the classes above ({'params', 'grads', 'optimizer', 'total'}).

    The kinds are those of common.measure.training_memory: 'params' and 'grads' are the
    model's full parameters and their .grad; 'optimizer' is what the optimizer keeps
    besides (shards of parameters and gradients, Adam state). With Ψ = sum(unit_numels),
    N = world_size, e = element_size (4 for fp32), shards padded to equal sizes:
      stage 0 (DP):  e*Ψ params,  e*Ψ grads,  2e*Ψ Adam                              = 16Ψ
      stage 1:       one flat vector padded to P = N*ceil(Ψ/N), shards of S = P/N:
                     e*P params,  e*P grads,  2e*S Adam                              ~ 4Ψ + 4Ψ + 8Ψ/N
      stages 2, 3:   one padded vector per unit: P2 = sum of N*ceil(Ψ_u/N), shards S2 = P2/N:
        stage 2:     e*P2 params, 0 grads,    3e*S2 (grad shard + Adam)               ~ 4Ψ + 12Ψ/N
        stage 3:     0 params,    0 grads,    4e*S2 (+ param shard)                   ~ 16Ψ/N
    """
    if stage not in STAGES or world_size < 1 or not unit_numels:
        raise ValueError(f"need a stage in 0..3, world_size >= 1 and some unit sizes; got {stage}, {world_size}, {unit_numels}")
    psi, e, n = sum(unit_numels), element_size, world_size
    shard = -(-psi // n)
    s2 = sum(-(-u // n) for u in unit_numels)
    if stage == 0:
        params, grads, optim = e * psi, e * psi, 2 * e * psi
    elif stage == 1:
        params, grads, optim = e * shard * n, e * shard * n, 2 * e * shard
    elif stage == 2:
        params, grads, optim = e * s2 * n, 0, 3 * e * s2
    else:
        params, grads, optim = 0, 0, 4 * e * s2
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
