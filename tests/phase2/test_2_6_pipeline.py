"""Graded tests of exercise 2.6, pipeline schedules (phase2_advanced/guidelines.md, section 2.6).

Run them with `python tests/test_phase2.py -k 2_6` (your code) or
`pytest tests/test_phase2.py -k 2_6` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import grading
from compare import assert_no_problems
from common.distributed import current_device
from common.measure import StageRecorder, render_timeline
from phase2.test_2_5_model_split import (
    _pp_batch, _pp_expected, _pp_layers, _pp_loss, _pp_problems, _pp_shared_world, _pp_stage_grads,
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


# Property-based checks (hypothesis): each test draws its cases, deterministically (derandomize: the
# same cases on every run), and shrinks a failure to the smallest case it can find.
_PP_PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])
_PP_SETTINGS = st.tuples(st.integers(1, 10), st.integers(1, 16))  # (p, m): m < p, = p and > p alike


def _pp_examples(test):
    """The hand-picked SCHEDULE_CASES always run, before the drawn ones."""
    for case in SCHEDULE_CASES:
        test = example(case=case)(test)
    return test


def _pp_needs(num_stages: int, s: int, kind: str, j: int) -> list[tuple[str, int, int]]:
    """The dependencies of action (kind, j) on stage s, as (kind, stage, micro-batch)."""
    needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
    if kind == "B":
        needs += [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else [])
    return needs


def _pp_asap_grid(schedule) -> list[list] | None:
    """The time grid the contract defines, computed another way than by stepping a clock: each action
    starts one step after the latest of its stage's previous action and its dependencies (a longest
    path); None if some action waits on itself through a cycle (the schedule deadlocks)."""
    p = len(schedule)
    where = {(kind, s, j): (s, i) for s, actions in enumerate(schedule) for i, (kind, j) in enumerate(actions)}
    start: dict[tuple[int, int], int] = {}
    visiting: set[tuple[int, int]] = set()

    def time_of(node) -> int | None:
        if node in start:
            return start[node]
        if node in visiting:
            return None  # a cycle
        visiting.add(node)
        s, i = node
        kind, j = schedule[s][i]
        before = [(s, i - 1)] if i > 0 else []
        before += [where.get(need) for need in _pp_needs(p, s, kind, j)]
        times = [None if b is None else time_of(b) for b in before]
        visiting.discard(node)
        if any(t is None for t in times):
            return None
        start[node] = 1 + max(times, default=-1)
        return start[node]

    for node in [(s, i) for s in range(p) for i in range(len(schedule[s]))]:
        if time_of(node) is None:
            return None
    grid = [[None] * p for _ in range(1 + max(start.values(), default=-1))]
    for (s, i), t in start.items():
        grid[t][s] = tuple(schedule[s][i])
    return grid


@st.composite
def _pp_any_schedule(draw, max_stages: int = 5, max_microbatches: int = 5):
    """A random schedule that the executor could run: every stage runs every F and B once, F(j) before
    B(j), all stages in one forward order and one backward order (random permutations, as messages
    are matched in order), each stage interleaving them at random. Many of them deadlock."""
    p, m = draw(st.integers(1, max_stages)), draw(st.integers(1, max_microbatches))
    f_order, b_order = draw(st.permutations(range(m))), draw(st.permutations(range(m)))
    schedule = []
    for _ in range(p):
        actions, done, f, b = [], set(), 0, 0
        while b < m:
            if f < m and (b_order[b] not in done or draw(st.booleans())):
                actions.append(("F", f_order[f]))
                done.add(f_order[f])
                f += 1
            else:
                actions.append(("B", b_order[b]))
                b += 1
        schedule.append(actions)
    return schedule


def _pp_grid_text(grid) -> str:
    return render_timeline(grid) if grid else "(no steps)"


@_PP_PROPERTY
@given(case=_PP_SETTINGS)
@_pp_examples
def test_2_6_schedules_run_every_microbatch_once_in_order(grade, case):
    """Both schedules, any (p, m): every F and B once per stage, F(j) before B(j), neighbours in the same
    micro-batch order, no deadlock; GPipe runs all forwards first."""
    mod = grade("2.6").load()
    p, m = case
    problems = []
    for name, fn in _pp_schedule_fns(mod).items():
        case_text = f"{name}({p}, {m})"
        schedule = fn(p, m)
        order = _pp_order_problems(schedule, p, m, case_text)
        problems += order
        if order:
            continue
        if _pp_asap_grid(schedule) is None:
            problems.append(f"{case_text}: the schedule deadlocks (some action waits, through its dependencies, "
                            f"for itself): {schedule}")
        if name == "gpipe_schedule":
            for s, actions in enumerate(schedule):
                kinds = "".join(k for k, _ in actions)
                if kinds != "F" * m + "B" * m:
                    problems.append(f"{case_text}: stage {s} runs {kinds}; GPipe runs all forwards, then all backwards")
    assert_no_problems(problems)


@_PP_PROPERTY
@given(case=_PP_SETTINGS)
@_pp_examples
def test_2_6_1f1b_warmup_and_in_flight_limit(grade, case):
    """1F1B, any (p, m): min(p-s, m) forwards first, then B and F alternate while forwards remain; micro-batches
    in order 0..m-1; stage s never holds more than p - s in flight (exactly min(p-s, m) at its peak)."""
    mod = grade("2.6").load()
    p, m = case
    problems = []
    case_text = f"one_f_one_b_schedule({p}, {m})"
    schedule = mod.one_f_one_b_schedule(p, m)
    order = _pp_order_problems(schedule, p, m, case_text)
    assert_no_problems(order)
    for s, actions in enumerate(schedule):
        kinds = "".join(k for k, _ in actions)
        warmup = min(p - s - 1, m)
        leading = len(kinds) - len(kinds.lstrip("F"))
        if leading != min(p - s, m):
            problems.append(f"{case_text}: stage {s} runs {leading} forwards before its first backward, expected "
                            f"{min(p - s, m)} (a warm-up of min(p - s - 1, m) = {warmup}, then the first F of "
                            f"1F1B): {kinds}")
            continue
        steady = kinds[leading:]
        remaining_f = m - leading
        if steady[: 2 * remaining_f] != "BF" * remaining_f:
            problems.append(f"{case_text}: stage {s}: after the warm-up, backwards and forwards must alternate while "
                            f"forwards remain: {kinds}")
        for kind in "FB":
            got = [j for k, j in actions if k == kind]
            if got != list(range(m)):
                problems.append(f"{case_text}: stage {s} runs its {kind} in micro-batch order {got}; 1F1B takes them "
                                f"in order 0..{m - 1} (a backward for the oldest micro-batch in flight)")
        peak = max(_pp_in_flight_profile(actions))
        if peak > p - s:
            problems.append(f"{case_text}: stage {s} holds {peak} micro-batches in flight; 1F1B never holds more than "
                            f"p - s = {p - s} on stage {s}")
    assert_no_problems(problems)


_PP_HANDMADE = [[("F", 0), ("B", 0)], [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
                [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]


@_PP_PROPERTY
@given(schedule=_pp_any_schedule(max_stages=3, max_microbatches=8))
def test_2_6_max_in_flight_counts_forwards_not_yet_backwarded(grade, schedule):
    """Hand-made lists, the reference's schedules, and every stage of random valid schedules (any order of
    micro-batches, any interleaving): the high-water mark of forwards not yet backwarded."""
    mod = grade("2.6").load()
    for actions in _PP_HANDMADE + schedule:
        given_actions = copy.deepcopy(actions)
        got, expected = mod.max_in_flight(given_actions), max(_pp_in_flight_profile(actions))
        assert got == expected, f"max_in_flight({actions}) = {got}, expected {expected}"
        assert given_actions == actions, f"max_in_flight({actions}) modified its argument into {given_actions}"
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
                for need in _pp_needs(p, s, kind, j):
                    if when[need] >= t:
                        problems.append(f"{case}: {kind}{j} on stage {s} at step {t}, but it needs {need[0]}{need[2]} "
                                        f"of stage {need[1]}, which runs at step {when[need]}")
    assert_no_problems(problems)
    cycle = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(ValueError):
        mod.time_grid(cycle)  # F1 on stage 1 waits for stage 0's F1, which waits (through B0) for stage 1's F1


@_PP_PROPERTY
@given(schedule=_pp_any_schedule())
def test_2_6_time_grid_of_any_schedule(grade, schedule):
    """Any valid schedule (random orders and interleavings): exactly the grid where every action starts at the
    first step its stage's previous action and its dependencies have finished by, or a ValueError if the
    schedule deadlocks; the schedule itself is left unchanged."""
    mod = grade("2.6").load()
    given_schedule = copy.deepcopy(schedule)
    expected = _pp_asap_grid(schedule)
    text = "\n".join(f"  stage {s}: {' '.join(f'{k}{j}' for k, j in actions)}" for s, actions in enumerate(schedule))
    if expected is None:
        with pytest.raises(ValueError):
            mod.time_grid(given_schedule)
            pytest.fail(f"time_grid returned a grid for a schedule that deadlocks (some action waits for itself "
                        f"through its dependencies); expected ValueError:\n{text}", pytrace=False)
    else:
        grid = mod.time_grid(given_schedule)
        got = [[None if a is None else tuple(a) for a in row] for row in grid]
        assert got == expected, (f"time_grid of\n{text}\ngave {len(got)} steps:\n{_pp_grid_text(got)}\nexpected "
                                 f"{len(expected)} steps (each action at the first step where its stage's previous "
                                 f"action and its dependencies have finished):\n{_pp_grid_text(expected)}")
    assert given_schedule == schedule, f"time_grid modified the schedule it was given:\n{text}\ninto {given_schedule}"


_PP_CORRUPTIONS = ["drop an action", "repeat an action", "move a B before its F", "an unknown kind",
                   "a micro-batch out of range", "a micro-batch fewer on one stage"]


def _pp_corrupt(schedule, how: str, stage: int, index: int) -> list:
    actions = list(schedule[stage])
    kind, j = actions[index]
    m = len(actions) // 2
    if how == "a micro-batch fewer on one stage" and len(schedule) > 1:
        # every list is well formed, but the stages disagree on m: a neighbour waits forever for the last one
        actions = [(k, jj) for k, jj in actions if jj != m - 1]
    elif how == "a micro-batch fewer on one stage" or how == "drop an action":
        del actions[index]
    elif how == "repeat an action":
        actions.insert(index, (kind, j))
    elif how == "move a B before its F":
        actions.remove(("B", j))
        actions.insert(actions.index(("F", j)), ("B", j))
    elif how == "an unknown kind":
        actions[index] = ("W", j)
    else:
        actions[index] = (kind, m)
    return [actions if s == stage else list(a) for s, a in enumerate(schedule)]


@_PP_PROPERTY
@given(schedule=_pp_any_schedule(max_stages=4, max_microbatches=4), where=st.tuples(st.integers(0, 3), st.integers(0, 7)))
def test_2_6_time_grid_rejects_malformed_schedules(grade, schedule, where):
    """A schedule with one stage's list broken (an action missing or repeated, a B before its F, a kind other than
    F and B, a micro-batch out of range), or whose stages disagree on the micro-batches (one stage has one fewer:
    its neighbour waits forever, maybe after the others finished), raises ValueError: each of these, on the
    drawn schedule."""
    mod = grade("2.6").load()
    stage = where[0] % len(schedule)
    for how in _PP_CORRUPTIONS:
        bad = _pp_corrupt(schedule, how, stage, where[1] % len(schedule[stage]))
        with pytest.raises(ValueError):
            mod.time_grid(bad)
            pytest.fail(f"time_grid accepted a malformed schedule ({how}, stage {stage}): {bad}; expected ValueError",
                        pytrace=False)


@_PP_PROPERTY
@given(case=_PP_SETTINGS)
@_pp_examples
def test_2_6_bubble_fraction_matches_formula(grade, case):
    mod = grade("2.6").load()
    handmade = [[("F", 0), None], [None, ("F", 0)], [None, ("B", 0)], [("B", 0), None]]
    assert mod.bubble_fraction(handmade) == pytest.approx(0.5), "bubble_fraction is idle slots / all slots"
    p, m = case
    problems = []
    for name, fn in _pp_schedule_fns(mod).items():
        grid = mod.time_grid(fn(p, m))
        bubble, expected = mod.bubble_fraction(grid), (p - 1) / (m + p - 1)
        if len(grid) != 2 * (m + p - 1) or bubble != pytest.approx(expected, abs=1e-12):
            problems.append(f"{name}({p}, {m}): {len(grid)} time steps and bubble {bubble:.4f}; expected "
                            f"2(m+p-1) = {2 * (m + p - 1)} steps and (p-1)/(m+p-1) = {expected:.4f}\n"
                            + render_timeline(grid))
    assert_no_problems(problems)


_PP_CELL = st.one_of(st.none(), st.tuples(st.sampled_from("FB"), st.integers(0, 9)))


@_PP_PROPERTY
@given(grid=st.integers(1, 6).flatmap(lambda p: st.lists(st.lists(_PP_CELL, min_size=p, max_size=p),
                                                           min_size=1, max_size=12)))
def test_2_6_bubble_fraction_of_any_grid(grade, grid):
    """Any grid (steps x stages, busy or idle cells at random): the share of idle cells."""
    mod = grade("2.6").load()
    expected = sum(cell is None for row in grid for cell in row) / (len(grid) * len(grid[0]))
    got = mod.bubble_fraction(copy.deepcopy(grid))
    assert got == pytest.approx(expected, abs=1e-12), (
        f"bubble_fraction = {got}, expected {expected} ({sum(c is None for r in grid for c in r)} idle cells of "
        f"{len(grid)} steps x {len(grid[0])} stages):\n{_pp_grid_text(grid)}")


@pytest.mark.parametrize("call", [
    "gpipe_schedule(0, 4)", "gpipe_schedule(2, 0)", "gpipe_schedule(-1, 3)", "gpipe_schedule(2, 1.5)",
    "gpipe_schedule(2.0, 3)", "one_f_one_b_schedule(0, 4)", "one_f_one_b_schedule(3, 0)",
    "one_f_one_b_schedule(2, -2)", "one_f_one_b_schedule(3, 2.0)", "one_f_one_b_schedule(1.5, 2)",
    "split_microbatches(torch.zeros(10, 3), 4)", "split_microbatches(torch.zeros(10, 3), 0)",
    "split_microbatches(torch.zeros(10, 3), -5)", "split_microbatches(torch.zeros(10, 3), 2.5)",
    "split_microbatches(torch.zeros(10, 3), 2.0)",
])
def test_2_6_invalid_settings_raise_value_error(grade, call):
    mod = grade("2.6").load()
    with pytest.raises(ValueError):
        eval(call, {"torch": torch}, vars(mod))
        pytest.fail(f"{call} returned; expected ValueError (p and m are integers >= 1, and m divides the batch)",
                    pytrace=False)


@_PP_PROPERTY
@given(rows=st.integers(1, 40), m=st.integers(1, 40), width=st.sampled_from([(), (3,), (2, 2)]))
def test_2_6_split_microbatches_cuts_equal_consecutive_chunks(grade, rows, m, width):
    """Any batch and m: m chunks of len(batch) / m consecutive rows that put back together give the batch, or a
    ValueError if m does not divide len(batch)."""
    mod = grade("2.6").load()
    batch = torch.arange(rows * torch.Size(width).numel()).reshape(rows, *width)
    given_batch = batch.clone()
    if rows % m:
        with pytest.raises(ValueError):
            mod.split_microbatches(batch, m)
            pytest.fail(f"split_microbatches(a batch of {rows}, {m}) returned; {m} does not divide {rows}: "
                        "expected ValueError", pytrace=False)
        return
    parts = mod.split_microbatches(batch, m)
    sizes = [len(part) for part in parts]
    assert sizes == [rows // m] * m, f"split_microbatches(a batch of {rows}, {m}): sizes {sizes}, expected {m} x {rows // m}"
    assert torch.equal(torch.cat(list(parts)), given_batch), (
        f"split_microbatches(a batch of {rows}, {m}): the chunks put back together are not the batch (consecutive "
        f"rows, in order)")
    assert torch.equal(batch, given_batch), "split_microbatches modified the batch"


PIPE_STAGES, PIPE_HIDDEN, PIPE_BATCH, PIPE_MICROBATCHES = 3, (32, 32, 16), 30, (1, 2, 3, 5)  # 8 layers; m < p, = p, > p


def _pp_relabelled(schedule, order: list[int]) -> list:
    """The same schedule with micro-batch j renamed order[j]: as valid, in another micro-batch order."""
    return [[(kind, order[j]) for kind, j in actions] for actions in schedule]


# Valid schedules that are neither of the two, for the executor (made from the reference's, p = 3, m = 5): it
# must run whatever its row says, micro-batch j being input j and target j, whatever the order.
PIPE_OTHER_SCHEDULES = {
    "1F1B in micro-batch order 3 0 4 2 1": lambda ref: _pp_relabelled(ref.one_f_one_b_schedule(3, 5), [3, 0, 4, 2, 1]),
    "GPipe, forwards in order 4 1 3 0 2, backwards 0 1 2 3 4":
        lambda ref: [[("F", j) for j in (4, 1, 3, 0, 2)] + [("B", j) for j in range(5)] for _ in range(3)],
}


def _pipeline_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int, microbatch_counts) -> dict:
    """Every m: both schedules of the implementation, run by its run_pipeline (parity: loss and
    gradients); then both reference schedules, run by its run_pipeline under a StageRecorder
    (the executor alone: order of computations and messages, bytes held); then other valid
    schedules (PIPE_OTHER_SCHEDULES) run by its run_pipeline (parity)."""
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
                                                  **_pp_loss(loss)}
                    continue
                with StageRecorder(stage, exclude=xs or ()) as recorder:
                    mod.run_pipeline(schedule[rank], stage, xs, ys, F.cross_entropy)
                results[(source, name, m)] = {
                    "actions": [tuple(a) for a in schedule[rank]], "events": recorder.events,
                    "computes": [(c.kind, c.in_numel, c.out_numel) for c in recorder.computes],
                    "peak_bytes": recorder.peak_bytes, "one_forward_bytes": recorder.held_after_forward[0]}
    for name, build in PIPE_OTHER_SCHEDULES.items():
        schedule = build(reference)
        m = len(schedule[0]) // 2
        xs, ys = reference.split_microbatches(x, m), reference.split_microbatches(y, m)
        stage.zero_grad(set_to_none=True)
        loss = mod.run_pipeline(schedule[rank], stage, xs if rank == 0 else None, ys if rank == world - 1 else None,
                                F.cross_entropy)
        results[("other", name)] = {"layers": list(stage.layer_range), "grads": _pp_stage_grads(stage), **_pp_loss(loss)}
    if rank == 0:  # one stage, first and last at once: 1F1B(1, 3) is F0 B0 F1 B1 F2 B2, no message
        alone = grading.reference("2.5").PipelineStage(_pp_layers(hidden), 0, 1, device=current_device())
        loss = mod.run_pipeline(reference.one_f_one_b_schedule(1, 3)[0], alone, reference.split_microbatches(x, 3),
                                reference.split_microbatches(y, 3), F.cross_entropy)
        results["alone"] = {"layers": list(alone.layer_range), "grads": _pp_stage_grads(alone), **_pp_loss(loss)}
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


def test_2_6_executor_runs_any_valid_schedule(grade):
    """run_pipeline on schedules other than GPipe and 1F1B in order (micro-batches relabelled, backwards in another
    order than the forwards): micro-batch j is input j with target j wherever it comes in the list; and on a
    pipeline of one stage, first and last at once."""
    results = _pipeline_results(grade("2.6"))
    loss, grads = _pp_expected(PIPE_HIDDEN, PIPE_BATCH)
    problems = []
    for name in PIPE_OTHER_SCHEDULES:
        per_rank = [r[("other", name)] for r in results]
        problems += _pp_problems(per_rank, loss, grads, 2 * len(PIPE_HIDDEN) + 2, f"{name} ({PIPE_STAGES} stages)")
    problems += _pp_problems([results[0]["alone"]], loss, grads, 2 * len(PIPE_HIDDEN) + 2,
                             "1F1B(1, 3), one stage holding every layer (first and last at once)")
    assert_no_problems(problems, "run_pipeline must run the row it is given, whatever the micro-batch order: F(j) takes "
                       "input micro-batch j (first stage) and target j (last stage), B(j) the backward of that F(j):")


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
    runs = _recorded_runs(grade("2.6"))
    for rank in range(PIPE_STAGES):
        held = {m: runs[("one_f_one_b_schedule", m)][rank] for m in (m_small, m_large)
                if ("one_f_one_b_schedule", m) in runs}
        if len(held) < 2:
            continue
        small, large = (held[m]["peak_bytes"] / max(held[m]["one_forward_bytes"], 1) for m in (m_small, m_large))
        if large > small + 0.5:
            problems.append(f"1F1B: stage {rank} held {small:.2f} micro-batches' worth at m = {m_small} but {large:.2f} "
                            f"at m = {m_large}: its memory grows with m, which is what 1F1B exists to prevent (are the "
                            "activations and the input gradients it sends waited for once delivered?)")
    gpipe = in_flight.get(("gpipe_schedule", m_large))
    if gpipe is not None and gpipe < m_large - 0.5:
        problems.append(f"GPipe({p}, {m_large}): stage 0 held only {gpipe:.2f} micro-batches' worth at its peak; "
                        f"running all {m_large} forwards before any backward holds all of them: does run_pipeline "
                        "run the actions in the order given?")
    assert_no_problems(problems, "bytes stage 0 holds for micro-batches in flight (common.measure.StageRecorder):")
