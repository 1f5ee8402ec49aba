"""Checkpoints written in the background: the training step waits for a CPU copy of the state only.

    writer = BackgroundWriter(manager, faults, asynchronous=True)
    writer.submit(step, state)   # rank 0: wait for the previous write (its error is raised
                                 # here), copy every tensor of `state` to CPU memory, start a
                                 # thread that runs manager.save (4.1's atomic protocol)
    writer.wait()                # before saying "saved": at a stop, at the end of the run
    writer.close()               # on the way out, also after an error: finish the write in flight

Why a copy first: the thread writes while the loop goes on training, and the next
optimizer step changes the parameters and moments in place. The copy is a snapshot of the
state at the step boundary, so the file is the same, byte for byte, as a synchronous save
would write (the resumed run ends on the same weights). What the step still pays is the
copy instead of serialising, hashing, fsyncing and renaming on the critical path. On a GPU
that copy goes into fresh pageable memory (cpu_snapshot below), which costs far more than
the link's rate. Measured on one H200 (torch 2.11.0, 1 GiB of fp32, best of 5):
`.to("cpu", copy=True)` into new memory 1.3 GB/s, about 0.8 s per GB (getting fresh pages
dominates); the same copy into a reused pageable tensor 14.9 GB/s (70 ms per GB), into a
reused pinned one 55 GB/s (20 ms per GB). A few ms per GB takes a reused pinned buffer and
NVLink-C2C (Grace Hopper). A staging buffer kept from one save to the next is the fix if the
copy shows in the step time: torch 2.14.1's torch.distributed.checkpoint.staging.DefaultStager,
with its default StagingOptions, stages into pinned memory it caches from one save to the
next (async_save without an async_stager makes an unpinned one per call).

What stays true, as in 4.1: the file appears under its name only once complete (temp file,
fsync, rename, folder fsync), so a rank killed at any moment of a background write leaves
the previous checkpoint the newest complete one. At most one write is in flight: a second
submit waits for the first, so a slow disk slows training rather than piling copies up in
memory. Only rank 0 writes (DDP's state is replicated); the other ranks do nothing here.

torch.distributed.checkpoint.async_save (torch 2.14) does the same for sharded state: it
stages the state to CPU, then writes in a thread (or, with AsyncCheckpointerType.PROCESS, in
a separate process), and returns a Future. The trainer keeps its single verified file for
DDP (4.1), so it runs 4.1's save in a thread of its own.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from phase4_production.checkpoint import CheckpointManager
from phase4_production.recovery import FaultInjector


def cpu_snapshot(obj: Any) -> Any:
    """A deep copy of `obj` whose tensors are new CPU tensors (never views of the live ones)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [cpu_snapshot(v) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return copy.deepcopy(obj)


@dataclass
class SaveResult:
    """One finished write: the checkpoint of `step` at `path` (None if it failed with `error`),
    `stall_s` the training loop waited for it, `write_s` the write itself took."""

    step: int
    path: Path | None
    stall_s: float
    write_s: float
    error: BaseException | None = None


class BackgroundWriter:
    """Writes CheckpointManager checkpoints from CPU snapshots in a thread (asynchronous=True),
    or in the calling thread (asynchronous=False: the step waits for the whole write).

    `on_done(result)` is called in the caller's thread for every write that finished, in step
    order, from submit(), wait() or close(); a failed write raises its error from the first of
    those calls after it failed (close() hands it to on_done only)."""

    def __init__(self, manager: CheckpointManager, faults: FaultInjector | None = None, asynchronous: bool = True,
                 on_done: Callable[[SaveResult], None] | None = None):
        self.manager = manager
        self.faults = faults or FaultInjector()
        self.asynchronous = asynchronous
        self.on_done = on_done
        self._thread: threading.Thread | None = None
        self._pending: SaveResult | None = None
        self.failed_step: int | None = None  # the step whose write failed, once wait() raised its error

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, step: int, state: dict, began: float | None = None) -> None:
        """Save `state` as the checkpoint of `step`. Returns once the state is copied (async) or
        written (sync); raises the error of the previous write, if it failed, before anything.
        `began`: the time.perf_counter() at which the loop started the save (gathering the
        state), so that the stall reported counts it; default: now."""
        self.wait()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        began = time.perf_counter() if began is None else began
        fault_step = self.faults.step  # the fault due is the one of the step this state ends
        if not self.asynchronous:
            result = SaveResult(step, None, 0.0, 0.0)
            self._write(result, state, fault_step, time.perf_counter())
            result.stall_s = time.perf_counter() - began
            self._pending = result
            self.wait()
            return
        snapshot = cpu_snapshot(state)
        result = SaveResult(step, None, time.perf_counter() - began, 0.0)
        self._pending = result
        # not a daemon: an interpreter that exits (an error elsewhere) still finishes the file
        self._thread = threading.Thread(target=self._write, args=(result, snapshot, fault_step, time.perf_counter()),
                                        name=f"checkpoint-writer-step{step}")
        self._thread.start()

    def _write(self, result: SaveResult, state: dict, fault_step: int | None, began: float) -> None:
        try:
            with self.faults.saving(step=fault_step):
                result.path = self.manager.save(result.step, state)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, raised there
            result.error = exc
        result.write_s = time.perf_counter() - began

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; report it; raise its error."""
        result = self._finish()
        if result is not None and result.error is not None:
            self.failed_step = result.step
            raise result.error

    def close(self) -> None:
        """wait(), but a failed write is only reported (to on_done): for the way out of an error."""
        self._finish()

    def _finish(self) -> SaveResult | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        result, self._pending = self._pending, None
        if result is not None and self.on_done is not None:
            self.on_done(result)
        return result
