"""Exercise 2.4: ZeRO-style sharding of optimizer state, gradients and parameters, by hand.

Data parallelism on N ranks keeps N identical copies of everything. Adam in fp32 costs,
per rank, 4 bytes of parameter + 4 of gradient + 8 of state (exp_avg, exp_avg_sq) for
each of the Ψ parameters: 16Ψ. ZeRO keeps 1/N of it on each rank instead:

    flat parameter vector, padded to N equal shards:  [ shard 0 | shard 1 | ... | shard N-1 ]

                      parameters        gradients          Adam state     bytes per rank
    DataParallelAdam  all               all (all-reduce)   all            16Ψ
    ZeroStage1        all               all (all-reduce)   my shard       4Ψ + 4Ψ + 8Ψ/N
    ZeroStage2        all               my shard (r-s)     my shard       4Ψ + 12Ψ/N
    ZeroStage3        my shard (+1      my shard (r-s)     my shard       16Ψ/N
                      layer, gathered)

    stage 1/2 step:  grads --all-reduce or reduce-scatter--> my grad shard
                     Adam on my shard only -> my new param shard --all-gather--> every param
    stage 3:         before a layer runs (forward AND backward): all-gather its params,
                     free them right after; its grads are reduce-scattered as soon as
                     they exist; step = Adam on my shards, nothing to gather.

Ψ is "up to padding": `zero_state_bytes` gives the exact numbers, which the tests
measure (`state_bytes`, the storages each rank really holds).

Communication per step (elements sent per rank, ring algorithms, large N): DP's
all-reduce is 2Ψ (= reduce-scatter Ψ + all-gather Ψ); stage 2 is exactly that; stage 1
as written here all-reduces THEN all-gathers (3Ψ; reduce-scatter would do, see stage
2); stage 3 all-gathers twice and reduce-scatters once: 3Ψ, 1.5x DP.

Collectives: dist.reduce_scatter_tensor and dist.all_gather_into_tensor run on NCCL and
on gloo (torch >= 2.4; gloo emulates reduce-scatter by an all-reduce and keeps one chunk,
moving twice the data; NCCL runs a real ring reduce-scatter).

Production: torch.distributed.fsdp.fully_shard (FSDP2: stage 3, per-parameter shards),
DeepSpeed ZeRO stages 1-3, torch.distributed.optim.ZeroRedundancyOptimizer (stage 1).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0) -> None:
    """One torch.optim.Adam step (amsgrad=False), in place, on same-shaped tensors; `step` counts from 1.

        g = grad + weight_decay * param          m = b1*m + (1-b1)*g      v = b2*v + (1-b2)*g*g
        param -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)

    Element-wise: updating a slice of a flat vector is updating those parameters.
    """
    # EXERCISE 2.4: torch.optim.Adam's math: g = grad + wd*param; exp_avg.lerp_(g, 1-b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2); denom = (sqrt(v)/sqrt(1-b2^t)).add_(eps); param.addcdiv_(exp_avg, denom, value=-lr/(1-b1^t))
    beta1, beta2 = betas
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    # END EXERCISE


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


class ShardedAdam:
    """What every stage shares: the model, Adam's hyperparameters, the step count, the bookkeeping.

    Use: forward and loss.backward() as usual, then `step()`; `step()` leaves the
    gradients zeroed or freed for the next step (do not call model.zero_grad()).
    Every rank must hold the same initial parameters (build the model with the same seed,
    or broadcast it first, as in phase 1) and see its own share of each batch, with the
    local batches of equal size (the gradients are plainly averaged).
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

    # ---------------------------------------------------------------- measuring

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The stage's own buffers, by kind; the model's parameters and .grad are added by state_bytes."""
        return {"params": [], "grads": [], "optimizer": []}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: {'params', 'grads', 'optimizer', 'total'}.

        Sums the storages of the model's parameters and their .grad, plus the stage's own
        buffers (held_tensors), each storage counted once and whole (a parameter that is a
        view into a flat buffer counts as that buffer; a freed storage counts 0).
        """
        own = self.held_tensors()
        groups = {
            "params": list(self.model.parameters()) + own["params"],
            "grads": [p.grad for p in self.model.parameters() if p.grad is not None] + own["grads"],
            "optimizer": own["optimizer"],
        }
        seen, result = set(), {}
        for kind, tensors in groups.items():
            result[kind] = 0
            for t in tensors:
                storage = t.untyped_storage()
                key = (str(t.device), storage.data_ptr())
                if storage.nbytes() and key not in seen:
                    seen.add(key)
                    result[kind] += storage.nbytes()
        result["total"] = sum(result.values())
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: full parameter}, a copy. Call it on every rank (stage 3 gathers)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


