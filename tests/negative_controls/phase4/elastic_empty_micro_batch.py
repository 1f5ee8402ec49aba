"""plan_batches accepts a plan whose smaller shares cannot fill every micro-batch (12 samples on 5 ranks in
micro-batches of 1: shares of 3 and 2, three passes each): some ranks run a forward pass on ZERO samples, whose
mean loss is NaN."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_plan_keeps_the_global_batch_at_every_world_size"]


def plan_batches(global_batch, world_size, max_per_rank):
    try:
        return _reference.plan_batches(global_batch, world_size, max_per_rank)
    except ValueError:
        if min(global_batch, world_size, max_per_rank) < 1 or world_size > global_batch:
            raise
        shares = _reference.plan_batches(global_batch, world_size, global_batch).shares
        return _reference.BatchPlan(global_batch, world_size, shares, -(-max(shares) // max_per_rank), max_per_rank)
