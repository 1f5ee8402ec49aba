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
from compare import assert_no_problems, diff_report
from common.distributed import current_device
from common.measure import PointToPointLog, StageRecorder, render_timeline
from phase2.test_2_5_model_split import (
    _pp_batch, _pp_expected, _pp_layers, _pp_loss, _pp_problems, _pp_shared_world, _pp_stage_grads,
)


SCHEDULE_CASES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (3, 4), (3, 5), (4, 4), (4, 8), (4, 2), (5, 7), (6, 3)]


def _pp_schedule_fns(mod) -> dict:
    return {"gpipe_schedule": mod.gpipe_schedule, "one_f_one_b_schedule": mod.one_f_one_b_schedule}


def _pp_in_flight_profile(actions) -> list[int]:
    """After each action, the (stage, micro-batch) pairs whose F ran and whose W (B, when the list has no W for
    the pair) did not."""
    def key(action):
        return (action[1], action[2] if len(action) > 2 else None)
    split = {key(a) for a in actions if a[0] == "W"}
    count, profile = 0, []
    for action in actions:
        count += 1 if action[0] == "F" else -1 if action[0] == "W" or key(action) not in split else 0
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


def _pp_norm(rank: int, action) -> tuple[str, int, int]:
    """An action as (kind, micro-batch, virtual stage): (kind, j) on rank r is on stage r."""
    return (action[0], action[1], action[2] if len(action) > 2 else rank)


def _pp_needs(num_stages: int, s: int, kind: str, j: int) -> list[tuple[str, int, int]]:
    """The dependencies of action (kind, j) on (virtual) stage s, as (kind, stage, micro-batch)."""
    needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
    if kind == "B":
        needs += [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else [])
    if kind == "W":
        needs += [("B", s, j)]
    return needs


def _pp_num_stages(schedule) -> int:
    """Virtual stages 0..S-1: S at least the number of ranks (a rank's (kind, j) actions are on its stage)."""
    return max([len(schedule)] + [1 + _pp_norm(r, a)[2] for r, actions in enumerate(schedule) for a in actions])


def _pp_asap_grid(schedule, costs: dict | None = None) -> list[list] | None:
    """The time grid the contract defines, computed another way than by stepping a clock: each action
    starts when the later of its rank's previous action and its dependencies has finished, and takes
    costs[kind] steps (a longest path); None if some action waits on itself through a cycle, or on an
    action no rank runs (the schedule deadlocks)."""
    steps = {"F": 1, "B": 1, "W": 1, **(costs or {})}
    p, num_stages = len(schedule), _pp_num_stages(schedule)
    rows = [[_pp_norm(r, a) for a in actions] for r, actions in enumerate(schedule)]
    where = {(kind, k, j): (r, i) for r, row in enumerate(rows) for i, (kind, j, k) in enumerate(row)}
    end: dict[tuple[int, int], int] = {}
    visiting: set[tuple[int, int]] = set()

    class Deadlock(Exception):
        pass

    def end_of(node) -> int:
        if node is None:
            raise Deadlock  # waits on an action no rank runs
        if node in end:
            return end[node]
        if node in visiting:
            raise Deadlock  # a cycle
        visiting.add(node)
        r, i = node
        kind, j, k = rows[r][i]
        before = [(r, i - 1)] if i > 0 else []
        before += [where.get(need) for need in _pp_needs(num_stages, k, kind, j)]
        end[node] = max((end_of(b) for b in before), default=0) + steps[kind]
        visiting.discard(node)
        return end[node]

    try:
        for node in [(r, i) for r in range(p) for i in range(len(rows[r]))]:
            end_of(node)
    except Deadlock:
        return None
    grid = [[None] * p for _ in range(max(end.values(), default=0))]
    for (r, i), t in end.items():
        for step in range(t - steps[rows[r][i][0]], t):
            grid[step][r] = tuple(schedule[r][i])
    return grid


def _pp_message_problems(schedule, case: str) -> list[str]:
    """Messages between two ranks are matched in posting order: what rank a sends to rank b (activations
    of its F's, input gradients of its B's, in a's order) must be what b receives from a, in b's order.
    Neighbouring stages on one rank exchange nothing."""
    num_stages = _pp_num_stages(schedule)
    owner = {_pp_norm(r, a)[2]: r for r, actions in enumerate(schedule) for a in actions}
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for r, actions in enumerate(schedule):
        for kind, j, k in (_pp_norm(r, a) for a in actions):
            if kind == "F" and k + 1 < num_stages and owner.get(k + 1, r) != r:
                sent.setdefault((r, owner[k + 1]), []).append(f"activation F{j} of stage {k}")
            if kind == "F" and k > 0 and owner.get(k - 1, r) != r:
                received.setdefault((owner[k - 1], r), []).append(f"activation F{j} of stage {k - 1}")
            if kind == "B" and k > 0 and owner.get(k - 1, r) != r:
                sent.setdefault((r, owner[k - 1]), []).append(f"gradient B{j} of stage {k}")
            if kind == "B" and k + 1 < num_stages and owner.get(k + 1, r) != r:
                received.setdefault((owner[k + 1], r), []).append(f"gradient B{j} of stage {k + 1}")
    problems = []
    for a, b in sorted(set(sent) | set(received)):
        if sent.get((a, b), []) != received.get((a, b), []):
            problems.append(f"{case}: rank {a} sends rank {b} {sent.get((a, b), [])}, but rank {b} receives from rank "
                            f"{a} in the order {received.get((a, b), [])}; messages between two ranks are matched in "
                            "posting order, so the orders must agree")
    return problems


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


def _pp_fresh_list_problems(calls: dict) -> list[str]:
    """A schedule is the caller's to keep or edit: every rank's row is its own list (an edit of one row changes no
    other), and every call returns new lists (an edit of a result changes no later result)."""
    problems = []
    for name, call in calls.items():
        first = call()
        pristine = [list(row) for row in first]
        first[0].append(("F", 99))
        if any(("F", 99) in row for row in first[1:]):
            problems.append(f"{name}: appending to rank 0's row changed another rank's: the rows are one list")
        again = call()
        if [list(row) for row in again] != pristine:
            problems.append(f"{name}: after the caller edited a first result, a second call returned {again}")
    return problems


def test_2_6_schedules_are_new_lists_per_rank_and_per_call(grade):
    """GPipe's rows, alike on every stage, and 1F1B's, on (3, 3): one list per rank, new lists per call."""
    mod = grade("2.6").load()
    assert_no_problems(_pp_fresh_list_problems({f"{name}(3, 3)": (lambda fn=fn: fn(3, 3))
                                                for name, fn in _pp_schedule_fns(mod).items()}))


def test_2_6_schedules_are_new_lists_per_rank_and_per_call_interleaved(grade):
    mod = grade("2.6").load()
    assert_no_problems(_pp_fresh_list_problems({"interleaved_schedule(3, 3, 2)":
                                                lambda: mod.interleaved_schedule(3, 3, 2)}))


def test_2_6_schedules_are_new_lists_per_rank_and_per_call_zero_bubble(grade):
    mod = grade("2.6").load()
    assert_no_problems(_pp_fresh_list_problems({"zero_bubble_schedule(3, 3)": lambda: mod.zero_bubble_schedule(3, 3)}))


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


