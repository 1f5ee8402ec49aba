"""cost_terms answers (0, 0) for p = 1 before looking at the strategy: a misspelt strategy name passes unnoticed on one rank."""
from solutions.phase1_data_parallel import comm_bench as _reference
from solutions.phase1_data_parallel.comm_bench import *  # noqa: F401,F403

EXERCISE = "1.3"
CAUGHT_BY = ["test_1_3_cost_terms_for_any_world_size"]


def cost_terms(strategy, world_size):
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 0.0, 0.0
    return _reference.cost_terms(strategy, world_size)
