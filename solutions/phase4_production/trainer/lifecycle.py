"""The run's lifecycle on a cluster: which signals stop it, and who may outlive whom.

    stop_signals()           SIGTERM and SIGINT: what a scheduler, `docker stop`, `timeout`,
                             Ctrl-C and torchrun's agent (which forwards what it got) send
    die_with_parent()        this process ends when the process that started it dies
    loader_worker_init(...)  DataLoader workers ignore the stop signals and die with their rank
    report_fatal(line)       an error no restart can fix, said once per torchrun agent; the
                             restarted attempts see fatal_reported() and leave at once

Who receives a stop signal. torchrun's agent sends the signal it got to each worker's whole
process group (os.killpg in torch's SubprocessHandler.close, torch 2.14), and a rank's
DataLoader workers are in that group. A worker killed by it makes the rank raise "DataLoader
worker (pid ...) is killed by signal: Terminated" in the middle of a step, before the rank
can save. So workers ignore SIGTERM and SIGINT: the rank alone decides to stop (at the next
step boundary, after saving) and then shuts its workers down itself.

Who outlives whom. torchrun starts each worker in a new session, so a SIGKILLed agent (an
OOM kill, a container runtime losing its main process) leaves its workers training with
nobody to restart them, racing the relaunch for the output folder. Each rank and each
loader worker therefore asks Linux to SIGKILL it when its parent dies (PR_SET_PDEATHSIG);
elsewhere a thread polls its parent. SIGKILL, not a catchable signal: an orphan must stop
without writing anything more.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.launch import pid_alive

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_parent: int | None = None  # the parent die_with_parent() watches


def stop_signals() -> tuple[int, ...]:
    """The signals that ask the run to stop at the next step boundary (and save)."""
    return (signal.SIGTERM, signal.SIGINT)


def die_with_parent(poll_s: float = 0.5) -> None:
    """SIGKILL this process as soon as its parent (the torchrun agent, the launcher's fork
    server, a rank for its loader workers) dies. Linux: the kernel does it (PR_SET_PDEATHSIG;
    it fires when the parent *thread* that started us exits, and torchrun and the DataLoader
    start their children from the main thread). Elsewhere: a daemon thread checks the parent
    every `poll_s` seconds. A parent that is already gone ends this process at once."""
    global _parent
    parent = _parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if parent == 1 or not pid_alive(parent):  # orphaned before we could ask
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent, poll_s), name="die-with-parent", daemon=True).start()


def orphaned() -> bool:
    """Whether the parent die_with_parent() was armed against is gone (the kernel's SIGKILL
    may take a moment to arrive: check this before anything that writes)."""
    return _parent is not None and os.getppid() != _parent


def _watch_parent(parent: int, poll_s: float) -> None:
    while os.getppid() == parent and pid_alive(parent):
        time.sleep(poll_s)
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def loader_worker_init(worker_id: int) -> None:
    """DataLoader worker_init_fn: ignore the stop signals sent to the rank's process group
    (the rank stops at a step boundary and shuts its workers down), and die with the rank.
    The rank must call kill_workers_at_exit(): its exit would otherwise wait on them."""
    for sig in stop_signals():
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


_reaper = None


def kill_workers_at_exit() -> None:
    """Make this process SIGKILL its live multiprocessing children (its loader workers) when
    it exits, before multiprocessing's exit hook, which SIGTERMs its daemonic children and then
    joins them: loader_worker_init's workers ignore SIGTERM, so a rank that leaves with an
    error before shutting them down (an exception in a worker, a timeout) would wait on them
    forever (seen: a bad image in an ImageFolder hung the run's exit). A finalizer with an
    exit priority runs first in that hook, in a rank (multiprocessing's child bootstrap) and
    in a main process (atexit) alike. Idempotent."""
    global _reaper
    if _reaper is None:
        import multiprocessing.util

        _reaper = multiprocessing.util.Finalize(None, _kill_children, exitpriority=100)


def _kill_children() -> None:
    import multiprocessing

    children = multiprocessing.active_children()
    if children and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's handler would raise on these deaths
    for child in children:
        child.kill()
        child.join(timeout=5)


# ---------------------------------------------------------------- errors no restart can fix
# A wrong --data-root, a full disk, checkpoints of another run: torchrun cannot tell them from
# a crash and restarts the workers --max-restarts times, each printing the same error. The
# first rank to meet one leaves a marker for its agent (in the node's temp folder, named by
# the job and the agent, so a new launch never sees it); every later attempt of that agent
# leaves at once, silently, and torchrun's restarts cost seconds, not minutes of output.


def _fatal_marker() -> Path | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    agent = os.getppid()
    try:  # the agent's start time too: a pid can be reused
        started = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return Path(tempfile.gettempdir()) / f"course-fatal-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}-{agent}-{started}"


def fatal_reported() -> bool:
    """Under torchrun: whether an attempt of this job under this agent met an error that no
    restart can fix (then this attempt should leave at once, exit code 2)."""
    marker = _fatal_marker()
    return marker is not None and marker.exists()


def report_fatal(line: str) -> None:
    """Print `line` on stderr, unless another rank of this agent's job already printed the
    same line; under torchrun, leave the marker that fatal_reported() looks for."""
    marker = _fatal_marker()
    if marker is None:
        print(line, file=sys.stderr, flush=True)
        return
    # Written in full under a name of its own, then linked into place: a rank that finds the
    # marker reads the whole line (O_EXCL then write would show the others an empty file).
    draft = marker.with_name(f"{marker.name}.{os.getpid()}")
    try:
        draft.write_text(line)
        os.link(draft, marker)
    except FileExistsError:
        if marker.read_text(errors="replace") != line:
            print(line, file=sys.stderr, flush=True)
        return
    except OSError:  # no hard links here: said by every rank, and restarts are not cut short
        pass
    finally:
        draft.unlink(missing_ok=True)
    print(line, file=sys.stderr, flush=True)
