"""Run a function on a world of N ranks, and never hang.

    results = run_world(my_worker, world_size=4, args=(1024,))   # one result per rank

`my_worker` must be a module-level function (ranks are started with the *spawn*
method, which pickles it by name). Each rank joins the process group through
`common.distributed.init_distributed`, exactly as under `torchrun`, runs
`my_worker(*args)`, and sends its return value back to the parent, so tests can
assert in one place with readable diffs.

Guarantees:
  * a rank that raises fails the call at once with that rank's number and traceback
    (`WorldError`);
  * a world that does not finish within `timeout` seconds (a deadlock: a rank skipped
    a collective, a ring sends before it receives) fails with `WorldTimeout`, which
    shows for every rank the file and line where it was waiting;
  * no rank outlives the call, even if the parent is killed;
  * no port is ever guessed: the parent hosts the rendezvous store on a port the OS
    picks, so concurrent runs never collide.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DEFAULT_TIMEOUT_S = float(os.environ.get("COURSE_WORLD_TIMEOUT", "45"))
# Collectives time out later than the world, so a deadlock is reported by the
# stack dump of every rank (useful) rather than by one rank's gloo timeout.
_PG_TIMEOUT_MARGIN_S = 60.0
_CAN_SIGNAL = hasattr(signal, "SIGUSR1")


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
    """The world missed its deadline; `stacks` maps rank -> faulthandler dump."""

    def __init__(self, summary: str, stacks: dict[int, str], details: str):
        self.stacks = stacks
        super().__init__(summary, {}, details)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on ranks 0..world_size-1; return their results in rank order."""
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
    deadline = time.time() + timeout
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, fn, args, kwargs or {}, store.port, str(run_dir), deadline, env or {}),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        _wait_for_world(procs, run_dir, deadline, timeout)
        return [_load(run_dir / f"rank{r}.result") for r in range(world_size)]
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)
        del store


# ---------------------------------------------------------------- parent side


def _wait_for_world(procs, run_dir: Path, deadline: float, timeout: float) -> None:
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        remaining = deadline - time.time()
        if remaining <= 0:
            _raise_timeout(procs, run_dir, timeout)
        for sentinel in mp.connection.wait(list(running), timeout=remaining):
            rank = running.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0:
                _raise_rank_failure(procs, rank, run_dir)


def _raise_rank_failure(procs, rank: int, run_dir: Path) -> None:
    for p in procs:  # the others are probably blocked waiting for this rank
        if p.is_alive():
            p.kill()
    failures = {r: _load(run_dir / f"rank{r}.error") for r in range(len(procs))
                if (run_dir / f"rank{r}.error").exists()}
    if rank not in failures:
        code = procs[rank].exitcode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        failures[rank] = RankFailure(rank, "ProcessDied", f"rank {rank} died ({how}) before reporting", "", None, time.time())
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
    stacks = {r: _read_settled(run_dir / f"rank{r}.stack") for r in alive}
    lines = [f"world of {len(procs)} ranks did not finish within {timeout:.0f}s (a deadlock?)."]
    lines.append("Where each rank was waiting (innermost frame outside torch):")
    for r, p in enumerate(procs):
        if r not in stacks:
            lines.append(f"  rank {r}: finished (exit code {p.exitcode})")
        else:
            lines.append(f"  rank {r}: {describe_stuck_frame(stacks[r])}")
    details = "\n".join(f"--- stack of rank {r} ---\n{s or '(no dump)'}" for r, s in stacks.items())
    raise WorldTimeout("\n".join(lines), stacks, details)


def _read_settled(path: Path, limit_s: float = 3.0) -> str:
    """Read a stack dump once the rank has finished writing it (size stable)."""
    end, last = time.time() + limit_s, -1
    while time.time() < end:
        size = path.stat().st_size if path.exists() else 0
        if size and size == last:
            break
        last = size
        time.sleep(0.05)
    return path.read_text(errors="replace") if path.exists() else ""


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def describe_stuck_frame(dump: str) -> str:
    """'file:line in func (in torch: recv)' for the rank's main thread, from a faulthandler dump."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    main = next((t for t in threads if "in _rank_main" in t), None)
    if main is None:
        return "no stack dump (still starting up, or stuck outside Python)"
    frames = [m.groupdict() for m in _FRAME.finditer(main)]  # innermost first
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


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _rank_main(rank, world_size, fn, args, kwargs, port, run_dir, deadline, env) -> None:
    from .distributed import cleanup_distributed, init_distributed, platform_env_defaults

    run_dir = Path(run_dir)
    os.environ.update(platform_env_defaults())
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # connect to the parent's store as a client
        OMP_NUM_THREADS="1",
    )
    os.environ.update(env)

    stack_file = open(run_dir / f"rank{rank}.stack", "w")
    remaining = max(deadline - time.time(), 1.0)
    if _CAN_SIGNAL:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        # Last resort if the parent vanished without killing us.
        faulthandler.dump_traceback_later(remaining + 30, exit=True, file=stack_file)
    else:  # Windows: no signals, so each rank dumps its own stack at the deadline.
        faulthandler.dump_traceback_later(max(remaining - 1.0, 0.5), file=stack_file)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()

    import torch

    torch.set_num_threads(1)
    code = 0
    try:
        init_distributed(timeout_s=remaining + _PG_TIMEOUT_MARGIN_S)
        result = fn(*args, **kwargs)
        _dump_atomically(result, run_dir / f"rank{rank}.result")
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            pickle.dumps(exc)
            original = exc
        except Exception:  # noqa: BLE001
            original = None
        failure = RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc(), original, time.time())
        _dump_atomically(failure, run_dir / f"rank{rank}.error")
        code = 1
    finally:
        cleanup_distributed()
        faulthandler.cancel_dump_traceback_later()
    sys.exit(code)  # multiprocessing runs its finalizers (e.g. releases tqdm's lock), then exits


# ------------------------------------------------------------ command lines


def run_or_join(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout: float | None = None):
    """For command-line programs: return rank 0's result of `fn(*args)`.

    Under torchrun (RANK is set) this process *is* a rank: it joins the group, runs
    `fn`, and returns the result on rank 0 and None elsewhere. Otherwise it starts
    `nproc` ranks on this machine with `run_world`.
    """
    if "RANK" in os.environ:
        from .distributed import cleanup_distributed, init_distributed

        info = init_distributed()
        try:
            result = fn(*args)
        finally:
            cleanup_distributed()
        return result if info.is_main else None
    return run_world(fn, nproc, args=args, timeout=timeout)[0]


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
