"""max_in_flight counts the forwards before the first backward: the peak for GPipe and 1F1B, not for a stage that runs more forwards after a backward."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_max_in_flight_counts_forwards_not_yet_backwarded"]


def max_in_flight(actions):
    kinds = "".join(kind for kind, _ in actions)
    return len(kinds) - len(kinds.lstrip("F"))
