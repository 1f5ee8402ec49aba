"""ZeRO stage 3 (exercise 2.4): + parameters sharded, a MODULE wrapper, as both FSDP generations are.

Between uses no rank holds a whole parameter: the wrapper's parameters are this rank's
shards, and any element-wise torch.optim optimizer steps them:

    sharded = ZeroStage3(model, compute_dtype=torch.bfloat16)    # optional: gather and compute in bf16
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    ... optimizer.zero_grad(); loss_fn(sharded(inputs).float(), targets).backward(); optimizer.step()

Each unit (each child of `model` that has trainable parameters) is laid out as a FlatParams
(flat.py): rank r's slice, an fp32 nn.Parameter, replaces the unit's parameters in the
model; hooks gather the unit just before it runs (forward, and again for backward) and free
it after, and reduce-scatter its gradients into the slice's .grad as soon as backward has
produced them.

    bytes per rank, Adam:     16Ψ/N (+ the running unit's full parameters and gradients)
    elements sent per step:   two all-gathers and one reduce-scatter: 1.5x DP
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from .flat import FlatParams, _cast_floats, _replace_parameter, sharding_units
from .stage0 import _require_process_group


# Runs a callback once the current backward pass has finished (public in recent torch;
# older versions only have the engine's method, which DDP and FSDP call).
queue_callback = getattr(torch.autograd.graph, "queue_callback", None) \
    or torch.autograd.Variable._execution_engine.queue_callback


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
        raise NotImplementedError("TODO 2.4: re-grow the SAME storage under unit.data; fill it with all ranks' shards in its dtype, the shard untouched; see resize_")

    def reshard(self, unit: FlatParams) -> None:
        """Free the full parameters of the unit (its shard stays)."""
        raise NotImplementedError('TODO 2.4: free the memory under unit.data (0 bytes: under every full parameter and saved view too), the tensors kept; see resize_')

    def _pre_forward(self, unit: FlatParams) -> None:
        """Forward pre-hook: the unit is about to run."""
        raise NotImplementedError('TODO 2.4: its parameters must be whole')

    def _post_forward(self, unit: FlatParams, output) -> None:
        """Forward hook: the unit has run; `output` is a tensor or a tuple/list of them."""
        raise NotImplementedError('TODO 2.4: free its parameters, and make _pre_backward(unit) run when backward reaches the unit; pointer: Tensor.register_hook')

    def _pre_backward(self, unit: FlatParams) -> None:
        """Tensor hook: the gradient of one of the unit's outputs is ready; the unit's backward is next."""
        raise NotImplementedError('TODO 2.4: its parameters must be whole again, gathered once even when several outputs call this')

    @torch.no_grad()
    def reduce_gradients(self, unit: FlatParams) -> None:
        """Add the rank-average of the unit's gradients (None = zeros) to unit.shard.grad; free every full .grad."""
        raise NotImplementedError("TODO 2.4: unit.shard.grad (None: 0) += my slice of (the sum over ranks of unit.flat_grad()) / N, shard's dtype; full .grads None")

    def backward_done(self, unit: FlatParams) -> None:
        """The unit has all the gradients this backward pass will give it."""
        raise NotImplementedError('TODO 2.4: its gradients are reduced (reduce_gradients), its full parameters freed again, and it counts as done for this pass')

    def _post_accumulate_grad(self, unit: FlatParams) -> None:
        """Hook: one full parameter of `unit` has its gradient of this backward pass in .grad."""
        raise NotImplementedError("TODO 2.4: backward_done(unit) once all its parameters have this pass's gradient; _end_of_backward once at its end; queue_callback")

    def _end_of_backward(self) -> None:
        """Callback after the backward pass: finish the units some parameter of which got no gradient."""
        raise NotImplementedError('TODO 2.4: every unit not done in this pass is done now (in self.units order, alike on all ranks); then reset the per-pass state')

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
