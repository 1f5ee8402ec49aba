"""Run a function on a world of N ranks, and never hang.

    results = run_world(my_worker, world_size=4, args=(1024,))   # one result per rank

`my_worker` must be a module-level function (ranks are forked from a fork server, or
spawned where there is none: either way it is pickled by name). Each rank joins the
process group through `common.distributed.init_distributed`, exactly as under
`torchrun`, runs `my_worker(*args)`, and sends its return value back to the parent,
so tests can assert in one place with readable diffs.

Guarantees:
  * a rank that raises fails the call at once with that rank's number and traceback
    (`WorldError`);
  * a world whose code does not finish within `timeout` seconds (a deadlock: a rank
    skipped a collective, a ring sends before it receives) fails with `WorldTimeout`,
    which shows for every rank the file and line where it was waiting. The clock starts
    once every rank has joined the group; starting up (spawning, importing torch) has
    its own deadline, START_TIMEOUT_S, so a busy machine is not mistaken for a deadlock;
  * no rank outlives the call, nor any process a rank started (a DataLoader's workers),
    even if the parent is killed: each rank leads its own process group, which the
    parent kills as a whole, and a rank whose parent vanished kills its group;
  * no rank leaves before every rank has delivered its result, and a rank leaves
    without tearing its process group down; one that still dies after delivering (a
    crash in native code at exit) does not fail the world: its result stands, with a
    warning;
  * no port is ever guessed: the parent hosts the rendezvous store on a port the OS
    picks, so concurrent runs never collide; each rank connects to it as a client.

Ranks are ordinary (non-daemonic) processes, so they can start their own children,
e.g. `DataLoader(num_workers=2)`, with the platform's default start method, as under
torchrun.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def _seconds(variable: str, default: float) -> float:
    """A positive number of seconds from the environment variable, else `default` (with a
    warning when it is set to something else: read at import, where an error would be a traceback)."""
    text = os.environ.get(variable)
    try:
        value = float(text) if text is not None else default
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        warnings.warn(f"{variable}={text!r} is not a positive number of seconds: using {default:g}", stacklevel=2)
        return default
    return value


DEFAULT_TIMEOUT_S = _seconds("COURSE_WORLD_TIMEOUT", 45.0)
START_TIMEOUT_S = _seconds("COURSE_WORLD_START_TIMEOUT", 120.0)
# Collectives time out later than the world, so a deadlock is reported by the
# stack dump of every rank (useful) rather than by one rank's gloo timeout.
_PG_TIMEOUT_MARGIN_S = 60.0
HEARTBEAT_S = 15.0  # a world still running after this long says so, then every HEARTBEAT_S
# Where those lines go (None: nowhere). The grading plugin points it at the terminal, so a
# learner waiting for a deadlock's deadline sees that the run is alive.
heartbeat: Callable[[str], None] | None = None
_CAN_SIGNAL = hasattr(signal, "SIGUSR1")
_HAS_GROUPS = hasattr(os, "setpgid") and hasattr(os, "killpg")  # POSIX process groups


@dataclass
class RankFailure:
    """What one rank raised, in a form that survives pickling."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    exception: BaseException | None = None  # the original, when it could be pickled
    when: float = 0.0  # time.time() when it was caught: the earliest failure is the cause


class WorldError(RuntimeError):
    """A world of ranks failed; `failures` maps rank -> RankFailure."""

    def __init__(self, summary: str, failures: dict[int, RankFailure], details: str = ""):
        self.failures = failures
        super().__init__(summary + ("\n" + details if details else ""))


