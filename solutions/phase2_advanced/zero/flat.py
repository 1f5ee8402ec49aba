"""The flat layout ZeRO stage 3 works on (given): FlatParams, the units it is built for, two helpers.

A unit (a child of the model that has trainable parameters, as FSDP wraps them) is laid out
in one flat buffer padded to N equal slices (FSDP1's flat parameter): rank r keeps slice r
as an fp32 nn.Parameter, and the unit's full parameters are views of the buffer, whose
memory exists only while the unit runs (stage3.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


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


def _replace_parameter(root: nn.Module, old: nn.Parameter, new: torch.Tensor) -> None:
    """Wherever `old` is registered under `root`, it is unregistered and `new` set as a plain attribute."""
    for module in root.modules():
        for attr, value in list(module._parameters.items()):
            if value is old:
                del module._parameters[attr]
                setattr(module, attr, new)
