"""time_grid gives a B the cost of an F (the bubble counted with B = F): right on the unit grid, but with t_B = 2 t_F every grid is too short and ZB-H1's and interleaved 1F1B's bubbles come out wrong."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import time_grid as _time_grid

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_of_any_schedule_zero_bubble", "test_2_6_bubble_fraction_matches_formula_zero_bubble",
             "test_2_6_bubble_fraction_matches_formula_interleaved"]


def time_grid(schedule, costs=None):
    if costs and "F" in costs:
        costs = {**costs, "B": costs["F"]}
    return _time_grid(schedule, costs)
