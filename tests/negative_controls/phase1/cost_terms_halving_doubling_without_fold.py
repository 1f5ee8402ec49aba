"""Rabenseifner is costed 2*ceil(log2 p) latencies and 2(p-1)/p bytes for every p, as if p were a power of two: no fold, no unfold."""
import math

from solutions.phase1_data_parallel import comm_bench as _reference
from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_cost_terms_for_any_world_size", "test_1_3_link_alpha_beta_per_strategy"]


def cost_terms(strategy, world_size):
    if strategy == "halving_doubling" and world_size > 1:
        return 2 * math.ceil(math.log2(world_size)), 2 * (world_size - 1) / world_size
    return _reference.cost_terms(strategy, world_size)


def link_alpha_beta(strategy, world_size, sizes_bytes, seconds):
    a, b = cost_terms(strategy, world_size)
    if a == 0 or b == 0:
        return None
    alpha, beta = fit_alpha_beta(sizes_bytes, seconds)  # noqa: F405
    return alpha / a, beta / b
