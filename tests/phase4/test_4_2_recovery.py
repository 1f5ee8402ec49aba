"""Graded tests of exercise 4.2, automatic recovery under torchrun (phase4_production/guidelines.md, section 4.2).

Run them with `python tests/test_phase4.py -k 4_2` (your code) or
`pytest tests/test_phase4.py -k 4_2` (the reference); tests/test_phase4.py collects them.

Cheap checks first, in this process (resume from the newest valid checkpoint; a SIGTERM
mid-step saves at the next step boundary, and the resumed run is bitwise the run that was
never stopped; the handler takes the signals it is given and no other; extra_progress is
saved and handed back to on_resume) and in worlds of 2 ranks (a SIGTERM seen by ONE rank
stops BOTH at the same boundary, and no rank reports the stop before the checkpoint is on
disk; the rank and world size a loop hands its step are those of the current attempt,
after the process group is rebuilt at another size and with other ranks).

Then the real thing, ONE torchrun job (`--standalone --nproc-per-node=2 --max-restarts=3`)
driven by the fault injector: SIGKILL rank 1 in a backward, rank 0 inside DDP's
all-reduce (a comm hook), rank 0 while it writes a checkpoint, each on the next restart
attempt; then a SIGTERM to the agent (preemption), and the same command launched again
finishes the run. Its final parameters must equal, bit for bit (torch.equal), those of a
plain uninterrupted DDP loop on 2 ranks (common.launch.run_world: the same gloo
all-reduce, so the same bits; checked when this test was written).

Every torchrun launch sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.14's
default, a restarted attempt reuses the agent's TCP store and its workers can read the
dead attempt's gloo addresses (guidelines 4.2, "the store-reuse pitfall").
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import grading
from common.launch import run_world
from common.torchrun import run_agent
from compare import assert_no_problems
from phase4 import recovery_torchrun_worker as worker

_TORCHRUN_DEADLINE_S = float(os.environ.get("COURSE_TORCHRUN_TIMEOUT", "180"))
# What every phase-4 torchrun launch sets (guidelines 4.2): no store shared across restarts.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}

# The torchrun job: 12 steps, a checkpoint every 2; one fault per restart attempt.
_TOTAL, _EVERY = 12, 2
_KILLS = [(1, 3, "backward"), (0, 5, "allreduce")]  # (rank, step, phase), attempts 0, 1
_SAVE_KILL = (0, 7, "save")  # attempt 2: rank 0 dies writing the checkpoint of step 8
_TERM = (1, 8, "forward")  # attempt 3: SIGTERM to the agent; the ranks stop after step 8
_FAULTS = ";".join([f"rank={r},step={s},phase={p},attempt={a}" for a, (r, s, p) in enumerate(_KILLS + [_SAVE_KILL])]
                   + [f"rank={_TERM[0]},step={_TERM[1]},phase={_TERM[2]},attempt={len(_KILLS) + 1},action=term"])
_MAX_RESTARTS = len(_KILLS) + 1


def _error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _raise(where: str, error: dict) -> None:
    """An exception caught elsewhere, raised again here (a TODO stays TODO)."""
    if error["error"] == "NotImplementedError" and error["message"].startswith("TODO"):
        raise NotImplementedError(error["message"])
    pytest.fail(f"{where} raised {error['error']}: {error['message']}\n{error.get('traceback', '')}")


def _param_problems(actual: dict, expected: dict, what: str) -> list[str]:
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"{what}: parameter {name} missing")
        elif not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
            problems.append(f"{what}: parameter {name} differs from the uninterrupted run (max abs diff {diff:.3g}; "
                            "bitwise equality expected)")
    return problems


# ---------------------------------------------------------------- in this process: resume, SIGTERM


def _net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _local_run(mod, folder, total_steps: int, every: int = 2, term_at: int | None = None, seed: int = 11,
               send: dict[int, int] | None = None, ran: list | None = None, schedule: dict | None = None,
               **run_kwargs):
    """A fresh process's view: new model and optimizer, run_resumable on `folder`. Returns
    (outcome, steps train_step ran, parameters). term_at: SIGTERM to this process in the
    middle of that step (after the forward drew its dropout mask, before the update);
    send: {step: signal} the same for other signals. ran: the list the steps are appended
    to (default a new one); schedule: a dict, to train with an LR scheduler (StepLR) and a
    GradScaler too, both given to run_resumable; the dict receives their state at the end.
    run_kwargs go to run_resumable."""
    from solutions.phase4_production.checkpoint import CheckpointManager

    send = {**(send or {}), **({term_at: signal.SIGTERM} if term_at is not None else {})}
    torch.manual_seed(seed)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ran = [] if ran is None else ran
    scheduler = scaler = None
    if schedule is not None:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)  # its scale doubles every 2 steps
        run_kwargs.update(scheduler=scheduler, scaler=scaler)

    def train_step(ctx) -> None:
        ran.append(ctx.step)
        gen = torch.Generator().manual_seed(500 + ctx.step)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        ctx.phase("forward")
        loss = F.cross_entropy(model(x), y)
        if ctx.step in send:
            os.kill(os.getpid(), send[ctx.step])
        ctx.phase("backward")
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

    outcome = mod.run_resumable(train_step, model, optimizer, CheckpointManager(folder, keep=3),
                                total_steps=total_steps, every=every, **run_kwargs)
    if schedule is not None:
        schedule.update(lr=optimizer.param_groups[0]["lr"], scheduler=scheduler.state_dict(),
                        scaler=scaler.state_dict())
    return outcome, ran, {k: v.detach().clone() for k, v in model.named_parameters()}


class _TermReachedTest(Exception):
    """SIGTERM reached the test's own handler: run_resumable had not installed one."""


def _test_handler(signum, frame):
    raise _TermReachedTest()


def test_4_2_resumes_from_newest_valid_checkpoint(grade, tmp_path):
    """The same call starts a run, resumes it from the newest checkpoint that verifies (a
    torn newest one is skipped), and does nothing for a finished run; the resumed run
    ends bitwise equal to one never interrupted."""
    mod = grade("4.2").load()
    _, _, want = _local_run(mod, tmp_path / "straight", total_steps=8)
    problems = []
    first, ran, _ = _local_run(mod, tmp_path / "run", total_steps=6)  # checkpoints 2, 4, 6
    if (first.start_step, ran) != (0, list(range(6))):
        problems.append(f"fresh start on an empty folder: started at step {first.start_step} and ran {ran}, "
                        "expected to start at 0 and run steps 0..5")
    second, ran, params = _local_run(mod, tmp_path / "run", total_steps=8)
    if (second.start_step, ran) != (6, [6, 7]):
        problems.append(f"relaunch with checkpoints of steps 2, 4, 6 on disk: started at {second.start_step} and ran "
                        f"{ran}, expected to start at 6 (the newest) and run steps 6, 7")
    problems += _param_problems(params, want, "after resuming at step 6")
    third, ran, _ = _local_run(mod, tmp_path / "run", total_steps=8)
    if ran:
        problems.append(f"relaunch of a finished run (checkpoint of step 8 on disk) ran steps {ran}, expected none")
    # A torn newest file: the resume must use the one before it.
    torn = tmp_path / "torn"
    _local_run(mod, torn, total_steps=6)
    newest = max(p for p in torn.iterdir() if p.name.startswith("step_"))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fourth, ran, params = _local_run(mod, torn, total_steps=8)
    if (fourth.start_step, ran) != (4, [4, 5, 6, 7]):
        problems.append(f"relaunch with checkpoints 2, 4 and a truncated 6: started at {fourth.start_step} and ran "
                        f"{ran}, expected to skip the torn file, start at 4 and run steps 4..7")
    problems += _param_problems(params, want, "after resuming at step 4 (newest file torn)")
    assert_no_problems(problems, "resume on start (run_resumable, one process, checkpoint every 2 steps):")