class WorldTimeout(WorldError):
    """The world missed its deadline; `stacks` maps rank -> faulthandler dump.

    `not_started` lists the ranks that had not reached `fn` yet (still importing or
    joining the group): then the deadline was too short for the machine, and no code
    under test is to blame."""

    def __init__(self, summary: str, stacks: dict[int, str], details: str, not_started: tuple[int, ...] = ()):
        self.stacks = stacks
        self.not_started = tuple(not_started)
        super().__init__(summary, {}, details)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    forward_signals: tuple[int, ...] = (),
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on ranks 0..world_size-1; return their results in rank order.

    forward_signals: signals this process passes on to every rank while the world runs (a
    program's SIGTERM and SIGINT, for ranks that stop cleanly on them); a second SIGINT
    raises KeyboardInterrupt here instead, and the ranks are killed (Ctrl-C twice: stop now).
    Only from the main thread; a signal that comes before a rank has started reaches it once
    it has (ranks are in process groups of their own, so a terminal's Ctrl-C reaches only us)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"{fn!r} is not a module-level function; ranks are spawned processes and can "
            "only run functions they can import by name"
        )
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    from torch.distributed import TCPStore  # import here: `import common.launch` stays cheap

    # The parent hosts the store (port 0: the OS picks a free one, no race) and the
    # ranks connect to it as clients, as they do to torchrun's agent.
    store = TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        use_libuv=sys.platform != "win32",
    )
    run_dir = Path(tempfile.mkdtemp(prefix="course-world-"))
    # Deadlines on the monotonic clock (system-wide, so the ranks read the same one): a wall clock
    # stepped forward (NTP, a resumed VM) must not end a healthy world.
    start_deadline = time.monotonic() + START_TIMEOUT_S
    deadline = start_deadline + timeout  # the latest a rank can be needed: its own last resort
    ctx = _start_context()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, fn, args, kwargs or {}, store.port, str(run_dir), deadline, timeout, env or {},
                  os.getpid(), dict(os.environ)),
            name=f"rank{rank}",
            daemon=False,  # a daemonic process may not start children (DataLoader workers)
        )
        for rank in range(world_size)
    ]
    reaped: set[int] = set()  # ranks already joined (and their groups killed)
    forwarder = _SignalForwarder(procs, run_dir, forward_signals)
    try:
        with forwarder:
            for p in procs:
                p.start()
            _wait_for_world(procs, run_dir, start_deadline, timeout, reaped, forwarder)
        return [_load(run_dir / f"rank{r}.result") for r in range(world_size)]
    finally:
        started = [r for r, p in enumerate(procs) if p.pid is not None]
        for r in started:
            if r not in reaped:
                _kill_rank(procs[r])
        for r in started:
            procs[r].join(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)
        del store


# ---------------------------------------------------------------- parent side


