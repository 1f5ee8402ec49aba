"""One world of ranks shared by many tests: the ranks run named scenarios in turn, the
parent runs the world once and hands each test the per-rank results of its scenario.

    def _rank(ref):                                   # in the ranks
        mod = ref.load()
        return run_scenarios({name: partial(fn, mod) for name, fn in _SCENARIOS.items()}, agree_s=20)

    _world = SharedWorld(_rank, 3)                    # in the parent, at module level
    per_rank = _world.results("step", ref)            # run_world(_rank, 3, args=(ref,)) once per args

A scenario that raises is reported by its own tests only: a TODO as a TODO, anything else
as a failure naming the rank. After each scenario the ranks agree (a gloo barrier with
its own deadline) before the next one starts, so one scenario's failure cannot leave
another waiting; a rank that cannot agree ends the world with its error.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Callable

import pytest
import torch.distributed as dist

from common.launch import WorldTimeout, run_world


def run_scenarios(scenarios: dict[str, Callable[[], object]], agree_s: float) -> dict:
    """In a rank: {name: ("done", result) | ("todo", message) | ("error", message, traceback)}."""
    finished = dist.new_group(backend="gloo", timeout=timedelta(seconds=agree_s))
    results = {}
    for name, scenario in scenarios.items():
        error = None
        try:
            results[name] = ("done", scenario())
        except Exception as exc:  # noqa: BLE001 - reported by the tests of this scenario only
            error = exc
            todo = isinstance(exc, NotImplementedError) and str(exc).startswith("TODO")
            results[name] = ("todo", str(exc)) if todo else \
                ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        try:
            dist.barrier(group=finished)
        except Exception:  # noqa: BLE001 - another rank is stuck where this one left
            if error is not None:
                raise error from None
            raise
    return results


class SharedWorld:
    """In the parent: `worker` on `size` ranks, run once per distinct `args` (its result, or
    the exception the world ended with, is kept and given to every later test)."""

    def __init__(self, worker: Callable, size: int):
        self.worker, self.size = worker, size
        self._runs: dict = {}

    def results(self, name: str, *args, world: str | None = None, hang_hint: str = "",
                what: str | None = None, ranks: int | None = None) -> list:
        """Per rank (the first `ranks`, default all), the result of scenario `name`.

        `world` names the world in the message of a deadlock (default "the world of N
        ranks"), followed by `hang_hint`; `what` names the scenario in the message of a
        rank's error (default "scenario 'name'")."""
        world = world or f"the world of {self.size} ranks"
        if args not in self._runs:
            try:
                self._runs[args] = run_world(self.worker, self.size, args=args)
            except WorldTimeout as exc:
                hint = f" ({hang_hint})" if hang_hint else ""
                self._runs[args] = AssertionError(f"{world} did not finish{hint}: {exc}")
            except Exception as exc:  # noqa: BLE001 - e.g. a rank could not load the module
                self._runs[args] = exc
        got = self._runs[args]
        if isinstance(got, BaseException):
            raise got
        per_rank = [r[name] for r in got[:ranks]]
        todo = next((r[1] for r in per_rank if r[0] == "todo"), None)
        if todo:
            raise NotImplementedError(todo)
        for rank, r in enumerate(per_rank):
            if r[0] == "error":
                pytest.fail(f"{what or f'scenario {name!r}'}: rank {rank} raised {r[1]}\n{r[2]}", pytrace=False)
        return [r[1] for r in per_rank]