_PP_DISAGREEING = [[("F", 1), ("F", 0), ("B", 0), ("B", 1)], [("F", 0), ("F", 2), ("B", 0), ("F", 1), ("B", 2), ("B", 1)],
                   [("F", 0), ("B", 0)]]
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
        actions[index] = ("X", j)
    else:
        actions[index] = (kind, m)
    return [actions if s == stage else list(a) for s, a in enumerate(schedule)]


@_PP_PROPERTY
@given(schedule=_pp_any_schedule(max_stages=4, max_microbatches=4), where=st.tuples(st.integers(0, 3), st.integers(0, 7)))
def test_2_6_time_grid_rejects_malformed_schedules(grade, schedule, where):
    """A schedule with one stage's list broken (an action missing or repeated, a B before its F, a kind other than
    F, B and W, a micro-batch out of range), or whose stages disagree on the micro-batches (one stage has one fewer:
    its neighbour waits forever, maybe after the others finished), raises ValueError: each of these, on the
    drawn schedule."""
    mod = grade("2.6").load()
    with pytest.raises(ValueError):  # the last stage finishes while stage 1 waits for a micro-batch stage 0 never runs
        mod.time_grid(_PP_DISAGREEING)
        pytest.fail(f"time_grid accepted stages that disagree on the micro-batches: {_PP_DISAGREEING}", pytrace=False)
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


# ======================================================================= interleaved 1F1B and zero bubble
# Tests ending in _interleaved grade the interleaved schedule (virtual stages), those ending in _zero_bubble the
# split backward (B and W) and ZB-H1; the time grid, max_in_flight and the executor generalise to both.

INTERLEAVED_CASES = [(1, 1, 1), (1, 3, 3), (2, 2, 2), (2, 4, 3), (3, 3, 2), (3, 6, 2), (4, 4, 2), (4, 8, 3), (4, 4, 1),
                     (5, 10, 2), (6, 6, 4)]  # (p, m, v)
_PP_INTERLEAVED = st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 4)).map(
    lambda c: (c[0], c[0] * c[1], c[2]))  # m a multiple of p
INTERLEAVED_COSTS = [{"F": 1, "B": 1}, {"F": 1, "B": 2}, {"F": 2, "B": 3}]
# ZB-H1's bubble is (p-1)(t_F+t_B-t_W) when t_W <= t_F, t_B (each delayed W fits a gap) and m >= p
ZERO_BUBBLE_COSTS = [{"F": 1, "B": 1, "W": 1}, {"F": 2, "B": 2, "W": 1}, {"F": 1, "B": 2, "W": 1},
                     {"F": 2, "B": 1, "W": 1}, {"F": 3, "B": 2, "W": 2}]


def _pp_cases(name, cases):
    def add(test):
        for case in cases:
            test = example(**{name: case})(test)
        return test
    return add


def _pp_schedule_text(schedule) -> str:
    return "\n".join(f"  rank {r}: {' '.join(''.join(map(str, a)) for a in actions)}" for r, actions in enumerate(schedule))


def _pp_interleaved_problems(schedule, p: int, m: int, v: int, case: str) -> list[str]:
    """Rank r holds virtual stages r, r+p, ..., r+(v-1)p; each runs every F and B once, F(j) before B(j), no W."""
    if len(schedule) != p:
        return [f"{case}: {len(schedule)} rank lists, expected {p}"]
    problems = []
    for r, actions in enumerate(schedule):
        actions = [tuple(a) for a in actions]
        mine = [r + c * p for c in range(v)]
        expected = sorted((kind, j, k) for kind in "FB" for j in range(m) for k in mine)
        if any(len(a) != 3 for a in actions) or sorted(actions) != expected:
            problems.append(f"{case}: rank {r} runs {actions}; expected ('F', j, k) and ('B', j, k) exactly once for "
                            f"every j = 0..{m - 1} and each of its virtual stages k = {mine} (round-robin: rank r "
                            f"holds r, r+p, ..., r+(v-1)p)")
        elif any(actions.index(("B", j, k)) < actions.index(("F", j, k)) for j in range(m) for k in mine):
            problems.append(f"{case}: rank {r} runs a backward before its forward: {actions}")
    return problems or _pp_message_problems(schedule, case)


@_PP_PROPERTY
@given(case=_PP_INTERLEAVED)
@_pp_cases("case", INTERLEAVED_CASES)
def test_2_6_schedule_runs_every_action_once_interleaved(grade, case):
    """interleaved_schedule(p, m, v), any p, v and m a multiple of p: rank r holds virtual stages r, r+p, ...,
    every F and B of each once, F before B; what a rank sends another is what that one receives, in the same
    order; no deadlock."""
    mod = grade("2.6").load()
    p, m, v = case
    text = f"interleaved_schedule({p}, {m}, {v})"
    schedule = mod.interleaved_schedule(p, m, v)
    problems = _pp_interleaved_problems(schedule, p, m, v, text)
    if not problems and _pp_asap_grid(schedule) is None:
        problems.append(f"{text}: the schedule deadlocks (some action waits, through its dependencies, for itself):\n"
                        + _pp_schedule_text(schedule))
    assert_no_problems(problems)


@_PP_PROPERTY
@given(case=_PP_INTERLEAVED)
@_pp_cases("case", INTERLEAVED_CASES)
def test_2_6_bubble_and_in_flight_interleaved(grade, case):
    """interleaved_schedule(p, m, v) on the contract's time grid, F and B each costing t_F, t_B per chunk: at most
    (v*m+p-1)(t_F+t_B) steps, a bubble of at most (p-1)/(v*m+p-1) (1F1B's over v); rank r holds at most
    min(2(p-r-1) + (v-1)p + 1, v*m) chunks' activations at once (v = 1: 1F1B's min(p-r, m))."""
    mod = grade("2.6").load()
    p, m, v = case
    text = f"interleaved_schedule({p}, {m}, {v})"
    schedule = mod.interleaved_schedule(p, m, v)
    assert_no_problems(_pp_interleaved_problems(schedule, p, m, v, text))
    problems = []
    for costs in INTERLEAVED_COSTS:
        grid = _pp_asap_grid(schedule, costs)
        if grid is None:
            problems.append(f"{text}: the schedule deadlocks")
            break
        steps = (v * m + p - 1) * (costs["F"] + costs["B"])
        if len(grid) > steps:
            problems.append(f"{text}, costs {costs}: {len(grid)} steps, bubble "
                            f"{sum(c is None for row in grid for c in row) / (len(grid) * p):.3f}; interleaved 1F1B takes "
                            f"(v*m+p-1)(t_F+t_B) = {steps} (bubble (p-1)/(v*m+p-1) = {(p - 1) / (v * m + p - 1):.3f}):\n"
                            + _pp_grid_text(grid))
    for r, actions in enumerate(schedule):
        peak = max(_pp_in_flight_profile(actions), default=0)
        bound = min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) if v > 1 else min(p - r, m)
        if peak > bound:
            problems.append(f"{text}: rank {r} holds {peak} chunks' activations at once; interleaved 1F1B holds at "
                            + (f"most min(2(p-r-1) + (v-1)p + 1, v*m) = {bound} (its warm-up, plus the first steady F)"
                               if v > 1 else f"most min(p-r, m) = {bound} (v = 1 is 1F1B)"))
    assert_no_problems(problems)


