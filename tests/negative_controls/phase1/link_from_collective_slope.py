"""The link's beta is taken to be the collective's slope (cost_terms = (1, 1)): 1/beta is not the link's bandwidth."""
from solutions.phase1_data_parallel import comm_bench as _reference
from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_link_alpha_beta_per_strategy"]


def cost_terms(strategy, world_size):
    _reference.cost_terms(strategy, world_size)  # same errors
    return (0.0, 0.0) if world_size == 1 else (1.0, 1.0)


def link_alpha_beta(strategy, world_size, sizes_bytes, seconds):
    a, b = cost_terms(strategy, world_size)
    if a == 0 or b == 0:
        return None
    alpha, beta = fit_alpha_beta(sizes_bytes, seconds)  # noqa: F405
    return alpha / a, beta / b
