"""4.2 Automatic recovery under torchrun: the same command starts, restarts and resumes a run.

    checkpoints = CheckpointManager(folder, keep=3)
    outcome = run_resumable(train_step, model, optimizer, checkpoints, total_steps=1000, every=50,
                            injector=FaultInjector.from_env())

What happens on every attempt (torchrun starts one per restart, in fresh processes):

    current_attempt()     rank, world size, restart count: read NOW from the process group
                          and TORCHELASTIC_RESTART_COUNT, never kept from an earlier attempt
    resume()              the newest checkpoint that verifies, the SAME step on every rank
                          (rank 0 picks, broadcasts); none: a fresh start
    set_aside_newer()     rank 0 renames the newer ones (corrupt) out of keep-last-k's count
    step s ...            train_step(StepContext) for s = start .. total_steps - 1
    step boundary         PreemptionHandler.should_stop(): every rank's "SIGTERM seen" flag,
                          all-reduced (MAX), so all ranks stop at the same boundary
                          save when (s + 1) % every == 0, at the end, or when stopping

A SIGKILLed rank loses at most `every` steps: torchrun stops the whole group and restarts
it; the new attempt resumes from the newest complete checkpoint. A SIGTERM (preemption)
loses nothing: the ranks agree to stop at the next boundary and save there.

FaultInjector kills a chosen rank at a chosen step and phase (forward, backward, allreduce,
save), on a chosen restart attempt only, or signals whatever launched the job (the torchrun
agent, or common.launch's launcher): SIGTERM or SIGINT (a deterministic preemption or
Ctrl-C), or SIGKILL (a launcher that dies and leaves its ranks orphaned). Spec: "rank=1,step=7,phase=backward[,attempt=0][,action=kill]",
several joined by ";", e.g. from the environment variable COURSE_FAULTS.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from common.distributed import current_device
from common.launch import pid_alive
from phase4_production.checkpoint import (CheckpointManager, restore_training_state, training_state,
                                                    unwrap)

FAULTS_ENV = "COURSE_FAULTS"
PHASES = ("data", "forward", "backward", "allreduce", "save")
ACTIONS = ("kill", "term", "term-group", "int", "kill-launcher", "hang", "enospc", "slow")
EVERY_STEP = -1  # step=* in a spec


# ---------------------------------------------------------------- who am I, this attempt


@dataclass(frozen=True)
class Attempt:
    """This process in the current attempt. rank and world_size come from the process group
    (0 and 1 without one); restart is TORCHELASTIC_RESTART_COUNT (0 outside torchrun)."""

    rank: int
    world_size: int
    restart: int


def current_attempt() -> Attempt:
    """Who this process is now. Call it on every attempt (every call reads afresh): after a
    restart the rank and the world size may differ from the previous attempt's."""
    raise NotImplementedError('TODO 4.2: the rank and world size of the process group as it is now, and the restart count from TORCHELASTIC_RESTART_COUNT')


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters live: checkpoints load there, collectives use it."""
    first = next(unwrap(model).parameters(), None)
    return first.device if first is not None else torch.device("cpu")


# ---------------------------------------------------------------- resume on start


def resume(checkpoints: CheckpointManager, model, optimizer, scheduler=None, scaler=None,
           map_location: Any = None) -> dict | None:
    """Load the newest checkpoint that verifies into model, optimizer, scheduler, scaler and
    this rank's RNG; return its progress dict (progress["step"] = steps done), or None when
    there is none (a fresh start: nothing is changed). Collective under a process group:
    every rank loads the SAME step, the one rank 0 found (a shared file system may show
    the ranks different folder listings); rank 0's check of the file stands for all, so
    the others may load it without hashing it again. map_location defaults to the model's device."""
    raise NotImplementedError('TODO 4.2: rank 0 finds the newest valid step (CheckpointManager.load_latest), every rank loads that step; broadcast_object_list')


CORRUPT_SUFFIX = ".corrupt"


def set_aside_newer(checkpoints: CheckpointManager, resumed: int | None) -> list[Path]:
    """On rank 0, rename every checkpoint newer than step `resumed` (the one resume() loaded;
    None: it found none) to its name + CORRUPT_SUFFIX, one warning line each on stderr.
    Returns the new paths (rank 0; [] on the other ranks).

    resume() loads the newest checkpoint that verifies, so the newer ones failed. Left under
    their names they would still be counted by keep-last-k, which ranks files by step: with
    `keep` of them above every step this run saves, each new checkpoint would be the oldest
    and deleted as soon as it is written, and the next crash would start from scratch.
    Renamed, not deleted: kept for inspection. Call it after resume(), before the first save.
    """
    raise NotImplementedError('TODO 4.2: on rank 0, rename (never delete) every checkpoint newer than `resumed` (all if None) to name + CORRUPT_SUFFIX')