class DataParallelAdam(ShardedAdam):
    """Stage 0, the baseline: every rank keeps everything and all-reduces the gradients (16Ψ)."""

    stage = 0

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        for p in self.params:  # gradients live for the whole run, as in DDP's buckets
            p.grad = torch.zeros_like(p)

    def held_tensors(self):
        return {"params": [], "grads": [], "optimizer": self.exp_avg + self.exp_avg_sq}

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for p, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq):
            dist.all_reduce(p.grad)
            p.grad.div_(self.world_size)
            self.adam(p, p.grad, exp_avg, exp_avg_sq)
            p.grad.zero_()


class ZeroStage1(ShardedAdam):
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

    def held_tensors(self):
        return {"params": [self.flat.data], "grads": [self.flat_grad], "optimizer": [self.exp_avg, self.exp_avg_sq]}

    @torch.no_grad()
    def step(self) -> None:
        _check_grad_views(self.params, self.flat_grad)
        self.step_count += 1
        # EXERCISE 2.4: all-reduce self.flat_grad and divide by N; Adam (self.adam) on the slice [flat.lo:flat.hi] of flat.data with that slice of the grad and your shard state; all_gather_into_tensor(flat.data, a copy of your slice); zero flat_grad
        flat, grad = self.flat, self.flat_grad
        dist.all_reduce(grad)
        grad.div_(self.world_size)
        mine = flat.data[flat.lo:flat.hi]
        self.adam(mine, grad[flat.lo:flat.hi], self.exp_avg, self.exp_avg_sq)
        dist.all_gather_into_tensor(flat.data, mine.clone())
        grad.zero_()
        # END EXERCISE


class ZeroStage2(ShardedAdam):
    """+ gradients sharded: after backward the full grads are reduce-scattered into my shard and freed."""

    stage = 2

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        self.flat = FlatParams(self.params, self.world_size, self.rank)
        data = self.flat.data
        self.grad_shard = torch.zeros(self.flat.shard_size, dtype=data.dtype, device=data.device)
        self.exp_avg = torch.zeros_like(self.grad_shard)
        self.exp_avg_sq = torch.zeros_like(self.grad_shard)

    def held_tensors(self):
        return {"params": [self.flat.data], "grads": [self.grad_shard], "optimizer": [self.exp_avg, self.exp_avg_sq]}

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        # EXERCISE 2.4: dist.reduce_scatter_tensor(self.grad_shard, self.flat.flat_grad()) and divide by N; free every p.grad (= None); Adam on your slice of flat.data; all-gather the slices into flat.data
        flat = self.flat
        dist.reduce_scatter_tensor(self.grad_shard, flat.flat_grad())
        self.grad_shard.div_(self.world_size)
        for p in self.params:
            p.grad = None
        mine = flat.data[flat.lo:flat.hi]
        self.adam(mine, self.grad_shard, self.exp_avg, self.exp_avg_sq)
        dist.all_gather_into_tensor(flat.data, mine.clone())
        # END EXERCISE


