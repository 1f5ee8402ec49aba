"""Graded tests of exercise 2.6, pipeline schedules (phase2_advanced/guidelines.md, section 2.6).

Run them with `python tests/test_phase2.py -k 2_6` (your code) or
`pytest tests/test_phase2.py -k 2_6` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import grading
from compare import assert_no_problems
from common.distributed import current_device
from common.measure import StageRecorder, render_timeline
from phase2.test_2_5_model_split import (
    _pp_batch, _pp_expected, _pp_layers, _pp_problems, _pp_shared_world, _pp_stage_grads,
)


SCHEDULE_CASES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (3, 4), (3, 5), (4, 4), (4, 8), (4, 2), (5, 7), (6, 3)]


def _pp_schedule_fns(mod) -> dict:
    return {"gpipe_schedule": mod.gpipe_schedule, "one_f_one_b_schedule": mod.one_f_one_b_schedule}


def _pp_in_flight_profile(actions) -> list[int]:
    count, profile = 0, []
    for kind, _ in actions:
        count += 1 if kind == "F" else -1
        profile.append(count)
    return profile


def _pp_order_problems(schedule, num_stages: int, num_microbatches: int, case: str) -> list[str]:
    """Each stage: every F and B once, F(j) before B(j); neighbours: the same micro-batch order."""
    if len(schedule) != num_stages:
        return [f"{case}: {len(schedule)} stage lists, expected {num_stages}"]
    problems = []
    everything = sorted([("F", j) for j in range(num_microbatches)] + [("B", j) for j in range(num_microbatches)])
    for s, actions in enumerate(schedule):
        actions = [tuple(a) for a in actions]
        if sorted(actions) != everything:
            problems.append(f"{case}: stage {s} runs {actions}; expected every ('F', j) and ('B', j), "
                            f"j = 0..{num_microbatches - 1}, exactly once")
        elif any(actions.index(("B", j)) < actions.index(("F", j)) for j in range(num_microbatches)):
            problems.append(f"{case}: stage {s} runs a backward before its forward: {actions}")
    if problems:
        return problems
    for s in range(num_stages - 1):
        for kind in "FB":
            mine = [j for k, j in schedule[s] if k == kind]
            theirs = [j for k, j in schedule[s + 1] if k == kind]
            if mine != theirs:
                problems.append(f"{case}: stages {s} and {s + 1} run their {kind} in different micro-batch orders "
                                f"({mine} vs {theirs}); messages are matched in order, so they must agree")
    return problems


def test_2_6_schedules_run_every_microbatch_once_in_order(grade):
    mod = grade("2.6").load()
    problems = []
    for name, fn in _pp_schedule_fns(mod).items():
        for p, m in SCHEDULE_CASES:
            case = f"{name}({p}, {m})"
            schedule = fn(p, m)
            order = _pp_order_problems(schedule, p, m, case)
            problems += order
            if name == "gpipe_schedule" and not order:
                for s, actions in enumerate(schedule):
                    kinds = "".join(k for k, _ in actions)
                    if kinds != "F" * m + "B" * m:
                        problems.append(f"{case}: stage {s} runs {kinds}; GPipe runs all forwards, then all backwards")
    assert_no_problems(problems)


def test_2_6_1f1b_warmup_and_in_flight_limit(grade):
    mod = grade("2.6").load()
    problems = []
    for p, m in SCHEDULE_CASES:
        case = f"one_f_one_b_schedule({p}, {m})"
        schedule = mod.one_f_one_b_schedule(p, m)
        order = _pp_order_problems(schedule, p, m, case)
        if order:
            problems += order
            continue
        for s, actions in enumerate(schedule):
            kinds = "".join(k for k, _ in actions)
            warmup = min(p - s - 1, m)
            leading = len(kinds) - len(kinds.lstrip("F"))
            if leading != min(p - s, m):
                problems.append(f"{case}: stage {s} runs {leading} forwards before its first backward, expected "
                                f"{min(p - s, m)} (a warm-up of min(p - s - 1, m) = {warmup}, then the first F of "
                                f"1F1B): {kinds}")
                continue
            steady = kinds[leading:]
            remaining_f = m - leading
            if steady[: 2 * remaining_f] != "BF" * remaining_f:
                problems.append(f"{case}: stage {s}: after the warm-up, backwards and forwards must alternate while "
                                f"forwards remain: {kinds}")
            peak = max(_pp_in_flight_profile(actions))
            if peak > p:
                problems.append(f"{case}: stage {s} holds {peak} micro-batches in flight; 1F1B never holds more than "
                                f"p = {p}")
    assert_no_problems(problems)


def test_2_6_max_in_flight_counts_forwards_not_yet_backwarded(grade):
    mod = grade("2.6").load()
    handmade = [[("F", 0), ("B", 0)], [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
                [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]
    for actions in handmade:
        got, expected = mod.max_in_flight(actions), max(_pp_in_flight_profile(actions))
        assert got == expected, f"max_in_flight({actions}) = {got}, expected {expected}"
    reference = grading.reference("2.6")
    for p, m in [(4, 8), (4, 2), (3, 5)]:
        gpipe = [mod.max_in_flight(a) for a in reference.gpipe_schedule(p, m)]
        assert gpipe == [m] * p, f"GPipe({p}, {m}): max_in_flight per stage {gpipe}, expected all {m} micro-batches"
        ofob = [mod.max_in_flight(a) for a in reference.one_f_one_b_schedule(p, m)]
        assert ofob == [min(p - s, m) for s in range(p)], f"1F1B({p}, {m}): max_in_flight per stage {ofob}, expected p - s capped by m"


def test_2_6_time_grid_respects_dependencies(grade):
    mod = grade("2.6").load()
    reference = grading.reference("2.6")
    problems = []
    for name in ("gpipe_schedule", "one_f_one_b_schedule"):
        for p, m in SCHEDULE_CASES:
            case = f"time_grid({name}({p}, {m}))"
            schedule = getattr(reference, name)(p, m)
            grid = mod.time_grid(schedule)
            if any(len(row) != p for row in grid):
                problems.append(f"{case}: every time step needs one cell per stage ({p})")
                continue
            when = {}
            for t, row in enumerate(grid):
                for s, action in enumerate(row):
                    if action is not None:
                        when[(action[0], s, action[1])] = t
            for s in range(p):
                ran = [tuple(row[s]) for row in grid if row[s] is not None]
                if ran != schedule[s]:
                    problems.append(f"{case}: column of stage {s} is {ran}, expected its actions in order {schedule[s]}")
            if problems:
                continue
            for (kind, s, j), t in when.items():
                needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs += [("F", s, j)] + ([("B", s + 1, j)] if s < p - 1 else [])
                for need in needs:
                    if when[need] >= t:
                        problems.append(f"{case}: {kind}{j} on stage {s} at step {t}, but it needs {need[0]}{need[2]} "
                                        f"of stage {need[1]}, which runs at step {when[need]}")
    assert_no_problems(problems)
    cycle = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(ValueError):
        mod.time_grid(cycle)  # F1 on stage 1 waits for stage 0's F1, which waits (through B0) for stage 1's F1


def test_2_6_bubble_fraction_matches_formula(grade):
    mod = grade("2.6").load()
    handmade = [[("F", 0), None], [None, ("F", 0)], [None, ("B", 0)], [("B", 0), None]]
    assert mod.bubble_fraction(handmade) == pytest.approx(0.5), "bubble_fraction is idle slots / all slots"
    problems = []
    for name, fn in _pp_schedule_fns(mod).items():
        for p, m in SCHEDULE_CASES:
            grid = mod.time_grid(fn(p, m))
            bubble, expected = mod.bubble_fraction(grid), (p - 1) / (m + p - 1)
            if len(grid) != 2 * (m + p - 1) or bubble != pytest.approx(expected, abs=1e-12):
                problems.append(f"{name}({p}, {m}): {len(grid)} time steps and bubble {bubble:.4f}; expected "
                                f"2(m+p-1) = {2 * (m + p - 1)} steps and (p-1)/(m+p-1) = {expected:.4f}\n"
                                + render_timeline(grid))
    assert_no_problems(problems)


@pytest.mark.parametrize("call", [
    "gpipe_schedule(0, 4)", "gpipe_schedule(2, 0)", "gpipe_schedule(-1, 3)", "gpipe_schedule(2, 1.5)",
    "one_f_one_b_schedule(0, 4)", "one_f_one_b_schedule(3, 0)", "one_f_one_b_schedule(2, -2)",
    "split_microbatches(torch.zeros(10, 3), 4)", "split_microbatches(torch.zeros(10, 3), 0)",
])
def test_2_6_invalid_settings_raise_value_error(grade, call):
    mod = grade("2.6").load()
    with pytest.raises(ValueError):
        eval(call, {"torch": torch}, vars(mod))


PIPE_STAGES, PIPE_HIDDEN, PIPE_BATCH, PIPE_MICROBATCHES = 3, (32, 32, 16), 30, (2, 3, 5)  # 8 layers; m < p, = p, > p


def _pipeline_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int, microbatch_counts) -> dict:
    """Every m: both schedules of the implementation, run by its run_pipeline (parity: loss and
    gradients); then both reference schedules, run by its run_pipeline under a StageRecorder
    (the executor alone: order of computations and messages, bytes held)."""
    mod, reference = ref.load(), grading.reference("2.6")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # NCCL: the group's first collective must involve every rank (see Mailbox)
    stage = grading.reference("2.5").PipelineStage(_pp_layers(hidden), rank, world, device=current_device())
    x, y = _pp_batch(batch)
    results = {}
    for source in ("parity", "recorded"):
        for name in ("gpipe_schedule", "one_f_one_b_schedule"):
            for m in microbatch_counts:
                splitter = mod if source == "parity" else reference
                try:  # an unfinished schedule is TODO for the parity tests only, not for the executor's
                    schedule = getattr(splitter, name)(world, m)
                    xs, ys = splitter.split_microbatches(x, m), splitter.split_microbatches(y, m)  # on every rank
                except NotImplementedError as exc:
                    results[(source, name, m)] = {"todo": str(exc)}  # the same on every rank: no hang
                    continue
                problems = _pp_order_problems(schedule, world, m, f"{name}({world}, {m})")
                try:
                    reference.time_grid(schedule)
                except ValueError as exc:
                    problems.append(f"{name}({world}, {m}): {exc}")
                if problems:  # every rank sees the same schedule, so every rank skips it: no hang
                    results[(source, name, m)] = {"problems": problems}
                    continue
                xs, ys = xs if rank == 0 else None, ys if rank == world - 1 else None
                stage.zero_grad(set_to_none=True)
                if source == "parity":
                    loss = mod.run_pipeline(schedule[rank], stage, xs, ys, F.cross_entropy)
                    results[(source, name, m)] = {"layers": list(stage.layer_range), "grads": _pp_stage_grads(stage),
                                                  "loss": None if loss is None else float(loss)}
                    continue
                with StageRecorder(stage, exclude=xs or ()) as recorder:
                    mod.run_pipeline(schedule[rank], stage, xs, ys, F.cross_entropy)
                results[(source, name, m)] = {
                    "actions": [tuple(a) for a in schedule[rank]], "events": recorder.events,
                    "computes": [(c.kind, c.in_numel, c.out_numel) for c in recorder.computes],
                    "peak_bytes": recorder.peak_bytes, "one_forward_bytes": recorder.held_after_forward[0]}
    return results


_pipeline_worlds: dict = {}  # ModuleRef -> results or exception: one world serves every executor test


def _pipeline_results(ref: grading.ModuleRef) -> list[dict]:
    return _pp_shared_world(_pipeline_worlds, ref, _pipeline_rank, PIPE_STAGES,
                            (PIPE_HIDDEN, PIPE_BATCH, PIPE_MICROBATCHES))


def _pipeline_parity(ref: grading.ModuleRef, schedule_name: str) -> None:
    results = _pipeline_results(ref)
    loss, grads = _pp_expected(PIPE_HIDDEN, PIPE_BATCH)
    problems = []
    for m in PIPE_MICROBATCHES:
        per_rank = [r[("parity", schedule_name, m)] for r in results]
        if "todo" in per_rank[0]:
            raise NotImplementedError(per_rank[0]["todo"])
        if "problems" in per_rank[0]:
            problems += [f"not run, the schedule is invalid: {p}" for p in per_rank[0]["problems"]]
            continue
        problems += _pp_problems(per_rank, loss, grads, 2 * len(PIPE_HIDDEN) + 2, f"{schedule_name}({PIPE_STAGES}, {m})")
    assert_no_problems(problems, f"run_pipeline on {PIPE_STAGES} stages differs from the unsplit model on the whole batch "
                       "(gradients are accumulated over micro-batches, each loss divided by m):")


def test_2_6_gpipe_matches_one_process(grade):
    _pipeline_parity(grade("2.6"), "gpipe_schedule")


def test_2_6_1f1b_matches_one_process(grade):
    _pipeline_parity(grade("2.6"), "one_f_one_b_schedule")


def _recorded_runs(ref: grading.ModuleRef) -> dict:
    """(schedule name, m) -> [each rank's recorded run of the reference schedule by the implementation's executor]."""
    results = _pipeline_results(ref)
    return {key[1:]: [r[key] for r in results] for key in results[0] if key[0] == "recorded"}


def test_2_6_sends_leave_before_the_next_computation(grade):
    problems = []
    for (name, m), per_rank in _recorded_runs(grade("2.6")).items():
        for rank, res in enumerate(per_rank):
            computes, events, actions = res["computes"], res["events"], res["actions"]
            starts = [i for i, event in enumerate(events) if event[0] in ("F", "B")]
            input_numel = next(c[1] for c in computes if c[0] == "F")
            label = (lambda i: f"{actions[i][0]}{actions[i][1]}") if len(computes) == len(actions) else (
                lambda i: f"computation {i}")
            for i, ((kind, _, out_numel), begin, end) in enumerate(zip(computes, starts, starts[1:])):
                if kind == "F" and rank < PIPE_STAGES - 1:
                    expected, what = ("send", rank + 1, out_numel), f"the activation of {label(i)}"
                elif kind == "B" and rank > 0:
                    expected, what = ("send", rank - 1, input_numel), f"the input gradient of {label(i)}"
                else:
                    continue
                if expected not in events[begin + 1 : end]:
                    later = next((k - end for k in range(end, len(events)) if events[k] == expected), None)
                    problems.append(
                        f"{name}({PIPE_STAGES}, {m}), stage {rank}, actions {''.join(f'{k}{j} ' for k, j in actions)}: "
                        f"{what} (a send of {expected[2]} elements to rank {expected[1]}) was not posted before "
                        f"{label(i + 1)} started computing"
                        + ("" if later is None else f" (it left {later} events later)")
                        + f"; rank {expected[1]} waits for it meanwhile")
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    assert_no_problems(shown, "a stage must post an action's sends before it computes the next action (Mailbox.post() "
                       "when that action has nothing to receive):")


def test_2_6_1f1b_memory_does_not_grow_with_m(grade):
    stage0 = {key: per_rank[0] for key, per_rank in _recorded_runs(grade("2.6")).items()}
    # (schedule, m) -> stage 0's peak bytes held, in units of what one forward left held
    in_flight = {key: res["peak_bytes"] / max(res["one_forward_bytes"], 1) for key, res in stage0.items()}
    problems = []
    p, m_small, m_large = PIPE_STAGES, PIPE_MICROBATCHES[-2], PIPE_MICROBATCHES[-1]
    for m in PIPE_MICROBATCHES:
        held = in_flight.get(("one_f_one_b_schedule", m))
        if held is not None and held > min(p, m) + 0.5:
            problems.append(f"1F1B({p}, {m}): stage 0 held {held:.2f} micro-batches' worth of bytes at its peak "
                            f"(saved activations, outputs and send buffers alive; one forward = "
                            f"{stage0[('one_f_one_b_schedule', m)]['one_forward_bytes']} bytes), expected at most "
                            f"min(p, m) = {min(p, m)} (+ message headers). Is a micro-batch let go after its "
                            "backward: its outputs dropped, and its sends waited for (Delivery.wait()) once "
                            "delivered, not only at the final flush?")
    small, large = in_flight.get(("one_f_one_b_schedule", m_small)), in_flight.get(("one_f_one_b_schedule", m_large))
    if small is not None and large is not None and large > small + 0.5:
        problems.append(f"1F1B: stage 0 held {small:.2f} micro-batches' worth at m = {m_small} but {large:.2f} at "
                        f"m = {m_large}: its memory grows with m, which is what 1F1B exists to prevent")
    gpipe = in_flight.get(("gpipe_schedule", m_large))
    if gpipe is not None and gpipe < m_large - 0.5:
        problems.append(f"GPipe({p}, {m_large}): stage 0 held only {gpipe:.2f} micro-batches' worth at its peak; "
                        f"running all {m_large} forwards before any backward holds all of them: does run_pipeline "
                        "run the actions in the order given?")
    assert_no_problems(problems, "bytes stage 0 holds for micro-batches in flight (common.measure.StageRecorder):")