# ---------------------------------------------------------------- preemption: SIGTERM -> stop at a boundary


class PreemptionHandler:
    """Turn each of `signals` (default: SIGTERM) into a request to stop at the next step
    boundary. Only those: a signal not in the list keeps the handler it had.

        with PreemptionHandler() as preemption:
            for step in ...:
                train one step
                if preemption.should_stop():    # every rank, every step boundary
                    save; break

    The handler only records the signal: a signal arrives in the middle of a step (inside
    a collective, half-way through optimizer.step), where the state is not a checkpoint.
    The previous handlers are put back on exit. Install it from the main thread.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), device: torch.device | None = None):
        self.signals = tuple(signals)
        self.device = device  # where the agreement's one-element tensor lives (cuda under NCCL)
        self.received: int | None = None  # the last stop signal this rank has seen, if any
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether THIS rank has seen a stop signal (other ranks may not have yet)."""
        return self.received is not None

    def _on_signal(self, signum: int, frame) -> None:
        raise NotImplementedError('TODO 4.2: only record that the signal came (a signal interrupts a step anywhere: no saving, no collective, no exit here)')

    def __enter__(self) -> "PreemptionHandler":
        raise NotImplementedError('TODO 4.2: install _on_signal for each of self.signals and remember the handler each one had (signal.signal returns it)')

    def __exit__(self, *exc) -> None:
        raise NotImplementedError('TODO 4.2: put back the handlers __enter__ replaced')

    def should_stop(self) -> bool:
        """Whether ANY rank has seen a stop signal. Collective: every rank calls it at every
        step boundary, and all get the same answer, so no rank stops while another enters
        the next step's collectives (which would wait for it forever)."""
        raise NotImplementedError("TODO 4.2: every rank's flag, reduced with MAX over the group (one-element tensor on the device the group communicates on)")

    def _collective_device(self) -> torch.device:
        return self.device if self.device is not None else current_device()


# ---------------------------------------------------------------- fault injection (a tool, not an exercise)


@dataclass(frozen=True)
class Fault:
    """Kill (SIGKILL) `rank`, make it hang (action "hang": alive, never back), make its write
    fail as on a full disk (action "enospc", for phase "save"), or signal the
    job's launcher (action "term": SIGTERM, "int": SIGINT, "kill-launcher": SIGKILL; "term-group":
    SIGTERM to the launcher's whole process group, as `kill -TERM -<pgid>` or a shell's
    `kill %1` sends it), when it
    reaches `phase` of step `step` (0-based; EVERY_STEP, "*" in a spec: every step) in restart
    attempt `attempt` (TORCHELASTIC_RESTART_COUNT). Action "slow" makes the rank sleep `ms`
    milliseconds there (a straggler: a slow disk, a throttled GPU, a noisy neighbour).
    phase "save" fires while the checkpoint taken at the end of step `step` is being
    written (half its bytes are in the temporary file, the rename has not happened), on
    the rank that writes it."""

    rank: int
    step: int
    phase: str
    attempt: int = 0
    action: str = "kill"
    ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """'rank=1,step=7,phase=backward[,attempt=0][,action=kill]' -> Fault."""
        fields = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"fault {text!r}: {item!r} is not key=value")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "step", "phase", "attempt", "action", "ms"}
        if unknown or not {"rank", "step", "phase"} <= set(fields):
            raise ValueError(f"fault {text!r}: needs rank, step, phase (optional attempt, action, ms); "
                             f"unknown: {sorted(unknown)}")
        step = EVERY_STEP if fields["step"] == "*" else int(fields["step"])
        fault = cls(int(fields["rank"]), step, fields["phase"], int(fields.get("attempt", 0)),
                    fields.get("action", "kill"), float(fields.get("ms", 0)))
        if fault.phase not in PHASES or fault.action not in ACTIONS:
            raise ValueError(f"fault {text!r}: phase must be one of {PHASES}, action one of {ACTIONS}")
        return fault

    def __str__(self) -> str:
        step = "*" if self.step == EVERY_STEP else self.step
        return f"rank={self.rank},step={step},phase={self.phase},attempt={self.attempt},action={self.action}" + \
            (f",ms={self.ms:g}" if self.action == "slow" else "")


