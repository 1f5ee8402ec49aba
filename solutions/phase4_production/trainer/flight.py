"""The trainer's flight record: what this rank was waiting for when a wait ran out (4.6).

    flight = FlightRecord(limit=900.0)          # --pg-init-timeout: also the default group's timeout
    group = flight.new_group(backend="gloo")    # a group whose timeout follows the limit
    with flight.waiting("the stop-flag all-reduce (StopAgreement, on a gloo group)"):
        flight.issue(dist.all_reduce, flag, group=group)   # through 4.6's CollectiveRecorder
    with flight.loading(loader):                # a wait for a batch from loader workers
        batch = next(batches)
    flight.step = step                          # the step the next waits belong to (0-based)
    flight.set_limit(300.0)                     # --pg-timeout, once the first step is done: every group

Every operation of the trainer that waits for the other ranks runs inside an entry of the
record, named by the component that runs it: the parallel strategy names its gradient
collective (DDP's all-reduce in backward, FSDP's all-gathers and reduce-scatters), the stop
agreement its all-reduce, the evaluator its, the checkpointer the save (its RNG gather), the
EMA its buffers' broadcast. The entries are kept as 4.6's recorder keeps collectives: a ring of
the newest `capacity`, each "started", then "completed". The collectives the trainer issues
itself (the stop flag's all-reduce, the evaluation's, the barrier after a preemption's save)
go through 4.6's CollectiveRecorder: numbered per group, waited for at most the limit.

When a wait runs out, the innermost entry open names it, in one line: where (the step; or
outside the loop "before the first step", "--evaluate", "the final evaluation", ...), what
waited (the entry's name, and the collective's op, number and group where 4.6's recorder
issued it), the limit, and what happens next. CollectiveTimeout (4.6's: the one timeout class)
carries the line to the command line, which exits 1 so that torchrun restarts the attempt.
An entry knows that a wait ran out without reading the error's text: 4.6's recorder raised its
CollectiveTimeout, or the entry lasted its limit (gloo's timeout on the host, and DataLoader's
for a batch, count from a moment inside the entry). NCCL raises nothing: its watchdog ends the
process, and torch's own flight recorder (TORCH_FR_BUFFER_SIZE entries) says where
(phase4_production/guidelines.md, 4.6).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections import deque
from typing import Any, Callable, Iterator

import torch.distributed as dist

from solutions.phase4_production.hangs import CollectiveRecorder, CollectiveTimeout, signature

_RESTARTS = "this attempt ends, and torchrun restarts it from the newest checkpoint"


class FlightRecord:
    """This rank's record of the trainer's waits (module docstring). `limit`: seconds a
    collective may wait, set as the default group's timeout too."""

    def __init__(self, limit: float, capacity: int = 2000):
        self.limit = float(limit)
        self.step = 0                                  # the step being trained, 0-based
        self.entries: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.issued = 0                                # entries ever started
        self._open: list[dict[str, Any]] = []          # the entries in progress, outermost first
        self._groups: list = []                        # groups whose timeout follows the limit
        self.recorder = CollectiveRecorder(capacity, timeout=self.limit) if dist.is_initialized() else None
        if dist.is_initialized():
            dist.set_timeout(datetime.timedelta(seconds=self.limit))

    def set_limit(self, seconds: float) -> None:
        """Every collective from now on may wait `seconds`: the default group, the groups of
        new_group(), and 4.6's recorder."""
        self.limit = float(seconds)
        if self.recorder is not None:
            self.recorder.timeout = self.limit
        if dist.is_initialized():
            timeout = datetime.timedelta(seconds=self.limit)
            dist.set_timeout(timeout)
            for group in self._groups:
                dist.set_timeout(timeout, group=group)

    def new_group(self, **kwargs: Any):
        """dist.new_group(**kwargs) (collective) with the limit as its timeout, following set_limit."""
        group = dist.new_group(timeout=datetime.timedelta(seconds=self.limit), **kwargs)
        self._groups.append(group)
        return group

    def issue(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """collective(*args, **kwargs) through 4.6's CollectiveRecorder (recorded, its wait
        bounded by the limit); called plainly without a process group."""
        if self.recorder is None:
            collective(*args, **kwargs)
        else:
            self.recorder(collective, *args, **kwargs)

    def waiting(self, what: str, at: str | None = None) -> contextlib.AbstractContextManager:
        """An entry for an operation that waits for the other ranks, named `what`, at `at`
        (default: the enclosing entry's place, else "step N", N the step being trained)."""
        return self._entry({"kind": "collective", "what": what, "limit": self.limit}, at)

    def loading(self, loader) -> contextlib.AbstractContextManager:
        """An entry for a wait for the next batch of `loader` (a DataLoader: its workers and
        timeout; without workers a batch never times out)."""
        workers, timeout = loader.num_workers, float(loader.timeout)
        limit = timeout if workers and timeout > 0 else math.inf
        return self._entry({"kind": "loader", "what": "the loader", "limit": limit, "workers": workers,
                            "timeout": timeout}, None)

    def named(self, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, each call inside an entry named `what`."""
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.waiting(what):
                return fn(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def _entry(self, entry: dict[str, Any], at: str | None) -> Iterator[dict[str, Any]]:
        place = at if at is not None else self._open[-1]["at"] if self._open else f"step {self.step + 1}"
        entry.update(seq=self.issued, step=self.step, at=place, state="started")
        self.issued += 1
        self.entries.append(entry)
        self._open.append(entry)
        began = time.monotonic()
        try:
            yield entry
        except CollectiveTimeout as exc:
            if getattr(exc, "entry", None) is not None:
                raise  # an inner entry named it already
            raise self._timeout(entry, self._in_flight()) from None  # 4.6's recorder's bounded wait ran out
        except RuntimeError:
            if time.monotonic() - began < entry["limit"]:
                raise  # an error of its own, not a wait that ran out
            raise self._timeout(entry, None) from None
        else:
            entry["state"] = "completed"
        finally:
            self._open.pop()

    def _in_flight(self) -> str:
        """', collective #8 (all_reduce int32[1]) of group [0, 1],': the collective 4.6's recorder
        issued last and never saw complete, named as 4.6 names it; '' if none."""
        started = [e for e in self.recorder.dump()["entries"] if e["state"] == "started"] if self.recorder else []
        if not started:
            return ""
        e = started[-1]
        return f", collective #{e['seq']} ({signature(e['op'], e['dtype'], e['shape'])}) of group {e['group']},"

    def _timeout(self, entry: dict[str, Any], issued: str | None) -> CollectiveTimeout:
        if entry["kind"] == "loader":
            line = (f"{entry['at']}: no batch from the {entry['workers']} loader worker(s) in {entry['timeout']:g} s "
                    "(--loader-timeout): a worker is stuck (a file system that stopped answering, a sample that "
                    f"never returns); {_RESTARTS}")
        else:
            line = (f"{entry['at']}: {entry['what']}{issued or ''} waited more than {entry['limit']:g} s "
                    f"(--pg-timeout/--pg-init-timeout) for another rank, which is stuck or dead; {_RESTARTS}")
        error = CollectiveTimeout(line)
        error.entry = entry
        return error

    def dump(self) -> dict[str, Any]:
        """This rank's record as plain data: the entries (newest `capacity`, oldest first) and
        4.6's recorder's dump of the collectives it issued (None without a process group)."""
        return {"step": self.step, "limit": self.limit, "entries": [dict(e) for e in self.entries],
                "collectives": self.recorder.dump() if self.recorder is not None else None}