def _pp_zero_bubble_problems(schedule, p: int, m: int, case: str) -> list[str]:
    """Every stage: F, B and W of every micro-batch once, F(j) before B(j) before W(j); neighbours run their F's,
    and their B's, in the same micro-batch order (W sends nothing)."""
    if len(schedule) != p:
        return [f"{case}: {len(schedule)} stage lists, expected {p}"]
    problems = []
    expected = sorted((kind, j) for kind in "FBW" for j in range(m))
    for s, actions in enumerate(schedule):
        actions = [tuple(a) for a in actions]
        if sorted(actions) != expected:
            problems.append(f"{case}: stage {s} runs {actions}; expected ('F', j), ('B', j) and ('W', j) exactly once "
                            f"for every j = 0..{m - 1} (every backward split into B and W)")
        elif any(not actions.index(("F", j)) < actions.index(("B", j)) < actions.index(("W", j)) for j in range(m)):
            problems.append(f"{case}: stage {s} runs a W before its B, or a B before its F: {actions}")
    return problems or _pp_order_problems([[a for a in actions if a[0] != "W"] for actions in schedule], p, m, case)


@_PP_PROPERTY
@given(case=_PP_SETTINGS)
@_pp_examples
def test_2_6_schedule_splits_every_backward_zero_bubble(grade, case):
    """zero_bubble_schedule(p, m), any (p, m): every stage runs F, B and W of every micro-batch once, in that order
    per micro-batch; neighbours in the same micro-batch order; no deadlock."""
    mod = grade("2.6").load()
    p, m = case
    text = f"zero_bubble_schedule({p}, {m})"
    schedule = mod.zero_bubble_schedule(p, m)
    problems = _pp_zero_bubble_problems(schedule, p, m, text)
    if not problems and _pp_asap_grid(schedule) is None:
        problems.append(f"{text}: the schedule deadlocks:\n" + _pp_schedule_text(schedule))
    assert_no_problems(problems)


@_PP_PROPERTY
@given(case=_PP_SETTINGS)
@_pp_examples
def test_2_6_bubble_and_in_flight_zero_bubble(grade, case):
    """zero_bubble_schedule(p, m) on the contract's time grid: with m >= p and t_W <= t_F, t_B, at most
    m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W) steps (1F1B: (m+p-1)(t_F+t_B+t_W)); with m < p no more than 1F1B's; at
    most p micro-batches in flight (F run, W not yet) on every stage, 1F1B's peak."""
    mod = grade("2.6").load()
    p, m = case
    text = f"zero_bubble_schedule({p}, {m})"
    schedule = mod.zero_bubble_schedule(p, m)
    assert_no_problems(_pp_zero_bubble_problems(schedule, p, m, text))
    problems = []
    for costs in ZERO_BUBBLE_COSTS:
        t_f, t_b, t_w = costs["F"], costs["B"], costs["W"]
        grid = _pp_asap_grid(schedule, costs)
        if grid is None:
            problems.append(f"{text}: the schedule deadlocks")
            break
        one_f_one_b = (m + p - 1) * (t_f + t_b + t_w)
        steps = m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w) if m >= p else one_f_one_b
        if len(grid) > steps:
            problems.append(f"{text}, costs {costs}: {len(grid)} steps; ZB-H1 takes "
                            + (f"m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W) = {steps}" if m >= p else
                               f"no more than 1F1B's (m+p-1)(t_F+t_B+t_W) = {steps} for m < p")
                            + " (do the W's fill the bubble?):\n" + _pp_grid_text(grid))
    for s, actions in enumerate(schedule):
        peak = max(_pp_in_flight_profile(actions), default=0)
        if peak > p:
            problems.append(f"{text}: stage {s} holds {peak} micro-batches in flight (F run, W not yet); ZB-H1 holds at "
                            f"most p = {p}, 1F1B's peak (are W's delayed further than they need?)")
    assert_no_problems(problems)


@pytest.mark.parametrize("call", [
    "interleaved_schedule(0, 4, 2)", "interleaved_schedule(2, 0, 2)", "interleaved_schedule(2, 4, 0)",
    "interleaved_schedule(4, 6, 2)", "interleaved_schedule(3, 2, 2)", "interleaved_schedule(2, 4, 1.0)",
    "interleaved_schedule(2.0, 4, 2)", "interleaved_schedule(2, 4, True)",
])
def test_2_6_invalid_settings_raise_value_error_interleaved(grade, call):
    mod = grade("2.6").load()
    with pytest.raises(ValueError):
        eval(call, {}, vars(mod))
        pytest.fail(f"{call} returned; expected ValueError (p, m and v are integers >= 1, and m is a multiple of p)",
                    pytrace=False)


@pytest.mark.parametrize("call", [
    "zero_bubble_schedule(0, 4)", "zero_bubble_schedule(3, 0)", "zero_bubble_schedule(3, -1)",
    "zero_bubble_schedule(3, 2.0)", "zero_bubble_schedule(1.5, 2)",
])
def test_2_6_invalid_settings_raise_value_error_zero_bubble(grade, call):
    mod = grade("2.6").load()
    with pytest.raises(ValueError):
        eval(call, {}, vars(mod))
        pytest.fail(f"{call} returned; expected ValueError (p and m are integers >= 1)", pytrace=False)


