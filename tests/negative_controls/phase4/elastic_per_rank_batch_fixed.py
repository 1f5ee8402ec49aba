"""plan_batches keeps the per-rank batch at its maximum and never accumulates: the global batch is max_per_rank x world size, so it changes whenever the world does."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403
from solutions.phase4_production.elastic import BatchPlan

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_plan_keeps_the_global_batch_at_every_world_size",
             "test_4_3_resized_training_matches_one_process"]


def plan_batches(global_batch, world_size, max_per_rank):
    if min(global_batch, world_size, max_per_rank) < 1:
        raise ValueError("all arguments must be positive")
    shares = _reference.plan_batches(global_batch, world_size, global_batch).shares
    capped = tuple(min(share, max_per_rank) for share in shares)  # the bug: the rest of each share is never run
    return BatchPlan(global_batch, world_size, capped, 1, max_per_rank)
