"""bubble_fraction returns (p-1)/(m+p-1) with p and m read off the grid, instead of counting its idle cells: right for GPipe and 1F1B only."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_bubble_fraction_of_any_grid"]


def bubble_fraction(grid):
    p = len(grid[0])
    m = sum(1 for row in grid if row[0] is not None and row[0][0] == "F")
    return (p - 1) / (m + p - 1)
