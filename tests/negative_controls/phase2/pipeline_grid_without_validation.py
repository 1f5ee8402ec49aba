"""time_grid does not check each stage's list: an action repeated, or of a kind other than F and B, is simply laid out on the clock."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_rejects_malformed_schedules"]


def time_grid(schedule):
    p, position, finished, grid = len(schedule), [0] * len(schedule), {}, []
    while any(position[s] < len(schedule[s]) for s in range(p)):
        t, row = len(grid), [None] * p
        for s in range(p):
            if position[s] == len(schedule[s]):
                continue
            kind, j = schedule[s][position[s]]
            needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs += [("F", s, j)] + ([("B", s + 1, j)] if s < p - 1 else [])
            if all(finished.get(need, t) < t for need in needs):
                row[s] = (kind, j)
        if not any(row):
            raise ValueError(f"schedule deadlocks at step {t}")
        for s, action in enumerate(row):
            if action is not None:
                finished[(action[0], s, action[1])] = t
                position[s] += 1
        grid.append(row)
    return grid