def _start_context():
    """How ranks are started: a fork server where the platform has one, else spawn.

    Either way a rank is a fresh interpreter state that imports `fn` by name (nothing of
    the caller's memory leaks in). The fork server (Linux, macOS) is a process that has
    imported torch once and forks each rank from itself: a rank starts in ~50 ms instead
    of the 2-5 s that importing torch costs a spawned one. It lives as long as this
    process and starts no rank by itself. Windows has only spawn. torch._dynamo is preloaded
    too: the first DistributedDataParallel(...) of a process imports it (about 900 modules,
    1.5-3.5 s measured here with torch 2.14.1), which every rank of every DDP world would
    otherwise pay."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs (start_fork_server started it)
    return ctx


# the fork server first ignores SIGTERM (common/fork_server_signals.py), then imports torch
_PRELOAD = [f"{__package__}.fork_server_signals", "torch", "torch.distributed", "torch._dynamo", __name__,
            f"{__package__}.distributed"]


def start_fork_server(modules: list[str] = ()) -> None:
    """Start the fork server now, importing torch and `modules` (the ranks' own: what `fn`
    needs) in it while this process goes on with its own imports.

    For a program that will start ranks (the trainer's launcher): otherwise the server starts
    at the first rank, after this process has imported torch, and each rank then imports
    what `fn` needs, one import after the other. Overlapped, a 2-step trainer run of 2 CPU
    ranks took 3.6-3.9 s instead of 5.4-7.2 s (torch 2.14.1, 2 cores). Later worlds of this
    process fork their ranks from it. Nothing happens where there is no fork server
    (Windows) or once one runs. A module that fails to import is left to the rank (as
    multiprocessing does). The server is killed when this process exits: a program that
    ends on bad input would otherwise leave it finishing its imports."""
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the one fork server of this process (multiprocessing's own)
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    mp.get_context("forkserver").set_forkserver_preload([*_PRELOAD, *modules])
    server.ensure_running()
    atexit.register(_end_fork_server, server._forkserver_pid)


def _end_fork_server(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)  # its ranks are gone by now: run_world ended them
        os.waitpid(pid, 0)


def _kill_rank(p) -> None:
    """Kill a rank and every process it started (its process group), if any is left.

    Only for a rank not yet joined: until then its pid, which names the group, cannot
    be given to another process."""
    if _HAS_GROUPS:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank leads a group named by its pid
        except (ProcessLookupError, PermissionError):
            pass  # no group (the rank had not set it up yet, or all of it is gone)
    if p.is_alive():
        p.kill()


class _SignalForwarder:
    """While the world runs: each of `signals` that reaches this process is sent on to every
    rank that has started its code (a rank still starting up gets it once it has: see
    `deliver`, called by the wait loop); a second SIGINT raises KeyboardInterrupt."""

    def __init__(self, procs, run_dir: Path, signals: tuple[int, ...]):
        self.procs, self.run_dir, self.signals = procs, run_dir, tuple(signals)
        self.pending: list[int] = []
        self.sent: dict[int, int] = {}  # rank -> how many of `pending` it has been sent
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalForwarder":
        if self.signals and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if signum == getattr(signal, "SIGINT", None) and signal.SIGINT in self.pending:
            raise KeyboardInterrupt
        self.pending.append(signum)
        self.deliver()

    def deliver(self) -> None:
        """Send every rank that has started the signals it has not been sent yet."""
        for rank, p in enumerate(self.procs):
            if p.pid is None or not (self.run_dir / f"rank{rank}.started").exists():
                continue
            for signum in self.pending[self.sent.get(rank, 0):]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)
            self.sent[rank] = len(self.pending)


def _wait_for_world(procs, run_dir: Path, start_deadline: float, timeout: float, reaped: set[int],
                    forwarder: _SignalForwarder | None = None) -> None:
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    work_deadline = None  # set once every rank has joined the group and runs the code
    next_heartbeat = None
    while running:
        if forwarder is not None and forwarder.pending:
            forwarder.deliver()
        now = time.monotonic()
        if work_deadline is None and all((run_dir / f"rank{r}.started").exists() for r in range(len(procs))):
            work_deadline, next_heartbeat = now + timeout, now + HEARTBEAT_S
        remaining = (work_deadline or start_deadline) - now
        if remaining <= 0:
            _raise_timeout(procs, run_dir, timeout if work_deadline else START_TIMEOUT_S)
        if heartbeat is not None and next_heartbeat is not None and now >= next_heartbeat and remaining > 1.0:
            waiting = sorted(running.values())
            heartbeat(f"[{time.strftime('%H:%M:%S')}] world of {len(procs)}: ranks {waiting} still running after "
                      f"{now - (work_deadline - timeout):.0f} s; if they are stuck, the deadline in {remaining:.0f} s "
                      "reports where each one waits")
            next_heartbeat = now + HEARTBEAT_S
        # until every rank has started, watch for that (and deliver signals that came early)
        poll = remaining if work_deadline else min(remaining, 0.1)
        if heartbeat is not None and next_heartbeat is not None:
            poll = max(min(poll, next_heartbeat - now), 0.0)
        for sentinel in mp.connection.wait(list(running), timeout=poll):
            rank = running.pop(sentinel)
            _kill_rank(procs[rank])  # it has exited: nothing it started may outlive it
            procs[rank].join()
            reaped.add(rank)
            if procs[rank].exitcode == 0:
                continue
            if (run_dir / f"rank{rank}.result").exists():
                # The result is delivered; a crash after it (at exit, in native code)
                # cannot change it, so it must not turn a correct run into a failure.
                warnings.warn(f"rank {rank} delivered its result, then {_death(procs[rank].exitcode)} "
                              f"while exiting{_where(run_dir, rank)}", RuntimeWarning, stacklevel=3)
                continue
            _raise_rank_failure(procs, rank, run_dir, reaped)


def _death(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _where(run_dir: Path, rank: int) -> str:
    """' in file:line ...' from the dump faulthandler wrote when a fatal signal hit the rank."""
    path = run_dir / f"rank{rank}.stack"
    dump = path.read_text(errors="replace") if path.exists() else ""
    return f" in {describe_stuck_frame(dump)}" if "Fatal Python error" in dump else ""


def _raise_rank_failure(procs, rank: int, run_dir: Path, reaped: set[int]) -> None:
    for r, p in enumerate(procs):  # the others are probably blocked waiting for this rank
        if r not in reaped:
            _kill_rank(p)
    failures = {r: _load(run_dir / f"rank{r}.error") for r in range(len(procs))
                if (run_dir / f"rank{r}.error").exists()}
    if rank not in failures:
        where = _where(run_dir, rank)
        # When it died: the fatal-signal dump's time if it left one, so that a rank whose
        # peer died first does not pass for the cause of the failure.
        when = (run_dir / f"rank{rank}.stack").stat().st_mtime if where else time.time()
        message = f"rank {rank} {_death(procs[rank].exitcode)} before reporting{where}"
        failures[rank] = RankFailure(rank, "ProcessDied", message, "", None, when)
    # A rank that raises makes its peers fail too ("connection closed by peer"):
    # the first failure is the cause, the others are consequences.
    cause = min(failures.values(), key=lambda f: f.when)
    summary = f"rank {cause.rank} of {len(procs)} raised {cause.exc_type}: {cause.message}"
    others = sorted(set(failures) - {cause.rank})
    if others:
        summary += f"\n(then ranks {others} failed waiting for it)"
    details = f"--- traceback of rank {cause.rank} ---\n{cause.traceback}"
    raise WorldError(summary, failures, details)


def _raise_timeout(procs, run_dir: Path, timeout: float) -> None:
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    if _CAN_SIGNAL:
        for r in alive:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    settle_by = time.monotonic() + 3.0  # one wait for all the dumps, not one per rank
    stacks = {r: _read_settled(run_dir / f"rank{r}.stack", settle_by) for r in alive}
    not_started = [r for r in alive if not (run_dir / f"rank{r}.started").exists()]
    if not_started:
        lines = [f"world of {len(procs)} ranks did not start within {timeout:.0f}s: ranks {not_started} had not "
                 "reached the code under test (a busy machine? raise COURSE_WORLD_START_TIMEOUT)."]
    else:
        lines = [f"world of {len(procs)} ranks did not finish within {timeout:.0f}s (a deadlock?)."]
    lines.append("Where each rank was waiting (innermost frame outside torch):")
    for r, p in enumerate(procs):
        if r not in stacks:
            lines.append(f"  rank {r}: finished (exit code {p.exitcode})")
        elif r in not_started:
            lines.append(f"  rank {r}: still starting up (importing torch or joining the group)")
        elif (run_dir / f"rank{r}.result").exists():
            lines.append(f"  rank {r}: finished its work, waiting for the other ranks to finish theirs")
        else:
            lines.append(f"  rank {r}: {describe_stuck_frame(stacks[r])}")
    details = "\n".join(f"--- stack of rank {r} ---\n{s or '(no dump)'}" for r, s in stacks.items())
    raise WorldTimeout("\n".join(lines), stacks, details, not_started)


def _read_settled(path: Path, end: float) -> str:
    """Read a stack dump once the rank has finished writing it (size stable), or at `end`."""
    last = -1
    while time.monotonic() < end:
        size = path.stat().st_size if path.exists() else 0
        if size and size == last:
            break
        last = size
        time.sleep(0.05)
    return path.read_text(errors="replace") if path.exists() else ""


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def describe_stuck_frame(dump: str, harness: Callable[[str], bool] | None = None) -> str:
    """'file:line in func (waiting inside distributed_c10d.py:recv)' for the rank's main thread,
    from a faulthandler dump: its innermost frame outside torch, and the innermost frame.

    harness(filename): True for the files of code that drives the code under test (a test's
    scenario, a wrapper it put around a torch call); their frames are passed over, unless no
    other frame is the code's own."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    main = next((t for t in threads if "in _rank_main" in t), None)
    if main is None:
        return "no stack dump (still starting up, or stuck outside Python)"
    frames = [m.groupdict() for m in _FRAME.finditer(main)]  # innermost first
    # the rank's code only: not the frames that started the process and called it
    frames = frames[:next((i for i, f in enumerate(frames) if f["func"] == "_rank_main" and f["file"] == __file__),
                          len(frames))]
    if harness is not None:
        code = [f for f in frames if not harness(f["file"])]
        if any(not _is_library(f["file"]) for f in code):
            frames = code
    own = [f for f in frames if not _is_library(f["file"])]
    inner = frames[0] if frames else None
    if not own or inner is None:
        return "no frame of user code found"
    where = f'{own[0]["file"]}:{own[0]["line"]} in {own[0]["func"]}'
    if inner is not own[0]:
        where += f' (waiting inside {Path(inner["file"]).name}:{inner["func"]})'
    return where


def _is_library(filename: str) -> bool:
    parts = Path(filename).parts
    return "torch" in parts or "site-packages" in parts or filename == __file__


def _load(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)


# ------------------------------------------------------------------ rank side


def _dump_atomically(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _wait_until_every_rank_delivered(store, world_size: int, timeout_s: float) -> None:
    """A barrier on the parent's store: no rank leaves before every rank has delivered.

    A rank that leaves closes its connections; a peer still finishing its last collective
    would lose it. The store, not the process group, carries this barrier: the code under
    test may have left the group in any state (a pending send, a collective one rank
    skipped), and a rank that raised never arrives (the parent then stops the world)."""
    import datetime

    if store.add("course/delivered", 1) == world_size:
        store.set("course/all_delivered", "1")
    store.wait(["course/all_delivered"], datetime.timedelta(seconds=timeout_s))


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (signal 0 asks without sending anything). Windows has
    no signal 0 (os.kill(pid, 0) sends a console Ctrl-C there): it answers True."""
    if pid <= 0:
        return False
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but is not ours to signal
        return True
    return True


def _exit_when_orphaned(parent_pid: int, caller_pid: int) -> None:
    """`parent_pid`: this process's parent (run_world's caller, or the fork server that
    forked us for it); `caller_pid`: run_world's caller. Either gone -> leave."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid or not pid_alive(caller_pid):
            if _HAS_GROUPS:
                os.killpg(0, signal.SIGKILL)  # this rank and the processes it started
            os._exit(3)


def _rank_main(rank, world_size, fn, args, kwargs, port, run_dir, deadline, timeout, env, caller_pid,
               caller_env) -> None:
    if _HAS_GROUPS:
        os.setpgid(0, 0)  # lead a process group: the parent kills it whole (rank + its children)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server ignores it (fork_server_signals.py)
    # A spawned child inherits "spawn" as its start method; a torchrun rank has the
    # platform's default (fork on Linux), so its DataLoader workers start in milliseconds.
    mp.set_start_method(None, force=True)
    run_dir = Path(run_dir)
    os.environ.clear()  # a forked rank inherited the fork server's environment: take the caller's
    os.environ.update(caller_env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", COURSE_LAUNCHER_PID=str(caller_pid),
    )
    os.environ.update(env)

    stack_file = open(run_dir / f"rank{rank}.stack", "w")
    remaining = max(deadline - time.monotonic(), 1.0)
    faulthandler.enable(file=stack_file, all_threads=True)  # a fatal signal leaves where it hit
    if _CAN_SIGNAL:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        # Last resort if the parent vanished without killing us.
        faulthandler.dump_traceback_later(remaining + 30, exit=True, file=stack_file)
    else:  # Windows: no signals, so each rank dumps its own stack at the deadline (set below).
        faulthandler.dump_traceback_later(remaining, file=stack_file)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(), caller_pid), daemon=True).start()

    import datetime

    import torch
    from torch.distributed import TCPStore

    from .distributed import init_distributed, platform_env_defaults

    for key, value in platform_env_defaults().items():
        os.environ.setdefault(key, value)  # before the store client: Windows needs USE_LIBUV=0

    torch.set_num_threads(1)
    code = 0
    try:
        pg_timeout_s = remaining + _PG_TIMEOUT_MARGIN_S
        # A client of the parent's store (public API; torchrun's ranks are clients of the
        # agent's store in the same way). The store serves this world only, so no
        # PrefixStore is needed: torch adds the group's own prefix to every key.
        store = TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=pg_timeout_s))
        init_distributed(timeout_s=pg_timeout_s, store=store)
        (run_dir / f"rank{rank}.started").touch()
        if not _CAN_SIGNAL:  # the parent's clock starts about now: dump just before it runs out
            faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), file=stack_file)
        result = fn(*args, **kwargs)
        _dump_atomically(result, run_dir / f"rank{rank}.result")
        _wait_until_every_rank_delivered(store, world_size, pg_timeout_s)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            pickle.dumps(exc)
            original = exc
        except Exception:  # noqa: BLE001
            original = None
        failure = RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc(), original, time.time())
        _dump_atomically(failure, run_dir / f"rank{rank}.error")
        code = 1
    faulthandler.cancel_dump_traceback_later()
    # Leave without tearing native state down (the process group, gloo's threads, torch's
    # static objects): every result is out, and ranks were seen to abort (SIGABRT) in
    # that teardown after finishing their work, while their peers closed connections.
    # multiprocessing still runs its finalizers (joins children, releases tqdm's lock):
    # sys.exit returns through them; then a forked rank leaves by os._exit (that is how
    # the fork server ends its children), a spawned one by this first atexit hook.
    atexit.register(_exit_now, code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to write
            pass
    os._exit(code)


# ------------------------------------------------------------ command lines


def run_or_join(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout: float | None = None,
                forward_signals: tuple[int, ...] = ()):
    """For command-line programs: return rank 0's result of `fn(*args)`.

    Under torchrun (RANK is set) this process *is* a rank: it joins the group, runs
    `fn`, and returns the result on rank 0 and None elsewhere (torchrun's agent forwards
    signals itself). Otherwise it starts `nproc` ranks on this machine with `run_world`,
    which passes `forward_signals` on to them.
    """
    if "RANK" in os.environ:
        import torch.distributed as dist

        from .distributed import cleanup_distributed, init_distributed

        info = init_distributed()
        try:
            result = fn(*args)
            dist.barrier()  # as in run_world: no rank tears the group down while a peer still works
        finally:
            cleanup_distributed()
        return result if info.is_main else None
    return run_world(fn, nproc, args=args, timeout=timeout, forward_signals=forward_signals)[0]


USER_ERRORS = (FileNotFoundError, ValueError, NotImplementedError)


class exit_on_user_error:
    """Context manager for `main()`: bad input (a missing dataset, a bad value, an
    unfinished TODO) ends the program with one line on stderr and exit code 2
    instead of a traceback. Any other error keeps its full traceback."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        if isinstance(exc, WorldError) and exc.failures:
            cause = min(exc.failures.values(), key=lambda f: f.when)
            exc = cause.exception or exc
        if isinstance(exc, USER_ERRORS):
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2)
        return False