class ZeroStage3(ShardedAdam):
    """+ parameters sharded, per top-level layer (each child of `model` with parameters is a unit).

    Between uses a unit keeps only `unit.shard` (its slice, a copy) and the storage of
    `unit.data` (the full flat buffer its parameters are views of) is freed, 0 bytes.
    Hooks bring the parameters back exactly when they are needed:

        forward pre-hook       unshard(unit)                       all-gather
        forward hook           reshard(unit); hook on the output:  free; arm pre-backward
        output's grad ready    unshard(unit)                       all-gather (backward needs W)
        every param's grad     reduce_gradients(unit)              reduce-scatter, free grads
          accumulated          reshard(unit)                       free

    The free is storage().resize_(0), not `p.data = empty`: autograd saved views of the
    weights in forward (Linear keeps W for the input gradient), and only shrinking the
    storage those views point into really releases the memory; all-gathering into the
    resized storage makes them valid again for backward.

    Between steps the model's parameters have no storage: read them with
    `full_state_dict()` (on every rank), not `model.state_dict()`.
    """

    stage = 3

    def __init__(self, model: nn.Module, **adam_args):
        super().__init__(model, **adam_args)
        if any(p.requires_grad for p in model.parameters(recurse=False)):
            raise ValueError("ZeroStage3 shards per child module: move the parameters registered on the root "
                             "module into a child (e.g. wrap the layers in nn.Sequential)")
        self.units: list[FlatParams] = []
        for child in model.children():
            params = [p for p in child.parameters() if p.requires_grad]
            if not params:
                continue
            unit = FlatParams(params, self.world_size, self.rank)
            unit.shard = unit.data[unit.lo:unit.hi].clone()
            unit.grad_shard = torch.zeros_like(unit.shard)
            unit.exp_avg = torch.zeros_like(unit.shard)
            unit.exp_avg_sq = torch.zeros_like(unit.shard)
            unit.grads_ready = 0
            self.reshard(unit)
            child.register_forward_pre_hook(lambda module, args, unit=unit: self._pre_forward(unit))
            child.register_forward_hook(lambda module, args, output, unit=unit: self._post_forward(unit, output))
            for p in params:
                p.register_post_accumulate_grad_hook(lambda param, unit=unit: self._post_accumulate_grad(unit))
            self.units.append(unit)

    def held_tensors(self):
        units = self.units
        return {"params": [u.data for u in units] + [u.shard for u in units],
                "grads": [u.grad_shard for u in units],
                "optimizer": [u.exp_avg for u in units] + [u.exp_avg_sq for u in units]}

    @staticmethod
    def is_unsharded(unit: FlatParams) -> bool:
        return unit.data.untyped_storage().nbytes() > 0

    def unshard(self, unit: FlatParams) -> None:
        """Give unit.data its storage back and fill it with every rank's shard: the parameters are whole."""
        # EXERCISE 2.4: unit.data.untyped_storage().resize_(padded * element_size), then dist.all_gather_into_tensor(unit.data, unit.shard)
        unit.data.untyped_storage().resize_(unit.padded * unit.data.element_size())
        dist.all_gather_into_tensor(unit.data, unit.shard)
        # END EXERCISE

    def reshard(self, unit: FlatParams) -> None:
        """Free the full parameters of the unit (its shard stays)."""
        # EXERCISE 2.4: shrink the storage behind unit.data (and so behind every parameter view) to 0 bytes
        unit.data.untyped_storage().resize_(0)
        # END EXERCISE

    def reduce_gradients(self, unit: FlatParams) -> None:
        """Reduce-scatter the unit's full local gradients into unit.grad_shard (averaged, accumulated); free them."""
        # EXERCISE 2.4: reduce_scatter_tensor of unit.flat_grad() into a new shard-sized tensor; add it / N to unit.grad_shard; set every p.grad of the unit to None
        shard = torch.empty_like(unit.grad_shard)
        dist.reduce_scatter_tensor(shard, unit.flat_grad())
        unit.grad_shard.add_(shard, alpha=1.0 / self.world_size)
        for p in unit.params:
            p.grad = None
        # END EXERCISE

    def _pre_forward(self, unit: FlatParams) -> None:
        self.unshard(unit)

    def _post_forward(self, unit: FlatParams, output) -> None:
        self.reshard(unit)
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: FlatParams) -> None:
        if not self.is_unsharded(unit):  # a tuple output calls this once per tensor
            self.unshard(unit)

    def _post_accumulate_grad(self, unit: FlatParams) -> None:
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):  # the unit's backward is complete
            unit.grads_ready = 0
            self.reduce_gradients(unit)
            self.reshard(unit)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        # EXERCISE 2.4: for every unit: Adam on unit.shard with unit.grad_shard and its state, then zero unit.grad_shard (nothing to gather: the next forward does)
        for unit in self.units:
            self.adam(unit.shard, unit.grad_shard, unit.exp_avg, unit.exp_avg_sq)
            unit.grad_shard.zero_()
        # END EXERCISE

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
    """Trainable parameter counts of the children of `model` that have some: ZeroStage3's units."""
    counts = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model.children()]
    return [c for c in counts if c]


def zero_state_bytes(stage: int, unit_numels: Sequence[int], world_size: int, element_size: int = 4) -> dict[str, int]:
    """Exact bytes one rank holds between steps, for the classes above ({'params', 'grads', 'optimizer', 'total'}).

    With Ψ = sum(unit_numels), N = world_size, e = element_size (4 for fp32):
      stage 0 (DP):  e*Ψ params,  e*Ψ grads,  2e*Ψ Adam                              = 16Ψ
      stages 1, 2:   one flat vector padded to P = N*ceil(Ψ/N), shards of S = P/N:
        stage 1:     e*P params,  e*P grads,  2e*S Adam                              ~ 4Ψ + 4Ψ + 8Ψ/N
        stage 2:     e*P params,  e*S grads,  2e*S Adam                              ~ 4Ψ + 12Ψ/N
      stage 3:       one padded vector per unit (layer): S3 = sum over units of ceil(Ψ_u/N):
                     e*S3 params, e*S3 grads, 2e*S3 Adam                             ~ 16Ψ/N
    """
    if stage not in STAGES or world_size < 1 or not unit_numels:
        raise ValueError(f"need a stage in 0..3, world_size >= 1 and some unit sizes; got {stage}, {world_size}, {unit_numels}")
    psi, e, n = sum(unit_numels), element_size, world_size
    shard = -(-psi // n)
    if stage == 0:
        params, grads, optim = e * psi, e * psi, 2 * e * psi
    elif stage == 1:
        params, grads, optim = e * shard * n, e * shard * n, 2 * e * shard
    elif stage == 2:
        params, grads, optim = e * shard * n, e * shard, 2 * e * shard
    else:
        s3 = sum(-(-u // n) for u in unit_numels)
        params, grads, optim = e * s3, e * s3, 2 * e * s3
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
