"""1F1B without the warm-up: every stage alternates F0 B0 F1 B1 ... from the start, so the pipeline never fills (one micro-batch in flight, bubble far above (p-1)/(m+p-1))."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_settings

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_1f1b_warmup_and_in_flight_limit", "test_2_6_bubble_fraction_matches_formula"]


def one_f_one_b_schedule(num_stages, num_microbatches):
    _check_settings(num_stages, num_microbatches)
    actions = [a for j in range(num_microbatches) for a in (("F", j), ("B", j))]
    return [list(actions) for _ in range(num_stages)]