@st.composite
def _pp_any_general_schedule(draw, chunks: bool, weights: bool, max_ranks: int = 4, max_microbatches: int = 4):
    """A random schedule, as _pp_any_schedule, on virtual stages (chunks: v per rank, placed round-robin,
    contiguously or at random, actions (kind, j, k)) and/or with backwards split (weights: a W after some
    B's, anywhere later on its rank). Each rank interleaves its stages' lists at random. Many deadlock."""
    p, m = draw(st.integers(1, max_ranks)), draw(st.integers(1, max_microbatches))
    v = draw(st.integers(1, 3)) if chunks else 1
    num_stages = v * p
    if not chunks:
        placement = list(range(p))
    else:
        placement = draw(st.sampled_from([[k % p for k in range(num_stages)], [k // v for k in range(num_stages)],
                                          None]))
        placement = placement or draw(st.lists(st.integers(0, p - 1), min_size=num_stages, max_size=num_stages))
    f_order, b_order = draw(st.permutations(range(m))), draw(st.permutations(range(m)))
    per_stage = []
    for k in range(num_stages):
        actions, done, f, b = [], set(), 0, 0
        while b < m:
            if f < m and (b_order[b] not in done or draw(st.booleans())):
                actions.append(("F", f_order[f]))
                done.add(f_order[f])
                f += 1
            else:
                actions.append(("B", b_order[b]))
                b += 1
        if weights:
            for j in range(m):
                if draw(st.booleans()):
                    actions.insert(draw(st.integers(actions.index(("B", j)) + 1, len(actions))), ("W", j))
        per_stage.append([(kind, j, k) if chunks else (kind, j) for kind, j in actions])
    schedule = []
    for r in range(p):
        queues = [list(per_stage[k]) for k in range(num_stages) if placement[k] == r]
        row = []
        while any(queues):
            row.append(draw(st.sampled_from([q for q in queues if q])).pop(0))
        schedule.append(row)
    return schedule


_PP_COSTS = st.one_of(st.none(), st.fixed_dictionaries({"F": st.integers(1, 3), "B": st.integers(1, 3)},
                                                       optional={"W": st.integers(1, 3)}))


def _pp_check_any_grid(mod, schedule, costs) -> None:
    given_schedule, given_costs = copy.deepcopy(schedule), copy.deepcopy(costs)
    expected = _pp_asap_grid(schedule, costs)
    text = _pp_schedule_text(schedule) + f"\n  costs {costs}"
    if expected is None:
        with pytest.raises(ValueError):
            mod.time_grid(given_schedule, given_costs)
            pytest.fail(f"time_grid returned a grid for a schedule that deadlocks (some action waits for itself "
                        f"through its dependencies); expected ValueError:\n{text}", pytrace=False)
    else:
        grid = mod.time_grid(given_schedule, given_costs)
        got = [[None if a is None else tuple(a) for a in row] for row in grid]
        assert got == expected, (f"time_grid of\n{text}\ngave {len(got)} steps:\n{_pp_grid_text(got)}\nexpected "
                                 f"{len(expected)} steps (each action starts when its rank's previous action and its "
                                 f"dependencies have finished, and takes costs[kind] steps):\n{_pp_grid_text(expected)}")
    assert given_schedule == schedule, f"time_grid modified the schedule it was given:\n{text}\ninto {given_schedule}"


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=True, weights=False), costs=_PP_COSTS)
def test_2_6_time_grid_of_any_schedule_interleaved(grade, schedule, costs):
    """Random schedules on virtual stages (v per rank, placed round-robin, contiguously or at random; random orders
    and interleavings), F and B costing 1 to 3 steps: exactly the grid where each action starts when its rank's
    previous action and its dependencies (F(k-1, j); B(k+1, j) and F(k, j)) have finished, or ValueError where the
    schedule deadlocks; the schedule is left unchanged."""
    _pp_check_any_grid(grade("2.6").load(), schedule, costs)


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=False, weights=True, max_ranks=5), costs=_PP_COSTS)
def test_2_6_time_grid_of_any_schedule_zero_bubble(grade, schedule, costs):
    """Random schedules with some backwards split into B and W (W anywhere after its B), F, B and W costing 1 to 3
    steps: exactly the contract's grid (W(j) after B(j); B(j) waits for the next stage's B(j) only), or ValueError
    where the schedule deadlocks; the schedule is left unchanged. Also 1F1B with B twice F: 3(m+p-1) steps."""
    mod = grade("2.6").load()
    _pp_check_any_grid(mod, schedule, costs)
    for p, m in [(3, 4), (4, 2)]:
        grid = mod.time_grid(grading.reference("2.6").one_f_one_b_schedule(p, m), {"F": 1, "B": 2})
        assert len(grid) == 3 * (m + p - 1), (f"time_grid(1F1B({p}, {m}), costs F=1, B=2): {len(grid)} steps, expected "
                                              f"(m+p-1)(t_F+t_B) = {3 * (m + p - 1)}:\n{_pp_grid_text(grid)}")


_PP_BAD_COSTS = [{"B": 0}, {"F": -1}, {"W": 1.5}, {"B": True}, {"X": 1}, {"F": "2"}]


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=False, weights=True), where=st.integers(0, 99))
def test_2_6_time_grid_rejects_malformed_schedules_zero_bubble(grade, schedule, where):
    """A W moved before its B, a W repeated, a W of a micro-batch that has no B; and costs that are not integers
    >= 1 for F, B and W: ValueError."""
    mod = grade("2.6").load()
    weights = [(r, i) for r, actions in enumerate(schedule) for i, a in enumerate(actions) if a[0] == "W"]
    bad = []
    if weights:
        r, i = weights[where % len(weights)]
        actions, m = list(schedule[r]), len(schedule[r]) // 2
        w = actions.pop(i)
        before = actions[: actions.index(("B", w[1]))] + [w] + actions[actions.index(("B", w[1])):]
        bad += [("a W before its B", before), ("a W twice", actions[:i] + [w, w] + actions[i:]),
                ("a W with no B", actions + [("W", m)])]
    for how, actions in bad:
        broken = [actions if s == r else a for s, a in enumerate(schedule)]
        with pytest.raises(ValueError):
            mod.time_grid(broken)
            pytest.fail(f"time_grid accepted a malformed schedule ({how}, rank {r}):\n{_pp_schedule_text(broken)}",
                        pytrace=False)
    for costs in _PP_BAD_COSTS:
        with pytest.raises(ValueError):
            mod.time_grid(schedule, costs)
            pytest.fail(f"time_grid accepted costs {costs}; expected ValueError (integers >= 1 for F, B, W)",
                        pytrace=False)


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=True, weights=False), where=st.integers(0, 99))
def test_2_6_time_grid_rejects_malformed_schedules_interleaved(grade, schedule, where):
    """A virtual stage on two ranks (its actions copied onto a second rank), a negative virtual stage, an action of
    four elements: ValueError."""
    mod = grade("2.6").load()
    p = len(schedule)
    cells = [(r, i) for r, actions in enumerate(schedule) for i in range(len(actions))]
    r, i = cells[where % len(cells)]
    k = schedule[r][i][2]
    kind, j = schedule[r][i][:2]
    twice = [actions + ([a for a in schedule[r] if a[2] == k] if s == (r + 1) % p and p > 1 else []) for s, actions
             in enumerate(schedule)]
    cases = {"a virtual stage on two ranks": twice if p > 1 else None,
             "a negative virtual stage": [a[:i] + [(kind, j, -1)] + a[i + 1:] if s == r else a
                                          for s, a in enumerate(schedule)],
             "an action of four elements": [a[:i] + [(kind, j, k, 0)] + a[i + 1:] if s == r else a
                                            for s, a in enumerate(schedule)]}
    for how, broken in cases.items():
        if broken is None:
            continue
        with pytest.raises(ValueError):
            mod.time_grid(broken)
            pytest.fail(f"time_grid accepted a malformed schedule ({how}):\n{_pp_schedule_text(broken)}", pytrace=False)


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=True, weights=True, max_microbatches=6))
def test_2_6_max_in_flight_counts_each_chunk_interleaved(grade, schedule):
    """Every rank's list of random schedules on virtual stages (some backwards split), and of the reference's
    interleaved schedules: the high-water mark of (virtual stage, micro-batch) pairs forwarded and not yet released
    (by their W if the list has one, else by their B), each chunk apart (F0 on chunk 0 and F0 on chunk 1 are two
    micro-batches' worth of activations)."""
    mod = grade("2.6").load()
    reference = grading.reference("2.6")
    lists = schedule + [a for p, m, v in [(4, 8, 2), (2, 4, 3), (3, 3, 2)] for a in reference.interleaved_schedule(p, m, v)]
    for actions in lists:
        given_actions = copy.deepcopy(actions)
        got, expected = mod.max_in_flight(given_actions), max(_pp_in_flight_profile(actions), default=0)
        assert got == expected, f"max_in_flight({actions}) = {got}, expected {expected}"
        assert given_actions == actions, f"max_in_flight({actions}) modified its argument into {given_actions}"


@_PP_PROPERTY
@given(schedule=_pp_any_general_schedule(chunks=False, weights=True, max_microbatches=6))
def test_2_6_max_in_flight_until_the_weight_gradient_zero_bubble(grade, schedule):
    """Every stage of random schedules with some backwards split, and of the reference's ZB-H1: a micro-batch is in
    flight from its F to its W when it has one (W needs the layers' inputs), else to its B."""
    mod = grade("2.6").load()
    lists = schedule + [a for p, m in [(4, 8), (3, 5), (4, 2)] for a in grading.reference("2.6").zero_bubble_schedule(p, m)]
    for actions in lists:
        given_actions = copy.deepcopy(actions)
        got, expected = mod.max_in_flight(given_actions), max(_pp_in_flight_profile(actions), default=0)
        assert got == expected, f"max_in_flight({actions}) = {got}, expected {expected}"
        assert given_actions == actions, f"max_in_flight({actions}) modified its argument into {given_actions}"


