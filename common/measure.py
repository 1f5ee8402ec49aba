"""Measuring what distributed code does, in one place: used by tests and benchmarks,
never inside an exercise (an exercise file holds its idea, not its instruments).

Each section below serves one kind of question:
  * collectives and bytes   which collectives a rank called, with how many bytes
  * saved activations       bytes autograd keeps for backward (saved-tensor hooks)
  * tensors held            bytes of the distinct storages an object keeps alive
  * pipeline timelines      rendering a schedule's time grid
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

# ------------------------------------------------------ collectives and bytes

# collective -> the parameter holding what this rank contributes (its message).
_MESSAGE_ARG = {
    "all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
    "all_to_all_single": "input", "gather": "tensor", "scatter": "scatter_list",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list", "barrier": None,
}


@dataclass
class Call:
    """One call of a torch.distributed function, as the calling rank saw it.

    `numel`/`nbytes`: size of the message this rank passed in (for all_gather the local
    input, for reduce_scatter the full input, for batch_isend_irecv the sum over ops);
    wire traffic depends on the algorithm and is the caller's to derive.
    """

    name: str
    numel: int
    nbytes: int
    dtype: torch.dtype | None
    group: object = None
    ops: list = field(default_factory=list)  # batch_isend_irecv: [(op name, peer, numel)]


def _message_size(value) -> tuple[int, int, torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        return value.numel(), value.numel() * value.element_size(), value.dtype
    if isinstance(value, (list, tuple)):
        sizes = [_message_size(getattr(v, "tensor", v)) for v in value]
        dtype = next((d for _, _, d in sizes if d is not None), None)
        return sum(n for n, _, _ in sizes), sum(b for _, b, _ in sizes), dtype
    return 0, 0, None


class CollectiveLog:
    """Record the torch.distributed calls made inside a `with` block (on this rank).

        with CollectiveLog() as log:
            model_step()
        log.names() == ["all_reduce", "all_reduce"]; log.bytes("all_reduce") == 4 * numel

    It replaces the functions on `torch.distributed` (and its distributed_c10d module, so
    code that imported them by name *after* the block began is seen too) and restores
    them on exit. `on_call(call)` runs before each call reaches torch (e.g. to sample
    memory at every collective). Calls are forwarded unchanged.
    """

    def __init__(self, names=None, on_call: Callable[[Call], None] | None = None):
        self.names_watched = list(names or _MESSAGE_ARG)
        self.on_call = on_call
        self.calls: list[Call] = []
        self._saved: list[tuple[object, str, Callable]] = []
        self._depth = 0

    def _wrap(self, name: str, real: Callable) -> Callable:
        signature = inspect.signature(real)
        arg = _MESSAGE_ARG.get(name)

        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            numel, nbytes, dtype = _message_size(bound.get(arg)) if arg else (0, 0, None)
            call = Call(name, numel, nbytes, dtype, bound.get("group"))
            if name == "batch_isend_irecv":
                call.ops = [(getattr(op.op, "__wrapped__", op.op).__name__, op.peer, op.tensor.numel())
                            for op in bound.get(arg, [])]
            if self._depth:  # called by another recorded function (batch_isend_irecv -> isend)
                return real(*args, **kwargs)
            self.calls.append(call)
            if self.on_call is not None:
                self.on_call(call)
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        recorded.__wrapped__ = real
        return recorded

    def __enter__(self) -> "CollectiveLog":
        c10d = dist.distributed_c10d
        for name in self.names_watched:
            real = getattr(dist, name)
            wrapped = self._wrap(name, real)
            for module in (dist, c10d):
                if getattr(module, name, None) is real:
                    self._saved.append((module, name, real))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def count(self, name: str | None = None) -> int:
        return sum(1 for c in self.calls if name is None or c.name == name)

    def bytes(self, name: str | None = None) -> int:
        return sum(c.nbytes for c in self.calls if name is None or c.name == name)

    def clear(self) -> None:
        self.calls.clear()


# ---------------------------------------------------------- saved activations


# --------------------------------------------------------------- tensors held


# --------------------------------------------------------- pipeline timelines
