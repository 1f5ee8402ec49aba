"""ZB-H1 with every W right after its B: the backward is split but nothing moves, so the W's fill no bubble and the pipeline idles as long as 1F1B's with B and W fused ((p-1)(t_F+t_B+t_W) instead of (p-1)(t_F+t_B-t_W))."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import one_f_one_b_schedule as _one_f_one_b_schedule

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_bubble_and_in_flight_zero_bubble"]


def zero_bubble_schedule(num_stages, num_microbatches):
    return [[b for a in actions for b in ([a, ("W", a[1])] if a[0] == "B" else [a])]
            for actions in _one_f_one_b_schedule(num_stages, num_microbatches)]
