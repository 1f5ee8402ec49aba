"""time_grid pops each stage's actions off the lists it was given: the grid is right, and the caller's schedule is left empty."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_actions

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_of_any_schedule"]


def time_grid(schedule):
    for stage, actions in enumerate(schedule):
        _check_actions(actions, f"stage {stage}")
    p, finished, grid = len(schedule), {}, []
    while any(schedule):
        t, row = len(grid), [None] * p
        for s in range(p):
            if not schedule[s]:
                continue
            kind, j = schedule[s][0]
            needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs += [("F", s, j)] + ([("B", s + 1, j)] if s < p - 1 else [])
            if all(finished.get(need, t) < t for need in needs):
                row[s] = schedule[s].pop(0)
        if not any(row):
            raise ValueError(f"schedule deadlocks at step {t}")
        for s, action in enumerate(row):
            if action is not None:
                finished[(action[0], s, action[1])] = t
        grid.append(row)
    return grid
