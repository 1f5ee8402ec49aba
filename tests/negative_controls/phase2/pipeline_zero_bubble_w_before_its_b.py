"""ZB-H1 that inserts W(j-s) just before B(j) instead of right after it: on stage 0 (s = 0) every W comes before its own B, and on every stage the first one does, so a weight gradient is scheduled before the gradient it needs exists."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_settings, one_f_one_b_schedule

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_schedule_splits_every_backward_zero_bubble"]


def zero_bubble_schedule(num_stages, num_microbatches):
    _check_settings(num_stages, num_microbatches)
    schedule = []
    for stage, actions in enumerate(one_f_one_b_schedule(num_stages, num_microbatches)):
        split = []
        for kind, j in actions:
            if kind == "B" and j >= stage:
                split.append(("W", j - stage))
            split.append((kind, j))
        split += [("W", j) for j in range(max(num_microbatches - stage, 0), num_microbatches)]
        schedule.append(split)
    return schedule
