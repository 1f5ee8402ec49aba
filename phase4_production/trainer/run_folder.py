"""The run's output folder on a cluster: one writer, seen by every node.

    claim_output_dir(folder, device)  both below, collectively, for the length of a `with`
    WriterLease(folder).acquire()     rank 0 holds OUTPUT_DIR/.writer (host, pid, run id,
                                      heartbeat) while it may write; a second live run is refused
    check_shared(folder, device)      every rank sees what rank 0 wrote there, or a one-line error
    why_unwritable(folder, exc)       "no space left", "read-only", ...: why a write there failed
    cannot_write(path, exc)           the one line for a failed write of a file of the run folder

Why a lease. Two jobs pointed at one --output-dir (a resubmitted job while the first still
runs, a copy-pasted command) would resume each other's checkpoints, and each one's pruning
would delete the other's files. The lease is a file created with O_EXCL, so exactly one
run holds it (written in full under a name of its own, then linked into place, so nobody
reads half of one); the holder touches it every HEARTBEAT_S seconds. A later run takes it over
when the holder is gone: the same job restarted (the same TORCHELASTIC_RUN_ID: torchrun
stops every worker before it restarts them), the holder's process dead on this host (its pid
gone, or now another process: the lease records the process's start time), or, for a holder
on another host, no heartbeat for STALE_S seconds. An orphaned rank never holds it for long:
it dies with its agent (lifecycle.die_with_parent), and its heartbeat stops with it.

Which clock. A holder on this host is alive while its process is, whatever the clocks say: a
clock stepped forward (NTP, a suspended VM) never makes a live run's lease stale. A holder on
another host is judged by its heartbeat's age on the file system's own clock (the mtime of a
file created next to the lease, minus the lease's mtime: both stamped by the same kernel or
file server), so neither this node's clock nor its offset from the holder's matters. A
heartbeat in the future on that clock (the clock went back) proves nothing: the lease is
watched, on this process's monotonic clock, for 2 x HEARTBEAT_S + 1 seconds, and a lease
that does not move in that time is stale.

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
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": process_started(os.getpid()),
                       "run_id": run or run_id(), "since": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lease, or raise ValueError (one line) naming the live holder. Returns a
        line to print when a stale lease was taken over, else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):  # another starter may create or remove it between our calls
            try:
                self._create()
            except FileExistsError:
                holder, mtime = self._read()
                if holder is None:
                    continue
                why = self._stale(holder, mtime)
                if why is None:
                    alive = "its process is running" if holder.get("host") == self.record["host"] else \
                        f"heartbeat {max(self._age(mtime), 0.0):.0f} s ago"
                    raise ValueError(
                        f"--output-dir {self.path.parent} is in use by another run (host {holder.get('host')}, "
                        f"pid {holder.get('pid')}, run id {holder.get('run_id')}, {alive}): stop it, or use another "
                        f"--output-dir (a lease on another host is stale after {STALE_S:.0f} s without a heartbeat)")
                if holder.get("run_id") != self.record["run_id"]:
                    note = (f"note: took over {self.path} from run {holder.get('run_id')} "
                            f"(host {holder.get('host')}, pid {holder.get('pid')}): {why}")
                self.path.unlink(missing_ok=True)
                continue
            self._thread = threading.Thread(target=self._beat, name="writer-lease", daemon=True)
            self._thread.start()
            return note
        raise ValueError(f"--output-dir {self.path.parent}: could not take its lease {self.path} (another run "
                         "starting at the same moment?); try again")

    def _create(self) -> None:
        """Create the lease with our record, whole, or raise FileExistsError: written under a name
        of its own, then hard-linked into place (link fails if the lease exists); O_EXCL where the
        file system has no hard links."""
        draft = self.path.with_name(f"{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            draft.write_text(json.dumps(self.record))
            try:
                os.link(draft, self.path)
                return
            except FileExistsError:
                raise
            except OSError:  # no hard links here
                pass
        finally:
            draft.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)

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
        """(the holder's record, the lease's mtime), or (None, 0) when there is no lease."""
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None, 0.0
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:  # not a lease this trainer wrote (ours are linked into place whole)
            holder = {"host": "?", "pid": -1, "run_id": "?"}
            mtime = 0.0
        return holder, mtime

    def _age(self, mtime: float) -> float:
        """Seconds since `mtime` on the clock of the file system that holds the lease (module
        docstring): a file created next to it now, its mtime minus `mtime`."""
        probe = self.path.with_name(f".clock-{uuid.uuid4().hex[:12]}")
        try:
            probe.touch()
            now = probe.stat().st_mtime
        except OSError:  # cannot write here: this node's clock has to do
            now = time.time()
        finally:
            probe.unlink(missing_ok=True)
        return now - mtime

    def _stale(self, holder: dict, mtime: float) -> str | None:
        """Why the holder is gone (None: it may be alive); module docstring, "Which clock"."""
        if holder.get("run_id") == self.record["run_id"]:
            return "a restart of the same job"
        if holder.get("host") == self.record["host"]:  # its process decides, never a clock
            pid = int(holder.get("pid", -1))
            if not pid_alive(pid):
                return "its process is gone"
            started = holder.get("started")
            if started is not None and process_started(pid) not in (None, started):
                return f"its process is gone (pid {pid} is another process now)"
            return None
        age = self._age(mtime)
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s"
        if age < -1.0 and not self._moves(mtime):  # a heartbeat from the future: the clock went back
            return (f"its heartbeat is dated {-age:.0f} s in the future (a clock that went back) and did not move "
                    f"for {2 * HEARTBEAT_S + 1:.0f} s")
        return None

    def _moves(self, mtime: float) -> bool:
        """Whether the lease is touched (or replaced, or removed) within 2 x HEARTBEAT_S + 1 s of
        this process's monotonic clock: a live holder touches it every HEARTBEAT_S."""
        end = time.monotonic() + 2 * HEARTBEAT_S + 1.0
        while time.monotonic() < end:
            time.sleep(min(0.25, HEARTBEAT_S / 4))
            try:
                if self.path.stat().st_mtime != mtime:
                    return True
            except FileNotFoundError:  # released: free to take
                return False
        return False

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return


def process_started(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/<pid>/stat's 22nd field, clock ticks since
    boot), to tell it from a later process given the same pid; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


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


def replace_whole(path: str | Path, write) -> None:
    """Write `path` whole: `write(tmp)` fills a hidden temporary beside it (the pid in its name: ranks
    and attempts never share one), then one rename puts it in place, so a reader sees the old file or
    the new one, never half; the temporary does not outlive a failed write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def cannot_write(path: str | Path, exc: BaseException) -> ValueError:
    """The error (one line, exit 2: no restart fixes it) for a write of `path`, a file of the run
    folder (metrics, config files, the exported weights), that failed with `exc`."""
    why = why_unwritable(Path(path).parent, exc)
    if why is None:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
    return ValueError(f"cannot write {path}: {why}; free space, make it a writable file, or use another --output-dir "
                      "(the newest complete checkpoint is kept)")
