"""max_in_flight lets a micro-batch go at its B even when a W follows: the weight gradient still needs the layers' inputs, so ZB-H1's delayed W's hold more than it says (it reports 1F1B's p - s where ZB-H1 holds p)."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_max_in_flight_until_the_weight_gradient_zero_bubble"]


def max_in_flight(actions):
    count = peak = 0
    for action in actions:
        count += {"F": 1, "B": -1}.get(action[0], 0)
        peak = max(peak, count)
    return peak
