"""1F1B with a warm-up of p - s forwards instead of p - s - 1: stage 0 holds p + 1 micro-batches in flight, more than 1F1B's limit of p."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_settings

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_1f1b_warmup_and_in_flight_limit"]


def one_f_one_b_schedule(num_stages, num_microbatches):
    _check_settings(num_stages, num_microbatches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage, num_microbatches)
        actions = [("F", j) for j in range(warmup)]
        for j in range(num_microbatches - warmup):
            actions += [("F", warmup + j), ("B", j)]
        actions += [("B", j) for j in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule
