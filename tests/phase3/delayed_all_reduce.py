"""An async all-reduce whose result reaches the tensor only when its Work is waited for.

Inside `with DelayedAllReduce(also_in=(mod,)):` a call `dist.all_reduce(t, ..., async_op=True)`
reduces a copy of `t` at once (same collective, same order on every rank) and returns a
Work that copies the result into `t` at `wait()` (or `is_completed()`, `synchronize()`,
`get_future()`): what a slow network does, made deterministic. Code that reads a tensor
before waiting for the Work of its all-reduce reads the unreduced value, every time.
Blocking calls (async_op=False) are untouched. Used by the 3.2 and 3.5 tests.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist



class DelayedWork:
    """The Work of an async all-reduce whose result lands in the tensor only once it is waited for."""

    def __init__(self, tensor: torch.Tensor, result: torch.Tensor):
        self.tensor, self.result, self.delivered = tensor, result, False

    def _deliver(self) -> None:
        if not self.delivered:
            self.tensor.copy_(self.result)
            self.delivered = True

    def wait(self, timeout=None) -> bool:
        self._deliver()
        return True

    def is_completed(self) -> bool:
        self._deliver()
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        self._deliver()

    def get_future(self) -> torch.futures.Future:
        self._deliver()
        future = torch.futures.Future()
        future.set_result([self.tensor])
        return future


class DelayedAllReduce:
    """Within the block, `dist.all_reduce(..., async_op=True)` reduces a copy now and delivers it at wait().

    Replaced on torch.distributed, its c10d module, and any alias in `also_in` modules.
    """

    def __init__(self, also_in: tuple = ()):
        self.also_in = also_in
        self._saved = []

    def __enter__(self):
        real = dist.all_reduce
        signature = inspect.signature(real)

        def delayed(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if not arguments["async_op"]:
                return real(*args, **kwargs)
            result = arguments["tensor"].detach().clone()
            real(result, op=arguments["op"], group=arguments["group"])
            return DelayedWork(arguments["tensor"], result)

        delayed.__signature__ = signature  # so that a CollectiveLog around it sees the arguments

        for module in (dist, dist.distributed_c10d, *self.also_in):
            for name, value in list(vars(module).items()):
                if value is real:
                    self._saved.append((module, name, real))
                    setattr(module, name, delayed)
        return self

    def __exit__(self, *exc):
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()
