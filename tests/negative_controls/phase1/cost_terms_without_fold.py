"""recursive_doubling is costed log2(p) steps for every p, forgetting the fold and unfold when p is not a power of two."""
import math

from solutions.phase1_data_parallel import comm_bench as _reference
from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_link_alpha_beta_per_strategy"]


def cost_terms(strategy, world_size):
    if strategy == "recursive_doubling" and world_size > 1:
        return math.log2(world_size), math.log2(world_size)
    return _reference.cost_terms(strategy, world_size)


def link_alpha_beta(strategy, world_size, sizes_bytes, seconds):
    a, b = cost_terms(strategy, world_size)
    if a == 0 or b == 0:
        return None
    alpha, beta = fit_alpha_beta(sizes_bytes, seconds)  # noqa: F405
    return alpha / a, beta / b
