"""bubble_fraction divides the idle slots by the busy slots (the "bubble overhead" (p-1)/m) instead of by all slots."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_bubble_fraction_matches_formula"]


def bubble_fraction(grid):
    idle = sum(action is None for row in grid for action in row)
    return idle / (len(grid) * len(grid[0]) - idle)
