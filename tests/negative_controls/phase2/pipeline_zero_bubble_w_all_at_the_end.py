"""ZB-H1 with every W postponed to the end of its stage: the W's fill the drain, but each micro-batch stays in flight until then, so a stage holds all m of them (GPipe's memory) instead of at most p."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import one_f_one_b_schedule as _one_f_one_b_schedule

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_bubble_and_in_flight_zero_bubble"]


def zero_bubble_schedule(num_stages, num_microbatches):
    return [actions + [("W", j) for j in range(num_microbatches)]
            for actions in _one_f_one_b_schedule(num_stages, num_microbatches)]
