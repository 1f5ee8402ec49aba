"""time_grid puts action i of stage s at step s + i: a diagonal shift, as if no stage ever had to wait for a neighbour (right for GPipe's forwards only)."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_actions

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_respects_dependencies", "test_2_6_bubble_fraction_matches_formula"]


def time_grid(schedule):
    for stage, actions in enumerate(schedule):
        _check_actions(actions, f"stage {stage}")
    steps = max(s + len(actions) for s, actions in enumerate(schedule))
    grid = [[None] * len(schedule) for _ in range(steps)]
    for s, actions in enumerate(schedule):
        for i, action in enumerate(actions):
            grid[s + i][s] = action
    return grid