class FaultInjector:
    """Fires the faults of a spec at the phase points of the training loop.

    The loop calls begin_step(s) before each step and point(phase) at each phase; a DDP
    model gets the "allreduce" point by `ddp.register_comm_hook(None, injector.allreduce_hook)`;
    the loop wraps its checkpoint save in `with injector.saving():`. With no faults every
    call is a no-op. Rank and attempt are read when a point is reached, never cached.
    """

    def __init__(self, faults: tuple[Fault, ...] | list[Fault] = ()):
        self.faults = tuple(faults)
        self.step: int | None = None

    @classmethod
    def from_string(cls, spec: str) -> "FaultInjector":
        """Faults separated by ';' (empty string: none)."""
        return cls([Fault.parse(part) for part in spec.split(";") if part.strip()])

    @classmethod
    def from_env(cls, variable: str = FAULTS_ENV) -> "FaultInjector":
        return cls.from_string(os.environ.get(variable, ""))

    def begin_step(self, step: int) -> None:
        self.step = step

    def point(self, phase: str) -> None:
        """The current step reached `phase`: fire the faults scheduled here for this rank."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        for fault in self._due(phase):
            self._fire(fault)

    def allreduce_hook(self, process_group, bucket):
        """A DDP communication hook: the "allreduce" point, then torch's plain all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.point("allreduce")
        return allreduce_hook(process_group, bucket)

    @contextmanager
    def saving(self, step: int | None = None) -> Iterator[None]:
        """Around a checkpoint save: a "save" fault due now makes torch.save write half of
        the bytes to its file, flush them, and the process die (before any rename). `step`:
        the step whose checkpoint is written (default: the current one), for a writer thread
        that runs while the loop has moved on. torch.save is patched for the whole process
        while the block runs, as a background writer's save runs in another thread.

        A signal action ("term", "int") in a writer thread, which cannot take the forwarded
        signal itself, asks the launcher to send it and lets the save go on, complete: the
        signal reaches the training thread while the save is in flight."""
        due = self._due("save", step)
        if not due:
            yield
            return
        real_save = torch.save

        def torn_save(obj, f, *args, **kwargs):
            fault = due[0]
            if fault.action in _SIGNAL_OF and threading.current_thread() is not threading.main_thread():
                print(f"\n[fault injector] {fault.action} at {fault} (pid {os.getpid()}, checkpoint writer thread)",
                      file=sys.stderr, flush=True)
                _send_to_launcher(fault.action)
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            half = buffer.getvalue()[: buffer.getbuffer().nbytes // 2]
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as out:
                    out.write(half)
            else:
                f.write(half)
                f.flush()
            self._fire(due[0])

        torch.save = torn_save
        try:
            yield
        finally:
            torch.save = real_save

    def _due(self, phase: str, step: int | None = None) -> list[Fault]:
        step = self.step if step is None else step
        if not self.faults or step is None:
            return []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return [f for f in self.faults if (f.rank, f.phase, f.attempt) == (rank, phase, attempt)
                and f.step in (step, EVERY_STEP)]

    def _fire(self, fault: Fault) -> None:
        if fault.action == "slow":  # every step, silently
            time.sleep(fault.ms / 1e3)
            return
        # a line of its own: rank 0's progress bar may be half-way through a line on the terminal
        print(f"\n[fault injector] {fault.action} at {fault} (pid {os.getpid()})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "kill-launcher":
            _kill_launcher()
        elif fault.action == "hang":  # alive but stuck (a dead NIC, a GPU hang): only a timeout notices
            while True:
                time.sleep(3600)
        elif fault.action == "enospc":  # the write fails as on a full disk (phase "save": half the bytes are out)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        else:
            _signal_via_launcher(fault.action)


def _launcher_pid(action: str) -> int:
    """The process that launched this rank: the torchrun agent (our parent), or the program
    that called common.launch.run_world (it exports COURSE_LAUNCHER_PID)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.getppid()
    if "COURSE_LAUNCHER_PID" in os.environ:
        return int(os.environ["COURSE_LAUNCHER_PID"])
    raise RuntimeError(f"fault action {action!r} signals the job's launcher: run under torchrun or common.launch")


def _kill_launcher(timeout_s: float = 60.0) -> None:
    """SIGKILL the launcher and return once it is gone (the kernel takes a moment to end a
    process): from then on this rank trains on as an orphan would, unless it dies with its
    parent. The orphaning then lands in a known step, with no sleep in any test."""
    launcher, parent = _launcher_pid("kill-launcher"), os.getppid()
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (os.getppid() == parent if launcher == parent else pid_alive(launcher)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the launcher (pid {launcher}) did not die within {timeout_s:.0f}s of a SIGKILL")
        time.sleep(0.01)


_SIGNAL_OF = {"term": signal.SIGTERM, "term-group": signal.SIGTERM, "int": signal.SIGINT}


def _send_to_launcher(action: str) -> None:
    """The signal of a signal action ("term", "term-group", "int") to the launcher, or with
    "term-group" to every process of its process group (the ranks lead groups of their own:
    not to this rank)."""
    signum = _SIGNAL_OF[action]
    launcher = _launcher_pid(action)
    if action == "term-group":
        os.killpg(os.getpgid(launcher), signum)
    else:
        os.kill(launcher, signum)


def _signal_via_launcher(action: str, timeout_s: float = 60.0) -> None:
    """Send the signal of `action` (_send_to_launcher), as a cluster's preemption (or a user's
    Ctrl-C) would, and return once the launcher has forwarded it to this rank and the rank's
    handler has run: the signal then lands in a known step, with no sleep in any test."""
    arrived = []
    signum = _SIGNAL_OF[action]
    previous = signal.signal(signum, lambda sig, frame: arrived.append(sig))
    try:
        _send_to_launcher(action)
        deadline = time.monotonic() + timeout_s
        while not arrived:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the launcher did not forward {signal.Signals(signum).name} within {timeout_s:.0f}s")
            time.sleep(0.01)  # a signal ends the sleep; the handler runs in this thread
    finally:
        signal.signal(signum, previous)
    signal.raise_signal(signum)  # now to the handler the training loop installed


# ---------------------------------------------------------------- the loop


@dataclass(frozen=True)
class StepContext:
    """What train_step gets: the step index (0-based), who this rank is in THIS attempt (shard
    the data with it), and `phase(name)` to call on entering "forward" and "backward"."""

    step: int
    attempt: Attempt
    phase: Callable[[str], None]


@dataclass(frozen=True)
class RunOutcome:
    """How an attempt ended: it resumed after `start_step` steps (0: fresh start) and stopped
    after `steps_done`; `preempted` if it stopped early on a stop signal (checkpoint saved)."""

    start_step: int
    steps_done: int
    preempted: bool
    attempt: Attempt


def run_resumable(train_step: Callable[[StepContext], None], model, optimizer, checkpoints: CheckpointManager, *,
                  total_steps: int, every: int, scheduler=None, scaler=None, injector: FaultInjector | None = None,
                  signals: tuple[int, ...] = (signal.SIGTERM,), map_location: Any = None,
                  extra_progress: Callable[[], dict] | None = None,
                  on_resume: Callable[[dict], None] | None = None) -> RunOutcome:
    """Run steps [start, total_steps) where start is the step of the newest valid checkpoint
    (0 without one), on every rank of the current process group; the same call starts a
    run, resumes it after a crash, and does nothing for a finished run. Checkpoints newer
    than the one resumed (they failed verification) are set aside (set_aside_newer) before
    the first save, so that keep-last-k keeps this run's new checkpoints.

    Checkpoints (training_state, progress {"step": steps done, **extra_progress()}, with
    extra_progress() called when the checkpoint is taken) are saved after every `every`
    steps, after the last step, and at the step boundary where the ranks agree to stop on
    one of `signals` (PreemptionHandler): a signal that reaches one rank only stops every
    rank at the same boundary, and every rank returns preempted=True with the same
    steps_done, once that checkpoint is complete on disk (no rank reports the stop before
    the writer has written). The previous signal handlers are restored on return.
    on_resume(progress) is called once after loading a checkpoint, before the first step,
    with the progress dict it holds (e.g. to put a sampler back at its position); not on a
    fresh start. Exceptions (a peer died inside a collective) propagate: torchrun then
    restarts the group.
    """
    raise NotImplementedError("TODO 4.2: the docstring's contract, from resume, set_aside_newer, PreemptionHandler and the injector; see the module's diagram")
