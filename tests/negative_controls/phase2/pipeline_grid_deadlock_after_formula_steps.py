"""time_grid declares a deadlock once its clock passes 2(m+p-1) steps, the length of GPipe's and 1F1B's grids: a valid schedule that simply takes longer is refused."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import time_grid as _time_grid

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_of_any_schedule"]


def time_grid(schedule):
    grid = _time_grid(schedule)
    p, m = len(schedule), len(schedule[0]) // 2
    if len(grid) > 2 * (m + p - 1):
        raise ValueError(f"schedule deadlocks at step {2 * (m + p - 1)}")
    return grid