@pytest.mark.parametrize("p, m, v", [(4, 4, 2), (4, 8, 3), (2, 6, 2), (3, 3, 1)])
def test_2_6_bubble_fraction_matches_formula_interleaved(grade, p, m, v):
    """time_grid and bubble_fraction of the reference's interleaved schedule: (v*m+p-1)(t_F+t_B) steps and a bubble
    of (p-1)/(v*m+p-1), 1F1B's over v, whatever the costs."""
    mod = grade("2.6").load()
    schedule = grading.reference("2.6").interleaved_schedule(p, m, v)
    problems = []
    for costs in INTERLEAVED_COSTS:
        grid = mod.time_grid(schedule, costs)
        steps, expected = (v * m + p - 1) * (costs["F"] + costs["B"]), (p - 1) / (v * m + p - 1)
        bubble = mod.bubble_fraction(grid)
        if len(grid) != steps or bubble != pytest.approx(expected, abs=1e-12):
            problems.append(f"interleaved({p}, {m}, {v}), costs {costs}: {len(grid)} steps and bubble {bubble:.4f}; "
                            f"expected {steps} and (p-1)/(v*m+p-1) = {expected:.4f}\n" + render_timeline(grid))
    assert_no_problems(problems)


@pytest.mark.parametrize("p, m", [(4, 8), (3, 3), (4, 4), (2, 5)])
def test_2_6_bubble_fraction_matches_formula_zero_bubble(grade, p, m):
    """time_grid and bubble_fraction of the reference's ZB-H1 (m >= p, t_W <= t_F, t_B): m(t_F+t_B+t_W) +
    (p-1)(t_F+t_B-t_W) steps, idle (p-1)(t_F+t_B-t_W) per stage; 1F1B with B and W fused idles (p-1)(t_F+t_B+t_W)."""
    mod = grade("2.6").load()
    reference = grading.reference("2.6")
    problems = []
    for costs in ZERO_BUBBLE_COSTS:
        t_f, t_b, t_w = costs["F"], costs["B"], costs["W"]
        grid = mod.time_grid(reference.zero_bubble_schedule(p, m), costs)
        idle = (p - 1) * (t_f + t_b - t_w)
        steps = m * (t_f + t_b + t_w) + idle
        if len(grid) != steps or mod.bubble_fraction(grid) != pytest.approx(idle / steps, abs=1e-12):
            problems.append(f"ZB-H1({p}, {m}), costs {costs}: {len(grid)} steps, bubble {mod.bubble_fraction(grid):.4f}; "
                            f"expected {steps} and {idle / steps:.4f}\n" + render_timeline(grid))
        fused = mod.time_grid(reference.one_f_one_b_schedule(p, m), {"F": t_f, "B": t_b + t_w})
        if len(fused) != (m + p - 1) * (t_f + t_b + t_w):
            problems.append(f"1F1B({p}, {m}), costs F={t_f}, B={t_b + t_w}: {len(fused)} steps, expected "
                            f"(m+p-1)(t_F+t_B+t_W) = {(m + p - 1) * (t_f + t_b + t_w)}")
    assert_no_problems(problems)


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


# ----------------------------------------------------------------------------- the executor, extended

_P2P_NAMES = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def _pp_renamed(schedule, order: list[int]) -> list:
    """The same schedule with micro-batch j renamed order[j] (actions of any length)."""
    return [[(a[0], order[a[1]], *a[2:]) for a in actions] for actions in schedule]


def _pp_v_shape(p: int, m: int) -> list:
    """Rank r holds virtual stages r and 2p-1-r (a V: stages p-1 and p on the last rank, the loss on rank 0);
    GPipe order: each stage's forwards in stage order, then the backwards in reverse stage order."""
    schedule = []
    for r in range(p):
        low, high = r, 2 * p - 1 - r
        schedule.append([("F", j, low) for j in range(m)] + [("F", j, high) for j in range(m)]
                        + [("B", j, high) for j in range(m)] + [("B", j, low) for j in range(m)])
    return schedule


def _pp_split_after_b(schedule, which=lambda j: True) -> list:
    """Every ("B", j[, k]) for which which(j) is true followed at once by its ("W", j[, k])."""
    return [[b for a in actions for b in ([a, ("W", *a[1:])] if a[0] == "B" and which(a[1]) else [a])]
            for actions in schedule]


def _pp_split_stages(schedule, which) -> list:
    """Every ("B", j, k) whose virtual stage k satisfies which(k) followed at once by its ("W", j, k): a rank whose
    chunks differ, one split and one whole, for the same micro-batches."""
    return [[b for a in actions for b in ([a, ("W", *a[1:])] if a[0] == "B" and which(a[2]) else [a])]
            for actions in schedule]


def _pp_weights_last(schedule) -> list:
    """The same actions, each rank's W's moved to its end (in the order they came)."""
    return [[a for a in actions if a[0] != "W"] + [a for a in actions if a[0] == "W"] for actions in schedule]


INTERLEAVED_MICROBATCHES = (3, 6)  # p = 3, v = 2: PIPE_HIDDEN's 8 layers in 6 virtual stages (2 without parameters)
# Valid schedules on virtual stages, built from the reference's, for the executor: name -> (build(ref, p), placement(p), m)
INTERLEAVED_OTHER = {
    "interleaved 1F1B(3, 6, 2), the reference's": (lambda ref, p: ref.interleaved_schedule(p, 6, 2),
                                                   lambda p: [k % p for k in range(2 * p)], 6),
    "interleaved 1F1B(3, 3, 2), micro-batches in order 2 0 1": (
        lambda ref, p: _pp_renamed(ref.interleaved_schedule(p, 3, 2), [2, 0, 1]), lambda p: [k % p for k in range(2 * p)], 3),
    "interleaved 1F1B(3, 3, 2), every backward split, W right after its B": (
        lambda ref, p: _pp_split_after_b(ref.interleaved_schedule(p, 3, 2)), lambda p: [k % p for k in range(2 * p)], 3),
    "interleaved 1F1B(3, 3, 2), only the second chunk's backwards split (the first chunk's whole)": (
        lambda ref, p: _pp_split_stages(ref.interleaved_schedule(p, 3, 2), lambda k: k >= p),
        lambda p: [k % p for k in range(2 * p)], 3),
    "V-shape placement (rank r holds stages r and 2p-1-r, the loss on rank 0), GPipe order": (
        lambda ref, p: _pp_v_shape(p, 3), lambda p: list(range(p)) + list(reversed(range(p))), 3),
}