def test_4_2_corrupt_checkpoints_do_not_prune_new_ones(grade, tmp_path):
    """Every checkpoint on disk is corrupt and newer than anything the new run saves: keep-last-k must not
    count them (they would push each new checkpoint out as soon as it is written), and they are kept."""
    mod = grade("4.2").load()
    from solutions.phase4_production.checkpoint import CheckpointManager

    _, _, want = _local_run(mod, tmp_path / "straight", total_steps=6)
    folder = tmp_path / "run"
    _local_run(mod, folder, total_steps=20, every=5)  # keep=3: steps 10, 15, 20
    stale = sorted(p for p in folder.iterdir() if p.name.startswith("step_"))
    contents = []
    for path in stale:
        contents.append(path.read_bytes()[: path.stat().st_size // 2])
        path.write_bytes(contents[-1])  # torn
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, ran, _ = _local_run(mod, folder, total_steps=4)
        if (first.start_step, ran) != (0, [0, 1, 2, 3]):
            problems.append(f"with steps 10, 15, 20 on disk, all torn: started at {first.start_step} and ran {ran}, "
                            "expected a fresh start running steps 0..3")
        left = CheckpointManager(folder, keep=3).steps()
        second, ran, params = _local_run(mod, folder, total_steps=6)
    if (second.start_step, ran) != (4, [4, 5]):
        problems.append(f"then a relaunch to 6 steps started at {second.start_step} and ran {ran}, expected to resume "
                        f"at step 4, the checkpoint the first run saved at its end (checkpoint steps after the "
                        f"first run: {left}; keep=3 ranks files by step, so three corrupt files above every new "
                        "step push each new checkpoint out as soon as it is written)")
    else:
        problems += _param_problems(params, want, "after resuming at step 4")
    kept = {p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    lost = [path.name for path, data in zip(stale, contents) if data not in kept]
    if lost:
        problems.append(f"the corrupt {', '.join(lost)} are gone from the folder: set them aside (rename them out of "
                        "the checkpoint names), do not delete them; someone will want to know what broke them")
    # set_aside_newer on its own: resumed step 4 of steps 2, 4, 6 (6 failed): 6 stops counting.
    direct = tmp_path / "direct"
    _local_run(mod, direct, total_steps=6)
    manager = CheckpointManager(direct, keep=3)
    mod.set_aside_newer(manager, 4)
    if manager.steps() != [2, 4]:
        problems.append(f"set_aside_newer(checkpoints, 4) with steps 2, 4, 6 left steps() = {manager.steps()}, "
                        "expected [2, 4]")
    assert_no_problems(problems, "resume when every checkpoint on disk is corrupt (run_resumable, one process, keep=3, "
                                 "a checkpoint every 2 steps; old torn checkpoints of steps 10, 15 and 20):")


def test_4_2_sigterm_saves_at_next_step_boundary(grade, tmp_path):
    """SIGTERM in the middle of step 3 (dropout already drawn, update not yet done): the
    run finishes step 3, saves the checkpoint of step 4, returns preempted, puts the
    previous SIGTERM handler back; a relaunch resumes there and ends bitwise equal."""
    mod = grade("4.2").load()
    _, _, want = _local_run(mod, tmp_path / "straight", total_steps=8, every=100)
    problems = []
    previous = signal.signal(signal.SIGTERM, _test_handler)
    try:
        outcome, ran, _ = _local_run(mod, tmp_path / "run", total_steps=8, every=100, term_at=3)
    except _TermReachedTest:
        pytest.fail("SIGTERM in step 3 reached the handler installed before run_resumable: run_resumable did "
                    "not install its own (a preemption would kill the worker without a checkpoint)")
    except SystemExit as exc:
        outcome = None
        problems.append(f"SIGTERM in the middle of step 3 ended the process from inside the signal handler "
                        f"(SystemExit({exc.code})); expected to finish step 3, save at the boundary, and return "
                        "preempted=True")
    finally:
        after = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    if after is not _test_handler:
        problems.append(f"the SIGTERM handler after run_resumable returned is {after!r}, not the one installed "
                        "before it: restore the previous handler")
    if outcome is not None and (not outcome.preempted or outcome.steps_done != 4 or ran != [0, 1, 2, 3]):
        problems.append(f"SIGTERM during step 3: ran steps {ran}, returned preempted={outcome.preempted} after "
                        f"{outcome.steps_done} steps; expected to finish step 3 and stop: steps 0..3, "
                        "preempted=True, steps_done=4")
    from solutions.phase4_production.checkpoint import CheckpointManager

    saved = CheckpointManager(tmp_path / "run").steps()
    if saved != [4]:
        problems.append(f"checkpoints on disk after the SIGTERM: steps {saved}; expected exactly the step-boundary "
                        "one, step 4 (saving every 100 steps)")
    resumed, ran, params = _local_run(mod, tmp_path / "run", total_steps=8, every=100)
    if (resumed.start_step, ran) != (4, [4, 5, 6, 7]):
        problems.append(f"relaunch after the SIGTERM: started at {resumed.start_step} and ran {ran}; expected "
                        "steps 4..7")
    problems += _param_problems(params, want, "after the SIGTERM and a relaunch")
    assert_no_problems(problems, "preemption (SIGTERM to this process in the middle of step 3 of 8):")


class _Recorder:
    """A signal handler that records the signals reaching it: the handler the program had before."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.got.append(signum)


def _names(signals) -> str:
    return ", ".join(signal.Signals(sig).name for sig in signals) or "none"


def test_4_2_preemption_handler_takes_the_signals_it_is_given(grade, tmp_path):
    """signals=(SIGUSR1, SIGUSR2) (a scheduler told to warn with SIGUSR1, as SLURM's
    `--signal=USR1@120`): each of them requests the stop, and SIGTERM, not in the list, is
    left to the handler it had; the same through run_resumable(signals=...)."""
    mod = grade("4.2").load()
    ours = (signal.SIGUSR1, signal.SIGUSR2)
    before = _Recorder()
    previous = {sig: signal.signal(sig, before) for sig in (signal.SIGTERM, *ours)}
    problems = []
    try:
        for sig in ours:
            before.got.clear()
            with mod.PreemptionHandler(signals=ours) as handler:
                replaced = [s for s in (signal.SIGTERM,) if signal.getsignal(s) is not before]
                if replaced:
                    problems.append(f"inside PreemptionHandler(signals=({_names(ours)})) the handler of "
                                    f"{_names(replaced)} was replaced: only the given signals are handled")
                kept = [s for s in ours if signal.getsignal(s) is before]
                if kept:
                    problems.append(f"inside PreemptionHandler(signals=({_names(ours)})) {_names(kept)} still "
                                    "had the previous handler: each given signal gets the handler")
                os.kill(os.getpid(), signal.SIGTERM)
                if before.got != [signal.SIGTERM] or handler.requested:
                    problems.append(f"SIGTERM (not among signals=({_names(ours)})): the previous handler got "
                                    f"{_names(before.got)}, requested={handler.requested}; expected the previous "
                                    "handler to get it and no stop requested")
                before.got.clear()
                os.kill(os.getpid(), sig)
                stop = handler.should_stop()
                if before.got or not handler.requested or not stop:
                    problems.append(f"{signal.Signals(sig).name} (in signals=({_names(ours)})): requested="
                                    f"{handler.requested}, should_stop()={stop}, the previous handler got "
                                    f"{_names(before.got)}; expected a stop request and nothing for the previous "
                                    "handler")
            restored = [s for s in (signal.SIGTERM, *ours) if signal.getsignal(s) is not before]
            if restored:
                problems.append(f"after leaving the PreemptionHandler, {_names(restored)} did not have the "
                                "previous handler back")
        before.got.clear()
        outcome, ran, _ = _local_run(mod, tmp_path / "usr2", total_steps=6, every=100, send={2: signal.SIGUSR2},
                                     signals=ours)
        if (outcome.preempted, outcome.steps_done, ran) != (True, 3, [0, 1, 2]) or before.got:
            problems.append(f"run_resumable(signals=({_names(ours)})), SIGUSR2 in step 2: ran {ran}, preempted="
                            f"{outcome.preempted}, steps_done={outcome.steps_done}; expected to stop after step 2 "
                            "(steps 0..2, preempted=True, steps_done=3)")
        outcome, ran, _ = _local_run(mod, tmp_path / "term", total_steps=4, every=100, send={1: signal.SIGTERM},
                                     signals=ours)
        if (outcome.preempted, outcome.steps_done) != (False, 4) or before.got != [signal.SIGTERM]:
            problems.append(f"run_resumable(signals=({_names(ours)})), SIGTERM in step 1: preempted="
                            f"{outcome.preempted} after {outcome.steps_done} steps, the previous handler got "
                            f"{_names(before.got)}; expected the run to go on to its end (4 steps) and SIGTERM to "
                            "reach the previous handler")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert_no_problems(problems, "PreemptionHandler and run_resumable with signals=(SIGUSR1, SIGUSR2):")


def test_4_2_extra_progress_and_on_resume(grade, tmp_path):
    """Each checkpoint's progress is {"step": steps done, **extra_progress()}; after loading
    one, run_resumable calls on_resume(progress) with it, before the first step (e.g. to put
    a sampler back at its position); a fresh start loads nothing and calls no on_resume."""
    mod = grade("4.2").load()
    folder = tmp_path / "run"
    calls: list[tuple[dict, int]] = []

    def launch(total_steps: int) -> list[int]:
        ran: list[int] = []

        def extra_progress() -> dict:  # where the data is: what a sampler's state_dict would say
            return {"data": {"samples_seen": 8 * (ran[-1] + 1) if ran else 0}, "note": "extra"}

        def on_resume(progress) -> None:  # (what it got, how many steps this launch had run by then)
            calls.append((copy.deepcopy(dict(progress)), len(ran)))

        _local_run(mod, folder, total_steps=total_steps, every=2, ran=ran, extra_progress=extra_progress,
                   on_resume=on_resume)
        return ran

    problems = []
    launches = [(4, None), (6, 4), (8, 6)]  # (total_steps, the step it resumes from)
    for total_steps, resumed in launches:
        calls.clear()
        ran = launch(total_steps)
        what = f"launch to {total_steps} steps" + (f" (checkpoint of step {resumed} on disk)" if resumed else
                                                     " on an empty folder")
        if resumed is None:
            if calls:
                problems.append(f"{what}: on_resume was called with {calls[0][0]}; nothing was loaded, so it is "
                                "not called")
            continue
        want = {"step": resumed, "data": {"samples_seen": 8 * resumed}, "note": "extra"}
        if len(calls) != 1:
            problems.append(f"{what}: on_resume was called {len(calls)} times, expected once (after loading the "
                            "checkpoint)")
        if calls:
            got, steps_before = calls[0]
            wrong = {k: got.get(k, "<missing>") for k, v in want.items() if got.get(k, "<missing>") != v}
            if wrong:
                problems.append(f"{what}: on_resume got {got}; expected it to hold {want} (the step and what "
                                f"extra_progress() returned when the checkpoint was saved); differs in {wrong}")
            if steps_before:
                problems.append(f"{what}: on_resume was called after {steps_before} step(s) of this launch had run; "
                                "call it after loading, before the first step")
        if ran != list(range(resumed, total_steps)):
            problems.append(f"{what}: ran steps {ran}, expected {list(range(resumed, total_steps))}")
    assert_no_problems(problems, "extra_progress and on_resume (run_resumable, one process, a checkpoint every 2 "
                                 "steps, extra_progress() = {'data': {'samples_seen': 8 * steps done}, 'note': "
                                 "'extra'}):")


def test_4_2_scheduler_and_scaler_resume_with_the_run(grade, tmp_path):
    """run_resumable(scheduler=..., scaler=...): each checkpoint holds their state and a relaunch resumes it, so a
    run stopped after 5 steps (StepLR halving the LR every 3 steps; a GradScaler doubling its scale every 2
    steps, its growth counter half-way at step 5) and relaunched to 8 ends bitwise as one never stopped, with
    the same learning rate, scale and growth counter."""
    mod = grade("4.2").load()
    straight: dict = {}
    _, _, want = _local_run(mod, tmp_path / "straight", total_steps=8, schedule=straight)
    first: dict = {}
    _local_run(mod, tmp_path / "run", total_steps=5, schedule=first)  # checkpoints of steps 2, 4 and 5
    resumed: dict = {}
    outcome, ran, params = _local_run(mod, tmp_path / "run", total_steps=8, schedule=resumed)
    problems = []
    if (outcome.start_step, ran) != (5, [5, 6, 7]):
        problems.append(f"relaunch to 8 steps (checkpoint of step 5 on disk): started at {outcome.start_step} and ran "
                        f"{ran}, expected to start at 5 and run steps 5, 6, 7")
    for what in ("lr", "scheduler", "scaler"):
        if resumed.get(what) != straight.get(what):
            problems.append(f"after the relaunch, the {what} state is {resumed.get(what)}; the run never stopped has "
                            f"{straight.get(what)} (was the {what} given to resume and saved in each checkpoint?)")
    problems += _param_problems(params, want, "after resuming at step 5 with an LR scheduler and a GradScaler")
    assert_no_problems(problems, "run_resumable with scheduler= and scaler= (one process, a checkpoint every 2 steps "
                                 "and after the last):")


# ---------------------------------------------------------------- one world of 2 ranks


def _agreement_case(mod, folder: str) -> dict:
    """should_stop on both ranks after rank 0 alone got SIGTERM (from itself); then the loop,
    with SIGTERM reaching rank 0 in step 3 and rank 1 in step 4 (signals reach ranks at
    different moments): both must stop after step 3, with a checkpoint of step 4. (A
    rank-local decision stops rank 0 after step 3 and rank 1 after step 4: each saves,
    so their collectives still pair up and the world reports instead of hanging.)"""
    from solutions.phase4_production.checkpoint import CheckpointManager

    rank, out = dist.get_rank(), {}
    previous = signal.signal(signal.SIGTERM, _test_handler)
    try:
        try:
            with mod.PreemptionHandler() as preemption:
                first = preemption.should_stop()
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                out["should_stop"] = (first, preemption.should_stop())
            out["handler_restored"] = signal.getsignal(signal.SIGTERM) is _test_handler
        except Exception as exc:  # noqa: BLE001
            out["should_stop"] = _error(exc)
        torch.manual_seed(rank)
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ran = []

        def train_step(ctx) -> None:  # no collective in the step: a rank that runs ahead does not hang
            ran.append(ctx.step)
            if ctx.step == 3 + rank:
                os.kill(os.getpid(), signal.SIGTERM)
            loss = model(torch.randn(4, 6)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        try:
            outcome = mod.run_resumable(train_step, model, optimizer, CheckpointManager(folder), total_steps=6,
                                        every=100)
            out["loop"] = {"ran": ran, "preempted": outcome.preempted, "steps_done": outcome.steps_done}
        except Exception as exc:  # noqa: BLE001
            out["loop"] = _error(exc)
        dist.barrier()
        out["saved"] = CheckpointManager(folder).steps()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return out


# SIGTERM reaches ONE rank only: (name, the rank, when). "step": in the middle of its step 2;
# "boundary": after its step 2, once it sits in the step boundary's agreement waiting for the
# other rank, which is held in its own step 2 until the signal is sent.
_ONE_RANK_CASES = (("rank 1 only, in the middle of its step 2", 1, "step"),
                   ("rank 1 only, while it waits at the boundary after step 2", 1, "boundary"),
                   ("rank 0 only, while it waits at the boundary after step 2", 0, "boundary"))
_WATCH_POLLS, _WATCH_POLL_S, _WATCH_DEADLINE_S = 25, 0.002, 60.0
_CASE_GROUP_TIMEOUT_S = 20.0  # a collective that waits this long waits for a rank that is elsewhere


class _MainThreadWatch:
    """In a rank: tell, from another thread, when the main thread has finished (`done`, set
    by the main thread) or is waiting: at the same instruction of the same frame for
    _WATCH_POLLS polls in a row (a collective, or any wait, for the other rank). A gate,
    not a clock: how fast the machine is changes how long it takes, never what is seen."""

    def __init__(self) -> None:
        self.ident = threading.main_thread().ident
        self.done = threading.Event()

    def settled(self) -> str:
        last, same = None, 0
        deadline = time.monotonic() + _WATCH_DEADLINE_S
        while time.monotonic() < deadline:
            if self.done.is_set():
                return "done"
            frame = sys._current_frames().get(self.ident)
            where = (id(frame), frame.f_lasti) if frame is not None else None
            same = same + 1 if where == last else 0
            last = where
            if same >= _WATCH_POLLS:
                return "waiting"
            time.sleep(_WATCH_POLL_S)
        return "deadline"


def _store_client():
    return dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=_WATCH_DEADLINE_S))


def _one_rank_case(mod, folder: str, key: str, signalled: int, moment: str) -> dict:
    """run_resumable on both ranks, SIGTERM to rank `signalled` only (see _ONE_RANK_CASES).
    Rank 0 (the writer) holds each save until rank 1 has returned from run_resumable or
    sits waiting: a rank that reports the stop before the checkpoint is on disk is then
    seen doing so (it lists the folder as soon as run_resumable returns)."""
    from solutions.phase4_production.checkpoint import CheckpointManager

    rank, store = dist.get_rank(), _store_client()
    watch, step_2_done = _MainThreadWatch(), threading.Event()
    threads = []
    if rank == signalled and moment == "boundary":
        def send() -> None:  # SIGTERM once this rank sits at the boundary after step 2
            if step_2_done.wait(_WATCH_DEADLINE_S) and watch.settled() == "waiting":
                os.kill(os.getpid(), signal.SIGTERM)
            _store_client().set(f"{key}/sent", "1")
        threads.append(threading.Thread(target=send, daemon=True))
    if rank == 1:
        def settle() -> None:  # answers each of rank 0's saves once rank 1 is done or waiting
            client, n = _store_client(), 1
            deadline = time.monotonic() + 2 * _WATCH_DEADLINE_S
            while not client.check([f"{key}/end"]) and time.monotonic() < deadline:  # rank 0 has returned
                if client.check([f"{key}/saving/{n}"]):
                    client.set(f"{key}/settled/{n}", watch.settled())
                    n += 1
                else:
                    time.sleep(_WATCH_POLL_S)
        threads.append(threading.Thread(target=settle, daemon=True))

    class GatedCheckpoints(CheckpointManager):
        saves = 0

        def save(self, step, state):
            if rank == 0:
                GatedCheckpoints.saves += 1
                store.set(f"{key}/saving/{self.saves}", str(step))
                store.wait([f"{key}/settled/{self.saves}"])
            return super().save(step, state)

    torch.manual_seed(rank)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []

    def train_step(ctx) -> None:  # no collective in the step
        ran.append(ctx.step)
        if ctx.step == 2 and moment == "step" and rank == signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = model(torch.randn(4, 6)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ctx.step == 2 and moment == "boundary":
            if rank == signalled:
                step_2_done.set()
            else:
                store.wait([f"{key}/sent"])  # held until the other rank got its signal

    for thread in threads:
        thread.start()
    try:
        outcome = mod.run_resumable(train_step, model, optimizer, GatedCheckpoints(folder), total_steps=8,
                                    every=100)
        seen = CheckpointManager(folder).steps()  # at once: what this rank sees when it reports
        out = {"ran": ran, "preempted": outcome.preempted, "steps_done": outcome.steps_done, "seen": seen}
    except Exception as exc:  # noqa: BLE001
        out = {**_error(exc), "ran": ran}
    finally:
        watch.done.set()
        step_2_done.set()
        if rank == 0:
            store.set(f"{key}/end", "1")
    for thread in threads:
        thread.join(_WATCH_DEADLINE_S)
    store.set(f"{key}/returned/{rank}", "1")
    store.wait([f"{key}/returned/{1 - rank}"])
    out["saved"] = CheckpointManager(folder).steps()
    return out


def _one_rank_world(ref: grading.ModuleRef, folder: str) -> dict:
    """The cases of _ONE_RANK_CASES, each in a process group of its own (a gloo group with a
    short timeout): a wrong stop decision makes the ranks issue different collectives, and
    that case then ends in a timeout error instead of leaving the next case waiting. Cases
    are separated through the store, not a collective."""
    try:
        mod = ref.load()
    except Exception as exc:  # noqa: BLE001
        return {"load": _error(exc)}
    rank, store, out = dist.get_rank(), _store_client(), {}
    previous = signal.signal(signal.SIGTERM, _test_handler)
    try:
        for index, (name, signalled, moment) in enumerate(_ONE_RANK_CASES):
            key = f"one-rank-{index}"
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore(key, store), rank=rank, world_size=2,
                                    timeout=timedelta(seconds=_CASE_GROUP_TIMEOUT_S))
            out[name] = _one_rank_case(mod, os.path.join(folder, f"case{index}"), key, signalled, moment)
            store.set(f"{key}/finished/{rank}", "1")
            store.wait([f"{key}/finished/{1 - rank}"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return out


def _one_rank_results(ref, tmp_path_factory) -> list[dict]:
    """The world of one-rank cases for `ref` (one world serves every test that needs one)."""
    return _cached_world(_one_rank_world, ref, tmp_path_factory, "recovery-one-rank")


def _attempts_case(mod, folder: str) -> dict:
    """Three attempts in one process, each with a process group of its own: world 2 (as
    launched), world 1 (rank 0 alone), world 2 with the ranks swapped. Records what the
    graded code tells the step about rank and world, and what the group says."""
    from solutions.phase4_production.checkpoint import CheckpointManager

    launched_rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False)
    out = {}
    for name, total, rank, world in (("world 2 as launched", 2, launched_rank, 2),
                                     ("world 1 (rank 0 alone)", 3, 0 if launched_rank == 0 else None, 1),
                                     ("world 2, ranks swapped", 4, 1 - launched_rank, 2)):
        if name == "world 2, ranks swapped":
            # Only if the world-1 attempt went right: ranks that disagree on who they are
            # would resume from different steps and wait for each other forever.
            if launched_rank == 0:
                store.set("recovery-attempts-go-on", "1" if _attempt_ok(out.get("world 1 (rank 0 alone)")) else "0")
            if store.get("recovery-attempts-go-on") != b"1":
                break
        if name != "world 2 as launched":
            if dist.is_initialized():
                dist.destroy_process_group()
            if rank is None:
                continue  # this process sits the attempt out
            group_store = dist.HashStore() if world == 1 else dist.PrefixStore(f"recovery-{name}", store)
            dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world)
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []

        def train_step(ctx) -> None:
            seen.append((ctx.attempt.rank, ctx.attempt.world_size))
            model(torch.randn(2, 6)).sum().backward()
            optimizer.step()

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # resuming at another world size warns about RNG streams
                outcome = mod.run_resumable(train_step, model, optimizer, CheckpointManager(folder), total_steps=total,
                                            every=1)
            out[name] = {"group": (dist.get_rank(), dist.get_world_size()), "seen": seen,
                         "outcome": (outcome.attempt.rank, outcome.attempt.world_size), "start": outcome.start_step}
        except Exception as exc:  # noqa: BLE001
            out[name] = _error(exc)
    return out


def _attempt_ok(got: dict | None) -> bool:
    return (got is not None and "error" not in got and tuple(got["outcome"]) == tuple(got["group"])
            and all(tuple(seen) == tuple(got["group"]) for seen in got["seen"]))


def _plain_reference(total_steps: int) -> dict:
    """The uninterrupted run: worker.build/batch in a plain loop (no checkpoint, no graded code)."""
    torch.manual_seed(1234 + dist.get_rank())
    model, optimizer = worker.build()
    for step in range(total_steps):
        x, y = worker.batch(step, dist.get_rank(), dist.get_world_size())
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.module.named_parameters()}


_VIEW_STEPS = {0: (2, 4), 1: (2, 4, 6)}  # rank -> the checkpoints its folder listing shows


def _views_case(mod, folder: str) -> dict:
    """Rank 1's listing shows a checkpoint (step 6) that rank 0's does not (a shared file
    system's stale listing, simulated by one folder per rank with the same files): resume
    must load, on every rank, the step rank 0 found."""
    from solutions.phase4_production.checkpoint import CheckpointManager, atomic_save, training_state

    rank = dist.get_rank()
    manager = CheckpointManager(os.path.join(folder, f"rank{rank}"))
    manager.folder.mkdir(parents=True, exist_ok=True)
    weights = {}
    for step in _VIEW_STEPS[1]:
        model = _net()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(step)  # each step's weights its own
        state = training_state(model, torch.optim.SGD(model.parameters(), lr=0.1), progress={"step": step})
        weights[step] = {k: v.detach().clone() for k, v in model.named_parameters()}
        if step in _VIEW_STEPS[rank]:
            atomic_save(state, manager.path_for(step))
    dist.barrier()
    model = _net()
    try:
        progress = mod.resume(manager, model, torch.optim.SGD(model.parameters(), lr=0.1))
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    got = {k: v.detach() for k, v in model.named_parameters()}
    loaded = next((step for step, w in weights.items() if all(torch.equal(got[k], w[k]) for k in w)), None)
    return {"step": None if progress is None else progress.get("step"), "weights_of": loaded}


_ASIDE_STEPS, _ASIDE_RESUMED = (2, 4, 6), 4


def _set_aside_case(mod, folder: str) -> dict:
    """Each rank lists its own folder holding the checkpoints of _ASIDE_STEPS (as in _views_case: one folder
    seen by each rank); every rank calls set_aside_newer(checkpoints, _ASIDE_RESUMED): only rank 0 renames."""
    from solutions.phase4_production.checkpoint import CheckpointManager, atomic_save

    manager = CheckpointManager(os.path.join(folder, f"rank{dist.get_rank()}"), keep=5)
    manager.folder.mkdir(parents=True, exist_ok=True)
    for step in _ASIDE_STEPS:
        atomic_save({"step": step}, manager.path_for(step))
    try:
        moved = mod.set_aside_newer(manager, _ASIDE_RESUMED)
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    return {"returned": [Path(p).name for p in moved], "files": sorted(p.name for p in manager.folder.iterdir())}


def _world_cases(ref: grading.ModuleRef, folder: str) -> dict:
    out = {"reference": _plain_reference(_TOTAL)}
    try:
        mod = ref.load()
    except Exception as exc:  # noqa: BLE001
        return {**out, "load": _error(exc)}
    out["agreement"] = _agreement_case(mod, os.path.join(folder, "agree"))
    dist.barrier()
    out["views"] = _views_case(mod, os.path.join(folder, "views"))
    dist.barrier()
    out["set_aside"] = _set_aside_case(mod, os.path.join(folder, "aside"))
    dist.barrier()
    out["attempts"] = _attempts_case(mod, os.path.join(folder, "attempts"))  # last: it rebuilds the group
    return out


_worlds: dict = {}


def _cached_world(cases, ref, tmp_path_factory, folder: str) -> list[dict]:
    """run_world(cases, 2) for `ref`, once per (cases, ref): every test that needs it reports
    its failure, a TODO as a TODO, a graded module that did not load as that rank's error."""
    key = (cases.__name__, ref)
    if key not in _worlds:
        try:
            _worlds[key] = run_world(cases, 2, args=(ref, str(tmp_path_factory.mktemp(folder))))
        except Exception as exc:  # noqa: BLE001 - every test that needs the world reports it
            _worlds[key] = exc
    if isinstance(_worlds[key], BaseException):
        todo = grading.todo_of(_worlds[key])
        if todo:
            raise NotImplementedError(todo)
        raise _worlds[key]
    for rank, result in enumerate(_worlds[key]):
        if "load" in result:
            _raise(f"rank {rank} loading the graded module", result["load"])
    return _worlds[key]


def _world(ref, tmp_path_factory) -> list[dict]:
    """The 2-rank world's results for `ref` (one world serves every test that needs one)."""
    return _cached_world(_world_cases, ref, tmp_path_factory, "recovery-world")


def test_4_2_ranks_agree_to_stop_on_sigterm(grade, tmp_path_factory):
    """Signals reach ranks at different moments. SIGTERM to rank 0 only: should_stop answers
    True on BOTH ranks. SIGTERM to rank 0 in step 3 and to rank 1 in step 4: the loop stops
    both after step 3, with one checkpoint at that boundary."""
    results = _world(grade("4.2"), tmp_path_factory)
    problems = []
    for rank, result in enumerate(results):
        got = result["agreement"]
        if "error" in got["should_stop"]:
            _raise(f"rank {rank}, PreemptionHandler", got["should_stop"])
        if got["should_stop"] != (False, True):
            problems.append(f"rank {rank}: should_stop() gave {got['should_stop'][0]} before and "
                            f"{got['should_stop'][1]} after rank 0 (only) received SIGTERM; expected False, then "
                            "True on every rank (the ranks must agree: a tiny all-reduce of the flag)")
        if not got.get("handler_restored"):
            problems.append(f"rank {rank}: leaving the PreemptionHandler did not put the previous SIGTERM handler back")
    for rank, result in enumerate(results):
        loop = result["agreement"]["loop"]
        if "error" in loop:
            _raise(f"rank {rank}, run_resumable", loop)
        if (loop["ran"], loop["preempted"], loop["steps_done"]) != ([0, 1, 2, 3], True, 4):
            problems.append(f"rank {rank}: ran steps {loop['ran']}, preempted={loop['preempted']}, stopped after "
                            f"{loop['steps_done']} steps; expected both ranks to stop after step 3 (SIGTERM reached "
                            "rank 0 in step 3, rank 1 in step 4), preempted=True, steps_done=4")
    saved = results[0]["agreement"]["saved"]
    if saved != [4]:
        problems.append(f"checkpoints on disk: steps {saved}; expected only the step-boundary one, step 4")
    assert_no_problems(problems, "SIGTERM to rank 0 (and a step later to rank 1), 2 ranks, 6 steps (checkpoint every 100):")


def test_4_2_one_rank_signalled_all_stop_at_one_boundary(grade, tmp_path_factory):
    """SIGTERM to ONE rank only (rank 1, then rank 0), in the middle of a step or while it
    waits at a step boundary for the other: every rank stops at the same boundary, the one
    after the signal or the next, reports preempted=True with the same steps_done, and the
    checkpoint of that step is on disk before ANY rank reports the stop (rank 0 holds its
    save until rank 1 has returned or waits for it)."""
    results = _one_rank_results(grade("4.2"), tmp_path_factory)
    problems = []
    for name, _, moment in _ONE_RANK_CASES:
        got = [result[name] for result in results]
        failed = [(rank, r) for rank, r in enumerate(got) if "error" in r]
        for rank, r in failed:
            if r["error"] == "NotImplementedError" and r["message"].startswith("TODO"):
                raise NotImplementedError(r["message"])
            problems.append(f"SIGTERM to {name}: rank {rank}'s run_resumable raised {r['error']}: "
                            f"{r['message'].splitlines()[0][:200] if r['message'] else ''} after running steps "
                            f"{r['ran']}" + "".join(f"; rank {other} ran {o['ran']} and returned preempted="
                                                    f"{o['preempted']} after {o['steps_done']} steps"
                                                    for other, o in enumerate(got) if "error" not in o)
                            + " (a rank left in a collective the other never entered: they decided differently)")
        if failed:
            continue
        allowed = (3,) if moment == "step" else (3, 4)
        done = [r["steps_done"] for r in got]
        for rank, r in enumerate(got):
            if not r["preempted"] or r["steps_done"] not in allowed or r["ran"] != list(range(r["steps_done"])):
                problems.append(f"SIGTERM to {name}: rank {rank} ran steps {r['ran']}, preempted={r['preempted']}, "
                                f"steps_done={r['steps_done']}; expected to stop at the boundary after step "
                                + ("2 (steps_done=3)" if moment == "step" else
                                   "2 or 3 (the signal may land after this boundary's agreement)")
                                + ", preempted=True, whether or not this rank got the signal")
        if len(set(done)) > 1:
            problems.append(f"SIGTERM to {name}: the ranks stopped after different numbers of steps {done}; the "
                            "decision to stop must be the same on every rank at the same boundary")
            continue
        stop = done[0]
        if got[0]["saved"] != [stop]:
            problems.append(f"SIGTERM to {name}: checkpoints on disk after the stop: {got[0]['saved']}; expected "
                            f"exactly the one of the stop, step {stop}")
        for rank, r in enumerate(got):
            if r["preempted"] and stop not in r["seen"]:
                problems.append(f"SIGTERM to {name}: rank {rank} returned preempted=True after {stop} steps while "
                                f"the checkpoint of step {stop} was not on disk yet (it saw {r['seen']}); the "
                                "writer's save must be complete before any rank reports the stop (a barrier after "
                                "the save)")
    assert_no_problems(problems, "SIGTERM reaching one rank only (2 ranks, 8 steps, a checkpoint every 100):")


def test_4_2_every_rank_resumes_the_step_rank_0_found(grade, tmp_path_factory):
    results = _world(grade("4.2"), tmp_path_factory)
    problems = []
    want = max(_VIEW_STEPS[0])
    for rank, result in enumerate(results):
        got = result["views"]
        if "error" in got:
            _raise(f"rank {rank}, resume", got)
        if got["step"] != want or got["weights_of"] != want:
            problems.append(f"rank {rank} (its listing: steps {list(_VIEW_STEPS[rank])}): resume returned step "
                            f"{got['step']}, with the weights of step {got['weights_of']}; expected step {want}, "
                            "the newest rank 0 found")
    assert_no_problems(problems, "the ranks' folder listings differ (rank 1 sees a step 6 that rank 0 does not): "
                                 "every rank must resume the SAME step, the one rank 0 chose (its choice broadcast):")


def test_4_2_only_rank_0_sets_aside(grade, tmp_path_factory):
    """set_aside_newer is rank 0's: on the other ranks it returns [] and leaves their folder listing as it was
    (on a shared file system rank 0's renames are the only ones; a second rank renaming the same files races it)."""
    results, suffix = _world(grade("4.2"), tmp_path_factory), grade("4.2").load().CORRUPT_SUFFIX
    problems = []
    names = [f"step_{step:09d}.pt" for step in _ASIDE_STEPS]
    for rank, result in enumerate(results):
        got = result["set_aside"]
        if "error" in got:
            _raise(f"rank {rank}, set_aside_newer", got)
        newer = [n for n, step in zip(names, _ASIDE_STEPS) if step > _ASIDE_RESUMED]
        if rank == 0:
            want = sorted([n for n in names if n not in newer] + [n + suffix for n in newer])
            if got["files"] != want or sorted(got["returned"]) != [n + suffix for n in newer]:
                problems.append(f"rank 0: returned {got['returned']}, its folder holds {got['files']}; expected "
                                f"{newer} renamed to name + CORRUPT_SUFFIX ({suffix!r}), the new names returned")
        elif got["returned"] or got["files"] != names:
            problems.append(f"rank {rank}: returned {got['returned']}, its folder holds {got['files']}; expected [] "
                            f"and its folder untouched ({names}): only rank 0 sets checkpoints aside")
    assert_no_problems(problems, f"set_aside_newer(checkpoints, {_ASIDE_RESUMED}) called on both ranks of 2, each "
                                 f"listing a folder with the checkpoints of steps {list(_ASIDE_STEPS)}:")


def test_4_2_saves_after_the_last_step(grade, tmp_path):
    from solutions.phase4_production.checkpoint import CheckpointManager

    mod = grade("4.2").load()
    problems = []
    outcome, ran, _ = _local_run(mod, tmp_path, total_steps=5, every=2)
    saved = CheckpointManager(tmp_path, keep=3).steps()
    if 5 not in saved:
        problems.append(f"run_resumable(total_steps=5, every=2) left checkpoints of steps {saved}; the docstring: "
                        "saved after every `every` steps AND after the last step (5)")
    outcome, ran, _ = _local_run(mod, tmp_path, total_steps=5, every=2)
    if ran:
        problems.append(f"the same call again on the finished run ran steps {ran}; a finished run does nothing")
    assert_no_problems(problems, "a run whose length is not a multiple of `every`:")


def test_4_2_rank_and_world_size_read_on_every_attempt(grade, tmp_path_factory):
    """Three attempts in the same processes: world 2, then world 1, then world 2 with the
    ranks swapped. What the loop hands train_step (ctx.attempt) and returns must be the
    rank and world size of the CURRENT process group, and each attempt resumes where the
    previous one stopped."""
    results = _world(grade("4.2"), tmp_path_factory)
    problems = []
    starts = {"world 2 as launched": 0, "world 1 (rank 0 alone)": 2, "world 2, ranks swapped": 3}
    for launched, result in enumerate(results):
        for name, got in result["attempts"].items():
            if "error" in got:
                _raise(f"launched rank {launched}, attempt '{name}'", got)
            group = tuple(got["group"])
            wrong = sorted({tuple(s) for s in got["seen"] if tuple(s) != group})
            if wrong:
                problems.append(f"attempt '{name}', process launched as rank {launched}: train_step was told "
                                f"(rank, world_size) = {wrong}, the process group says {group}")
            if tuple(got["outcome"]) != group:
                problems.append(f"attempt '{name}', process launched as rank {launched}: the outcome says (rank, "
                                f"world_size) = {tuple(got['outcome'])}, the process group says {group}")
            if got["start"] != starts[name]:
                problems.append(f"attempt '{name}', process launched as rank {launched}: resumed at step "
                                f"{got['start']}, expected {starts[name]} (the previous attempt's last checkpoint)")
    assert_no_problems(problems, "rank and world size are never kept from an earlier attempt:")


# ---------------------------------------------------------------- real torchrun: kills, a torn save, a preemption


def _probe(mod, tmp_path) -> None:
    """Two steps in this process: an unfinished exercise reports TODO here, before any launch."""
    _local_run(mod, tmp_path / "probe", total_steps=2)


def _launch(job_env: dict, result_dir: Path) -> tuple[str, int | None]:
    """One torchrun agent; returns (its output, its exit code); no process of it left behind."""
    return run_agent(["--standalone", "--nproc-per-node=2", f"--max-restarts={_MAX_RESTARTS}",
                      str(Path(worker.__file__))], timeout=_TORCHRUN_DEADLINE_S, env=job_env, cwd=grading.REPO_ROOT)


def _read(result_dir: Path) -> tuple[dict, dict]:
    """({(rank, restart): result}, {rank: [(restart, step), ...]}) written by the workers."""
    results = {}
    for p in result_dir.glob("rank*.attempt*.pkl"):
        rank, restart = p.stem[4:].split(".attempt")
        results[int(rank), int(restart)] = pickle.loads(p.read_bytes())
    steps = {}
    for p in result_dir.glob("rank*.steps"):
        steps[int(p.stem[4:])] = [tuple(map(int, line.split())) for line in p.read_text().split("\n") if line.strip()]
    return results, steps


_jobs: dict = {}


def _torchrun_job(ref, tmp_path_factory) -> dict:
    """The faulty job, then the same command again; everything the tests look at."""
    if ref in _jobs:
        if isinstance(_jobs[ref], BaseException):
            raise _jobs[ref]
        return _jobs[ref]
    base = tmp_path_factory.mktemp("recovery-torchrun")
    try:
        _probe(ref.load(), base)
        env = {**TORCHRUN_ENV, "COURSE_GRADE_KIND": ref.kind, "COURSE_GRADE_LOCATION": ref.location,
               "COURSE_BACKEND": "gloo", "COURSE_RECOVERY_FOLDER": str(base / "checkpoints"),
               "COURSE_RECOVERY_STEPS": str(_TOTAL), "COURSE_RECOVERY_EVERY": str(_EVERY), "COURSE_FAULTS": _FAULTS,
               "PYTHONPATH": os.pathsep.join([str(grading.REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        first_dir, second_dir = base / "first", base / "second"
        first_dir.mkdir()
        second_dir.mkdir()
        first = _launch({**env, "COURSE_RESULT_DIR": str(first_dir)}, first_dir)
        listing = sorted(p.name for p in (base / "checkpoints").iterdir())
        second = _launch({**env, "COURSE_RESULT_DIR": str(second_dir)}, second_dir)
        job = {"first": (*first, *_read(first_dir)), "listing": listing, "second": (*second, *_read(second_dir))}
    except BaseException as exc:
        _jobs[ref] = exc
        raise
    _jobs[ref] = job
    return job


def _check_errors(results: dict, where: str, expected_restarts: set[int]) -> None:
    """Errors of attempts that no fault explains (a killed peer's survivor may fail) are raised."""
    for (rank, restart), result in sorted(results.items()):
        if "error" in result:
            todo = result["error"] == "NotImplementedError" and result["message"].startswith("TODO")
            if todo or restart not in expected_restarts:
                _raise(f"{where}, rank {rank}, restart attempt {restart}", result)


def _starts(steps: dict) -> dict[int, int]:
    """restart attempt -> first step it ran (rank 0's log; both ranks run the same steps)."""
    starts = {}
    for restart, step in steps.get(0, []):
        starts.setdefault(restart, step)
    return starts


def _final(job, reference) -> list[str]:
    output, code, results, _ = job["second"]
    problems = []
    for rank in range(2):
        got = results.get((rank, 0))
        if got is None:
            return [f"the relaunch: rank {rank} wrote no result (agent exit code {code}); output tail:\n{output[-3000:]}"]
        if "error" in got:
            _raise(f"the relaunch, rank {rank}", got)
        if got["steps_done"] != _TOTAL or got["preempted"]:
            problems.append(f"the relaunch, rank {rank}: stopped after {got['steps_done']} steps "
                            f"(preempted={got['preempted']}), expected to finish all {_TOTAL}")
        problems += _param_problems(got["params"], reference[rank], f"final parameters of rank {rank}")
    return problems


def test_4_2_sigkill_restarts_and_finishes_bitwise(grade, tmp_path_factory):
    """SIGKILL rank 1 in a backward, then rank 0 inside DDP's all-reduce (one per restart
    attempt): torchrun restarts the group each time, each attempt resumes from
    the newest checkpoint (losing fewer than `every` steps), and the run ends with the
    parameters of the uninterrupted run, bit for bit."""
    ref = grade("4.2")
    reference = [r["reference"] for r in _world(ref, tmp_path_factory)]
    job = _torchrun_job(ref, tmp_path_factory)
    output, code, results, steps = job["first"]
    _check_errors(results, "the faulty launch", set(range(_MAX_RESTARTS)))
    starts = _starts(steps)
    problems = []
    for attempt, (rank, step, phase) in enumerate(_KILLS):
        last = max((s for r, s in steps.get(rank, []) if r == attempt), default=None)
        if last != step:
            problems.append(f"restart attempt {attempt}: rank {rank} was to be killed in the {phase} of step {step}, "
                            f"but its last step in that attempt was {last}")
        nxt = starts.get(attempt + 1)
        if nxt is None:
            problems.append(f"no restart attempt {attempt + 1} after rank {rank} was killed at step {step} "
                            f"(agent exit code {code}); output tail:\n{output[-3000:]}")
        elif not step + 1 - _EVERY <= nxt <= step:
            problems.append(f"after the kill in step {step} (checkpoint every {_EVERY}), restart attempt "
                            f"{attempt + 1} started at step {nxt}; expected the newest checkpoint, step "
                            f"{step - step % _EVERY} (at most {_EVERY} steps lost, none skipped)")
    problems += _final(job, reference)
    assert_no_problems(problems, f"torchrun --standalone --nproc-per-node=2 --max-restarts={_MAX_RESTARTS}, "
                                 f"faults {_FAULTS}:")


def test_4_2_sigkill_during_save_uses_no_torn_checkpoint(grade, tmp_path_factory):
    """Rank 0 is killed with half of the checkpoint of step 8 written: the next attempt
    resumes from the checkpoint before it (step 6), never from the torn file."""
    ref = grade("4.2")
    reference = [r["reference"] for r in _world(ref, tmp_path_factory)]
    job = _torchrun_job(ref, tmp_path_factory)
    output, code, results, steps = job["first"]
    _check_errors(results, "the faulty launch", set(range(_MAX_RESTARTS)))
    attempt, (rank, step, _) = len(_KILLS), _SAVE_KILL
    problems = []
    last = max((s for r, s in steps.get(rank, []) if r == attempt), default=None)
    if last != step:
        problems.append(f"restart attempt {attempt}: rank {rank} was to be killed saving after step {step}, but "
                        f"its last step in that attempt was {last}")
    if f"[fault injector] kill at rank={rank},step={step},phase=save" not in output:
        problems.append(f"the fault injector never fired in the save after step {step} on rank {rank}: does the "
                        "loop save through CheckpointManager, inside injector.saving(), after that step?")
    nxt = _starts(steps).get(attempt + 1)
    if nxt is None:
        problems.append(f"no restart attempt {attempt + 1} after the kill during the save (agent exit code {code})")
    elif not step + 1 - _EVERY <= nxt <= step:
        problems.append(f"after the kill while writing the checkpoint of step {step + 1}, restart attempt "
                        f"{attempt + 1} started at step {nxt}; expected {step + 1 - _EVERY}, the newest COMPLETE "
                        "checkpoint")
    problems += _final(job, reference)
    assert_no_problems(problems, f"SIGKILL of rank {rank} while it writes the checkpoint of step {step + 1}:")


def test_4_2_sigterm_under_torchrun_saves_then_relaunch_finishes(grade, tmp_path_factory):
    """SIGTERM to the torchrun agent during step 8 (a preemption): the agent forwards it,
    both workers finish step 8, save the checkpoint of step 9 and exit cleanly; the same
    command launched again resumes at step 9 and finishes bitwise equal."""
    ref = grade("4.2")
    reference = [r["reference"] for r in _world(ref, tmp_path_factory)]
    job = _torchrun_job(ref, tmp_path_factory)
    output, code, results, steps = job["first"]
    _check_errors(results, "the faulty launch", set(range(_MAX_RESTARTS)))
    attempt, stop = _MAX_RESTARTS, _TERM[1] + 1
    problems = []
    for rank in range(2):
        got = results.get((rank, attempt))
        if got is None or "error" in got:
            problems.append(f"rank {rank} did not return from restart attempt {attempt} after the SIGTERM "
                            f"({'error: ' + got['message'] if got else 'no result'}); agent output tail:\n"
                            f"{output[-3000:]}")
        elif (got["preempted"], got["steps_done"]) != (True, stop):
            problems.append(f"rank {rank}: after the SIGTERM in step {_TERM[1]} it returned preempted="
                            f"{got['preempted']} after {got['steps_done']} steps; expected preempted=True after "
                            f"{stop} steps (the next step boundary)")
    if "forcefully exiting" in output:
        problems.append("the agent had to SIGKILL a worker that did not exit after its SIGTERM")
    if f"step_{stop:09d}.pt" not in job["listing"]:
        problems.append(f"no checkpoint of step {stop} after the SIGTERM; the folder held {job['listing']}")
    starts = _starts(job["second"][3])
    if starts.get(0) != stop:
        problems.append(f"the relaunch started at step {starts.get(0)}, expected {stop} (the SIGTERM checkpoint)")
    problems += _final(job, reference)
    assert_no_problems(problems, f"SIGTERM to the torchrun agent in step {_TERM[1]} of {_TOTAL}, then the same "
                                 "command again:")


def test_4_2_the_pieces_used_alone(grade, tmp_path, monkeypatch):
    """In one process, without a process group: current_attempt() reads rank 0 of 1 and the restart count afresh;
    resume() of an empty folder returns None and changes nothing, and of a checkpoint restores model, optimizer,
    LR scheduler and GradScaler into fresh ones; set_aside_newer(resumed=None) sets every checkpoint aside, and
    with nothing newer returns []; PreemptionHandler puts the previous handler back when its block ends by an
    exception."""
    mod, checkpoint = grade("4.2").load(), grading.reference("4.1")
    problems = []
    for restart in ("0", "2"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        attempt = mod.current_attempt()
        if (attempt.rank, attempt.world_size, attempt.restart) != (0, 1, int(restart)):
            problems.append(f"current_attempt() in one process with TORCHELASTIC_RESTART_COUNT={restart}: {attempt}, "
                            f"expected rank 0, world_size 1, restart {restart}")

    def objects(seed):
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**seed, growth_interval=3)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        return model, optimizer, scheduler, scaler

    manager = checkpoint.CheckpointManager(tmp_path / "run", keep=5)
    model, optimizer, scheduler, scaler = objects(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if mod.resume(manager, model, optimizer, scheduler, scaler) is not None:
        problems.append("resume() with no checkpoint must return None (a fresh start)")
    if any(not torch.equal(before[k], v) for k, v in model.state_dict().items()):
        problems.append("resume() with no checkpoint changed the model")
    saved = objects(7)
    manager.save(4, checkpoint.training_state(*saved, {"step": 4}))
    fresh = objects(9)
    progress = mod.resume(manager, *fresh)
    if progress is None or progress.get("step") != 4:
        problems.append(f"resume() returned {progress!r}, expected the progress saved with step 4")
    for name, a, b in (("model", saved[0], fresh[0]), ("optimizer", saved[1], fresh[1]),
                       ("scheduler", saved[2], fresh[2]), ("scaler", saved[3], fresh[3])):
        if repr(a.state_dict()) != repr(b.state_dict()):
            problems.append(f"after resume() the {name}'s state_dict differs from the one saved")
    for step in (5, 6):
        manager.save(step, {"step": step})
    if mod.set_aside_newer(manager, 6) != []:
        problems.append("set_aside_newer(resumed=6) with nothing newer than 6 must return []")
    zero = checkpoint.CheckpointManager(tmp_path / "zero", keep=5)
    for step in (0, 2):
        zero.save(step, {"step": step})
    moved = mod.set_aside_newer(zero, 0)
    if zero.steps() != [0] or len(moved) != 1:
        problems.append(f"set_aside_newer(resumed=0) with checkpoints of steps 0 and 2 left steps() = {zero.steps()} "
                        f"and returned {moved}; expected [0] and the one path of step 2 set aside (resume loaded step "
                        "0: a step, not None)")
    moved = mod.set_aside_newer(manager, None)
    if manager.steps() or len(moved) != 3 or not all(p.exists() for p in moved):
        problems.append(f"set_aside_newer(resumed=None) must set every checkpoint aside (resume found none): "
                        f"steps() is {manager.steps()}, returned {moved}")
    seen = []

    def mine(*args):
        seen.append("mine")
    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        with pytest.raises(ZeroDivisionError):
            with mod.PreemptionHandler(signals=(signal.SIGUSR1,)):
                1 / 0
        signal.raise_signal(signal.SIGUSR1)
        if signal.getsignal(signal.SIGUSR1) is not mine or seen != ["mine"]:
            problems.append("after a `with PreemptionHandler(signals=(SIGUSR1,))` block ended by an exception, the "
                            "handler installed before it is not back (put the previous handlers back on every way out)")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert_no_problems(problems, "the recovery pieces used on their own, in one process:")
