"""The run's output folder on a cluster: one writer, seen by every node.

    claim_output_dir(folder, device)  both below, collectively, for the length of a `with`
    WriterLease(folder).acquire()     rank 0 holds OUTPUT_DIR/.writer (host, pid, run id,
                                      heartbeat) while it may write; a second live run is refused
    check_shared(folder, device)      every rank sees what rank 0 wrote there, or a one-line error
    why_unwritable(folder, exc)       "no space left", "read-only", ...: why a write there failed

Why a lease. Two jobs pointed at one --output-dir (a resubmitted job while the first still
runs, a copy-pasted command) would resume each other's checkpoints, and each one's pruning
would delete the other's files. The lease is a file created with O_EXCL, so exactly one
run holds it; the holder touches it every HEARTBEAT_S seconds. A later run takes it over
when the holder is gone: the same job restarted (the same TORCHELASTIC_RUN_ID: torchrun
stops every worker before it restarts them), the holder's process dead on this host, or no
heartbeat for STALE_S seconds (a holder on another host that died). An orphaned rank never
holds it for long: it dies with its agent (lifecycle.die_with_parent), and its heartbeat
stops with it.

Why a shared-folder check. Checkpoints written by rank 0 are read by every rank on resume.
A folder that is node-local (a path that is not on the shared file system on one node) makes
the other nodes fail on every restart, or, if rank 0 lands on an empty node, silently start
from step 0. Rank 0 writes a nonce, every rank looks for it, and all agree.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from common.launch import pid_alive

HEARTBEAT_S = 10.0
STALE_S = 60.0  # a lease on another host not touched for this long belongs to a dead run


def run_id() -> str:
    """The job's identity across torchrun restarts (TORCHELASTIC_RUN_ID, torchrun's
    --rdzv-id), or a new one for a launch without torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"local-{uuid.uuid4().hex[:12]}"


class WriterLease:
    """OUTPUT_DIR/.writer: who may write in the folder. Rank 0 only."""

    def __init__(self, folder: str | Path, run: str | None = None):
        self.path = Path(folder) / ".writer"
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run or run_id(),
                       "since": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lease, or raise ValueError (one line) naming the live holder. Returns a
        line to print when a stale lease was taken over, else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):  # another starter may create or remove it between our calls
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age = self._read()
                if holder is None:
                    continue
                why = self._stale(holder, age)
                if why is None:
                    raise ValueError(
                        f"--output-dir {self.path.parent} is in use by another run (host {holder.get('host')}, "
                        f"pid {holder.get('pid')}, run id {holder.get('run_id')}, alive {age:.0f} s ago): stop it, "
                        f"or use another --output-dir (a lease is stale after {STALE_S:.0f} s without a heartbeat)")
                if holder.get("run_id") != self.record["run_id"]:
                    note = (f"note: took over {self.path} from run {holder.get('run_id')} "
                            f"(host {holder.get('host')}, pid {holder.get('pid')}): {why}")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
            self._thread = threading.Thread(target=self._beat, name="writer-lease", daemon=True)
            self._thread.start()
            return note
        raise ValueError(f"--output-dir {self.path.parent}: could not take its lease {self.path} (another run "
                         "starting at the same moment?); try again")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        holder, _ = self._read()
        if holder is not None and holder.get("pid") == self.record["pid"] and \
                holder.get("host") == self.record["host"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "WriterLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self) -> tuple[dict | None, float]:
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None, 0.0
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:  # half-written by a starter that died: stale at once
            holder = {"host": "?", "pid": -1, "run_id": "?"}
            mtime = 0.0
        return holder, max(time.time() - mtime, 0.0)

    def _stale(self, holder: dict, age: float) -> str | None:
        """Why the holder is gone (None: it may be alive)."""
        if holder.get("run_id") == self.record["run_id"]:
            return "a restart of the same job"
        if holder.get("host") == self.record["host"] and not pid_alive(int(holder.get("pid", -1))):
            return "its process is gone"
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return


def check_shared(folder: str | Path, device: torch.device) -> None:
    """Collective: raise ValueError (one line, on every rank) unless every rank sees the file
    rank 0 writes in `folder`. A world of one process always passes."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    folder = Path(folder)
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".shared-{token[0]}").write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    probe = folder / f".shared-{token[0]}"
    sees = torch.tensor([1 if probe.is_file() else 0], device=device)
    seen_by = [torch.zeros_like(sees) for _ in range(dist.get_world_size())]
    dist.all_gather(seen_by, sees)
    dist.barrier()  # everyone has looked
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, s in enumerate(seen_by) if int(s) == 0]
    if blind:
        raise ValueError(f"--output-dir {folder} is not shared by every node: ranks {blind} do not see the file rank 0 "
                         f"wrote there; put it on a file system "
                         "that every node mounts at the same path")


@contextlib.contextmanager
def claim_output_dir(folder: str | Path, device: torch.device) -> Iterator[None]:
    """Collective: check that every rank sees `folder`, and hold its writer lease (rank 0)
    for the duration; every rank raises the same one-line ValueError when either fails."""
    check_shared(folder, device)
    lease, verdict = None, [None, None]  # [error, note]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        lease = WriterLease(folder)
        try:
            verdict[1] = lease.acquire()
        except ValueError as exc:
            verdict[0], lease = str(exc), None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError(verdict[0])
    if lease is not None and verdict[1]:
        print(verdict[1], file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if lease is not None:
            lease.release()


_WHY = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted"}


def why_unwritable(folder: str | Path, exc: BaseException) -> str | None:
    """Why writing in `folder` failed with `exc`, when no restart can fix it: from the errno
    of an OSError in exc's chain, or (torch.save reports a failed write as "unexpected pos")
    from the folder itself. None: another kind of failure."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _WHY:
            return _WHY[seen.errno]
        seen = seen.__cause__ or seen.__context__
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):  # gone, or no statvfs (Windows)
        return None
    if stats.f_flag & getattr(os, "ST_RDONLY", 1):
        return _WHY[errno.EROFS]
    if stats.f_bavail * stats.f_frsize < (1 << 20):
        return _WHY[errno.ENOSPC]
    if not os.access(folder, os.W_OK):
        return _WHY[errno.EACCES]
    return None