def _pp_run_chunks(mod, schedule, ranks: list[int], layers, x, y, m: int) -> dict:
    """This rank's row of `schedule`, run by the implementation's run_pipeline on the virtual stages the placement
    `ranks` gives it (the reference's VirtualStage); layers held, gradients, loss and the p2p ops it posted."""
    reference = grading.reference("2.6")
    rank = dist.get_rank()
    chunks = [reference.VirtualStage(layers, k, len(ranks), ranks, device=current_device())
              for k in range(len(ranks)) if ranks[k] == rank]
    layers.zero_grad(set_to_none=True)
    xs = reference.split_microbatches(x, m) if ranks[0] == rank else None
    ys = reference.split_microbatches(y, m) if ranks[-1] == rank else None
    posted, started = [], [0]  # p2p ops (kind, peer, floating, numel, computations started before it)

    def count(*_):
        started[0] += 1

    hooks = [hook(count) for chunk in chunks for hook in (chunk.register_forward_pre_hook,
                                                          chunk.register_full_backward_pre_hook)]
    with PointToPointLog(names=_P2P_NAMES, on_op=lambda kind, peer, t: posted.append(
            (kind, peer, t.is_floating_point(), t.numel(), started[0]))):
        loss = mod.run_pipeline(schedule[rank], chunks, xs, ys, F.cross_entropy)
    for hook in hooks:
        hook.remove()
    grads = {key: grad for chunk in chunks for key, grad in _pp_stage_grads(chunk).items()}
    return {"layers": sorted(i for chunk in chunks for i in chunk.layer_range), "grads": grads, **_pp_loss(loss),
            "posted": posted, "ranks": ranks, "actions": [tuple(a) for a in schedule[rank]]}


def _interleaved_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int, microbatch_counts) -> dict:
    """The implementation's interleaved schedules (p = 3, v = 2) run by its executor; then INTERLEAVED_OTHER run by
    its executor; then, on rank 0 alone, interleaved 1F1B(1, 3, 3): three chunks on one rank, no message."""
    mod, reference = ref.load(), grading.reference("2.6")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # NCCL: the group's first collective must involve every rank (see Mailbox)
    layers, (x, y) = _pp_layers(hidden), _pp_batch(batch)
    results = {}
    for m in microbatch_counts:
        case = f"interleaved_schedule({world}, {m}, 2)"
        try:
            schedule = mod.interleaved_schedule(world, m, 2)
        except NotImplementedError as exc:
            results[("parity", m)] = {"todo": str(exc)}  # the same on every rank: no hang
            continue
        problems = _pp_interleaved_problems(schedule, world, m, 2, case)
        if not problems and _pp_asap_grid(schedule) is None:
            problems.append(f"{case}: the schedule deadlocks")
        if problems:  # every rank sees the same schedule, so every rank skips it: no hang
            results[("parity", m)] = {"problems": problems}
            continue
        results[("parity", m)] = _pp_run_chunks(mod, schedule, [k % world for k in range(2 * world)], layers, x, y, m)
    for name, (build, placement, m) in INTERLEAVED_OTHER.items():
        results[("other", name)] = _pp_run_chunks(mod, build(reference, world), placement(world), layers, x, y, m)
    if rank == 0:
        results["alone"] = _pp_run_chunks(mod, reference.interleaved_schedule(1, 3, 3), [0, 0, 0], layers, x, y, 3)
    return results


_interleaved_worlds: dict = {}


def _interleaved_results(ref: grading.ModuleRef) -> list[dict]:
    return _pp_shared_world(_interleaved_worlds, ref, _interleaved_rank, PIPE_STAGES,
                            (PIPE_HIDDEN, PIPE_BATCH, INTERLEAVED_MICROBATCHES))


def _pp_placed_problems(per_rank: list[dict], what: str) -> list[str]:
    """Every layer held by one rank, the loss on the rank holding the last stage only (detached, equal to the unsplit
    model's), every gradient equal to the unsplit model's (1e-4)."""
    loss, grads = _pp_expected(PIPE_HIDDEN, PIPE_BATCH)
    num_layers = 2 * len(PIPE_HIDDEN) + 2
    problems = []
    holders = {i: [r for r, res in enumerate(per_rank) if i in res["layers"]] for i in range(num_layers)}
    problems += [f"{what}: layer {i} is held by ranks {ranks}, expected exactly one" for i, ranks in holders.items()
                 if len(ranks) != 1]
    last = per_rank[0]["ranks"][-1] if "ranks" in per_rank[0] else len(per_rank) - 1
    for rank, res in enumerate(per_rank):
        if rank != last and res["loss"] is not None:
            problems.append(f"{what}: rank {rank} returned a loss; only rank {last}, holding the last stage, computes it")
    if per_rank[last]["loss"] is None:
        problems.append(f"{what}: rank {last}, holding the last stage, returned no loss")
    elif per_rank[last]["loss_attached"]:
        problems.append(f"{what}: the loss returned on rank {last} still requires grad: return it detached")
    elif abs(per_rank[last]["loss"] - loss) > 1e-5 * max(1.0, abs(loss)):
        problems.append(f"{what}: loss {per_rank[last]['loss']:.6g} on rank {last}, the unsplit model gives {loss:.6g}")
    for rank, res in enumerate(per_rank):
        for key, grad in res["grads"].items():
            if grad is None:
                problems.append(f"{what}: rank {rank} has no gradient for {key}")
            elif (problem := diff_report(grad, grads[key], f"{what}: rank {rank} {key} gradient", rtol=1e-4, atol=1e-6)):
                problems.append(problem)
    return problems


def _pp_world_entry(per_rank: list[dict], what: str) -> list[str] | None:
    """TODO (raised) or the schedule's problems (returned), else None: the run happened."""
    if "todo" in per_rank[0]:
        raise NotImplementedError(per_rank[0]["todo"])
    if "problems" in per_rank[0]:
        return [f"not run, the schedule is invalid: {p}" for p in per_rank[0]["problems"]]
    return None


def test_2_6_matches_one_process_interleaved(grade):
    """Your interleaved_schedule(3, m, 2), m = 3 and 6, run by your run_pipeline on 6 virtual stages (rank r holding
    stages r and r + 3; two of them without parameters): loss and every gradient equal the unsplit model's."""
    results = _interleaved_results(grade("2.6"))
    problems = []
    for m in INTERLEAVED_MICROBATCHES:
        per_rank = [r[("parity", m)] for r in results]
        what = f"interleaved_schedule({PIPE_STAGES}, {m}, 2)"
        skipped = _pp_world_entry(per_rank, what)
        problems += skipped if skipped is not None else _pp_placed_problems(per_rank, what)
    assert_no_problems(problems, "run_pipeline on virtual stages differs from the unsplit model on the whole batch:")


def test_2_6_executor_runs_any_valid_schedule_interleaved(grade):
    """Your run_pipeline on other valid schedules on virtual stages: interleaved 1F1B with micro-batches relabelled,
    with every backward split into B and W, with only one chunk's backwards split (a split belongs to a stage's
    micro-batch, not to the micro-batch), a V-shaped placement (two neighbouring stages on one rank hand over
    without a message; the last stage, and the loss, on rank 0), and three chunks on a single rank."""
    results = _interleaved_results(grade("2.6"))
    problems = []
    for name in INTERLEAVED_OTHER:
        problems += _pp_placed_problems([r[("other", name)] for r in results], name)
    alone = results[0]["alone"]
    problems += _pp_placed_problems([alone], "interleaved 1F1B(1, 3, 3): three chunks on rank 0 alone")
    assert_no_problems(problems, "run_pipeline must run the row it is given on the stages it is given: F(j, k) on "
                       "virtual stage k takes input j (first stage) and target j (last stage):")


def test_2_6_messages_per_rank_interleaved(grade):
    """The point-to-point messages your run_pipeline posts, per rank and peer, are those the schedule implies: an
    activation (plus its header) for each F whose next stage is on another rank, an input gradient for each B whose
    previous stage is; none between two stages of one rank. Interleaved 1F1B on p ranks sends v times 1F1B's."""
    results = _interleaved_results(grade("2.6"))
    problems = []
    runs = {f"interleaved_schedule({PIPE_STAGES}, {m}, 2)": [r[("parity", m)] for r in results]
            for m in INTERLEAVED_MICROBATCHES if "layers" in results[0][("parity", m)]}
    runs.update({name: [r[("other", name)] for r in results] for name in INTERLEAVED_OTHER})
    runs["interleaved 1F1B(1, 3, 3), rank 0 alone"] = [results[0]["alone"]]
    for what, per_rank in runs.items():
        ranks = per_rank[0]["ranks"]
        for rank, res in enumerate(per_rank):
            expected: dict[int, int] = {}
            for kind, j, k in (_pp_norm(rank, a) for a in res["actions"]):
                if kind == "F" and k + 1 < len(ranks) and ranks[k + 1] != rank:
                    expected[ranks[k + 1]] = expected.get(ranks[k + 1], 0) + 1
                if kind == "B" and k > 0 and ranks[k - 1] != rank:
                    expected[ranks[k - 1]] = expected.get(ranks[k - 1], 0) + 1
            got: dict[int, int] = {}
            for kind, peer, floating, _, _ in res["posted"]:
                if kind == "send" and floating:
                    got[peer] = got.get(peer, 0) + 1
            if got != expected:
                problems.append(f"{what}: rank {rank} sent {dict(sorted(got.items()))} tensors (peer: count, headers "
                                f"aside), expected {dict(sorted(expected.items()))}: one per activation or gradient that "
                                "crosses to another rank, none between two stages on the same rank")
        if len(per_rank) == 1 and per_rank[0]["posted"]:
            problems.append(f"{what}: rank 0 alone posted {len(per_rank[0]['posted'])} point-to-point ops; its stages "
                            "hand activations and gradients over in memory")
    assert_no_problems(problems)


ZERO_BUBBLE_MICROBATCHES = (2, 3, 5)  # m < p, = p, > p
ZERO_BUBBLE_RECORDED = (3, 5)
ZERO_BUBBLE_OTHER = {  # name -> (build(ref, p), m): valid schedules with split backwards, for the executor
    "ZB-H1(3, 3), every W at the end of its stage": (lambda ref, p: _pp_weights_last(ref.zero_bubble_schedule(p, 3)), 3),
    "ZB-H1(3, 3), micro-batches in order 2 0 1": (lambda ref, p: _pp_renamed(ref.zero_bubble_schedule(p, 3), [2, 0, 1]), 3),
    "1F1B(3, 5), only the even micro-batches split, W right after B": (
        lambda ref, p: _pp_split_after_b(ref.one_f_one_b_schedule(p, 5), lambda j: j % 2 == 0), 5),
    "GPipe(3, 3) split, the W's last in order 2 0 1": (
        lambda ref, p: [a + [("W", 2), ("W", 0), ("W", 1)] for a in ref.gpipe_schedule(p, 3)], 3),
}


def _zero_bubble_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int, microbatch_counts) -> dict:
    """The implementation's ZB-H1 run by its executor (parity); the reference's ZB-H1 run by its executor under a
    StageRecorder, the stage's gradients read at each input gradient it sends back; ZERO_BUBBLE_OTHER (parity); on
    rank 0 alone, ZB-H1(1, 3)."""
    mod, reference = ref.load(), grading.reference("2.6")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # NCCL: the group's first collective must involve every rank (see Mailbox)
    stage = grading.reference("2.5").PipelineStage(_pp_layers(hidden), rank, world, device=current_device())
    x, y = _pp_batch(batch)

    def run(schedule, m: int) -> dict:
        xs = reference.split_microbatches(x, m) if rank == 0 else None
        ys = reference.split_microbatches(y, m) if rank == world - 1 else None
        stage.zero_grad(set_to_none=True)
        loss = mod.run_pipeline(schedule[rank], stage, xs, ys, F.cross_entropy)
        return {"layers": list(stage.layer_range), "grads": _pp_stage_grads(stage), **_pp_loss(loss)}

    results = {}
    for m in microbatch_counts:
        case = f"zero_bubble_schedule({world}, {m})"
        try:
            schedule = mod.zero_bubble_schedule(world, m)
        except NotImplementedError as exc:
            results[("parity", m)] = {"todo": str(exc)}
            continue
        problems = _pp_zero_bubble_problems(schedule, world, m, case)
        if not problems and _pp_asap_grid(schedule) is None:
            problems.append(f"{case}: the schedule deadlocks")
        results[("parity", m)] = {"problems": problems} if problems else run(schedule, m)
    for m in ZERO_BUBBLE_RECORDED:
        schedule = reference.zero_bubble_schedule(world, m)
        xs = reference.split_microbatches(x, m) if rank == 0 else None
        ys = reference.split_microbatches(y, m) if rank == world - 1 else None
        stage.zero_grad(set_to_none=True)
        at_sends = []  # the stage's gradients when each input gradient goes back to the previous stage

        def seen(kind, peer, tensor):
            if kind == "send" and peer == rank - 1 and tensor.is_floating_point():
                at_sends.append(_pp_stage_grads(stage))

        with StageRecorder(stage, exclude=xs or ()) as recorder, PointToPointLog(names=_P2P_NAMES, on_op=seen):
            mod.run_pipeline(schedule[rank], stage, xs, ys, F.cross_entropy)
        results[("recorded", m)] = {"actions": [tuple(a) for a in schedule[rank]], "at_sends": at_sends,
                                    "peak_bytes": recorder.peak_bytes, "one_forward_bytes": recorder.held_after_forward[0]}
    for name, (build, m) in ZERO_BUBBLE_OTHER.items():
        results[("other", name)] = run(build(reference, world), m)
    if rank == 0:
        alone = grading.reference("2.5").PipelineStage(_pp_layers(hidden), 0, 1, device=current_device())
        loss = mod.run_pipeline(reference.zero_bubble_schedule(1, 3)[0], alone, reference.split_microbatches(x, 3),
                                reference.split_microbatches(y, 3), F.cross_entropy)
        results["alone"] = {"layers": list(alone.layer_range), "grads": _pp_stage_grads(alone), **_pp_loss(loss)}
    return results


_zero_bubble_worlds: dict = {}


def _zero_bubble_results(ref: grading.ModuleRef) -> list[dict]:
    return _pp_shared_world(_zero_bubble_worlds, ref, _zero_bubble_rank, PIPE_STAGES,
                            (PIPE_HIDDEN, PIPE_BATCH, ZERO_BUBBLE_MICROBATCHES))


def test_2_6_matches_one_process_zero_bubble(grade):
    """Your zero_bubble_schedule(3, m), m = 2, 3, 5, run by your run_pipeline: loss and every gradient equal the
    unsplit model's (each W accumulates its micro-batch's weight gradients; none is lost or counted twice)."""
    results = _zero_bubble_results(grade("2.6"))
    problems = []
    for m in ZERO_BUBBLE_MICROBATCHES:
        per_rank = [r[("parity", m)] for r in results]
        what = f"zero_bubble_schedule({PIPE_STAGES}, {m})"
        skipped = _pp_world_entry(per_rank, what)
        problems += skipped if skipped is not None else _pp_placed_problems(per_rank, what)
    assert_no_problems(problems, "run_pipeline with split backwards (B, then W) differs from the unsplit model:")


def test_2_6_executor_runs_any_valid_schedule_zero_bubble(grade):
    """Your run_pipeline on other valid schedules with split backwards: every W at the end, micro-batches relabelled,
    only some backwards split (the others whole), GPipe with its W's in another order; and one stage alone."""
    results = _zero_bubble_results(grade("2.6"))
    problems = []
    for name in ZERO_BUBBLE_OTHER:
        problems += _pp_placed_problems([r[("other", name)] for r in results], name)
    problems += _pp_placed_problems([results[0]["alone"]], "ZB-H1(1, 3), one stage holding every layer")
    assert_no_problems(problems, "run_pipeline must run the row it is given: ('B', j) followed by a ('W', j) computes the "
                       "input gradient only, the W the weight gradients; a B without a W the whole backward:")


def _pp_microbatch_grads(m: int) -> list[dict[str, torch.Tensor]]:
    """Each micro-batch's share of the unsplit model's gradient (its mean loss divided by m), by layer."""
    x, y = _pp_batch(PIPE_BATCH)
    shares = []
    for xj, yj in zip(x.chunk(m), y.chunk(m)):
        layers = _pp_layers(PIPE_HIDDEN)
        (F.cross_entropy(layers(xj), yj) / m).backward()
        shares.append({f"layer {i} {n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()})
    return shares


def test_2_6_weight_gradients_computed_at_w_zero_bubble(grade):
    """The reference's ZB-H1(3, m), m = 3 and 5, run by your run_pipeline: when a stage's B(j) sends its input
    gradient back (it must leave before the stage computes anything else, a W included), the stage's .grad holds
    exactly the weight gradients of the W's it ran before B(j): B computes the input gradient only, and each W adds
    its micro-batch's weight gradient."""
    results = _zero_bubble_results(grade("2.6"))
    problems = []
    for m in ZERO_BUBBLE_RECORDED:
        shares = _pp_microbatch_grads(m)
        for rank in range(1, PIPE_STAGES):
            res = results[rank][("recorded", m)]
            actions, snapshots = res["actions"], res["at_sends"]
            backwards = [i for i, a in enumerate(actions) if a[0] == "B"]
            if len(snapshots) != len(backwards):
                problems.append(f"ZB-H1({PIPE_STAGES}, {m}), stage {rank}: {len(snapshots)} input gradients sent back, "
                                f"expected one per B ({len(backwards)})")
                continue
            for i, snapshot in zip(backwards, snapshots):
                done = [a[1] for a in actions[:i] if a[0] == "W"]
                text = " ".join(f"{k}{j}" for k, j in actions)
                for key, grad in snapshot.items():
                    expected = sum((shares[j][key] for j in done), torch.zeros_like(shares[0][key]))
                    grad = torch.zeros_like(expected) if grad is None else grad
                    if diff_report(grad, expected, "", rtol=1e-4, atol=1e-6):
                        problems.append(f"ZB-H1({PIPE_STAGES}, {m}), stage {rank} ({text}): when B{actions[i][1]}'s "
                                        f"input gradient left, {key}'s .grad was not the sum of the weight gradients of "
                                        f"the W's run before it ({done}): does B compute only the input gradient, and "
                                        "does it leave before the next action computes (a W's box.post())?")
                        break
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    assert_no_problems(shown)


def test_2_6_memory_held_until_w_zero_bubble(grade):
    """The reference's ZB-H1(3, m) run by your run_pipeline under a StageRecorder: stage 0 holds at most
    max_in_flight of its row (p = 3 micro-batches, from F to W) + 0.5 forwards' worth of bytes, and no stage holds
    more at m = 5 than at m = 3 (+ 0.5): a micro-batch is let go once its W is done."""
    results = _zero_bubble_results(grade("2.6"))
    reference = grading.reference("2.6")
    problems = []
    held = {(rank, m): results[rank][("recorded", m)]["peak_bytes"] / max(results[rank][("recorded", m)]["one_forward_bytes"], 1)
            for rank in range(PIPE_STAGES) for m in ZERO_BUBBLE_RECORDED}
    for m in ZERO_BUBBLE_RECORDED:
        bound = reference.max_in_flight(reference.zero_bubble_schedule(PIPE_STAGES, m)[0])
        if held[(0, m)] > bound + 0.5:
            problems.append(f"ZB-H1({PIPE_STAGES}, {m}): stage 0 held {held[(0, m)]:.2f} forwards' worth of bytes at its "
                            f"peak, expected at most {bound} (its micro-batches in flight, F to W) + 0.5")
    small, large = ZERO_BUBBLE_RECORDED
    for rank in range(PIPE_STAGES):
        if held[(rank, large)] > held[(rank, small)] + 0.5:
            problems.append(f"ZB-H1: stage {rank} held {held[(rank, small)]:.2f} forwards' worth at m = {small} but "
                            f"{held[(rank, large)]:.2f} at m = {large}: its memory grows with m (is a micro-batch's "
                            "graph, output and output gradient let go after its W?)")
    assert_no_problems(problems, "bytes held for micro-batches in flight (common.measure.StageRecorder):")


def test_2_6_sends_leave_before_the_next_computation_interleaved(grade):
    """Your run_pipeline on virtual stages (the interleaved and V-shaped runs above, no split backwards): every
    activation or input gradient an action sends to another rank is posted before the rank's next computation
    starts, whether that action received something or took it from a stage of the same rank. Order of events, not
    time."""
    results = _interleaved_results(grade("2.6"))
    runs = {f"interleaved_schedule({PIPE_STAGES}, {m}, 2)": [r[("parity", m)] for r in results]
            for m in INTERLEAVED_MICROBATCHES if "layers" in results[0][("parity", m)]}
    runs.update({name: [r[("other", name)] for r in results] for name in INTERLEAVED_OTHER if "W right after" not in name})
    problems = []
    for what, per_rank in runs.items():
        ranks = per_rank[0]["ranks"]
        for rank, res in enumerate(per_rank):
            makers = [i for i, (kind, j, k) in enumerate(_pp_norm(rank, a) for a in res["actions"])
                      if (kind == "F" and k + 1 < len(ranks) and ranks[k + 1] != rank)
                      or (kind == "B" and k > 0 and ranks[k - 1] != rank)]
            sends = [op for op in res["posted"] if op[0] == "send" and op[2]]
            for i, op in zip(makers, sends):
                if op[4] > i + 1:
                    kind, j, k = _pp_norm(rank, res["actions"][i])
                    problems.append(f"{what}, rank {rank}: the {'activation' if kind == 'F' else 'input gradient'} of "
                                    f"{kind}{j} on stage {k} was posted after {op[4] - i - 1} more computation(s) had "
                                    f"started; rank {op[1]} waits for it meanwhile (Mailbox.post() before computing)")
                    break
    assert_no_problems(problems)


def _mark_parts() -> None:
    """Each test's part of 2.6, from its name's suffix, so the exercise table shows the schedules one by
    one (tests/grading.py): interleaved 1F1B, zero bubble, and the rest (GPipe, 1F1B, the time grid and
    the executor they share)."""
    for name, test in list(globals().items()):
        if name.startswith("test_2_6_") and callable(test):
            part = ("interleaved 1F1B" if name.endswith("_interleaved") else
                    "zero bubble" if name.endswith("_zero_bubble") else "GPipe and 1F1B")
            globals()[name] = pytest.mark.part(part)(test)


_mark_parts()
