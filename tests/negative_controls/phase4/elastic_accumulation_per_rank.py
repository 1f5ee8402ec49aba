"""Each rank cuts its own share into the fewest micro-batches that fit (ceil(share / max_per_rank)): with
shares of 3 and 2 samples and micro-batches of 2, some ranks run two forward passes per step and others one, so
the collectives a forward pass runs (SyncBatchNorm's statistics, DDP's buffer broadcast) no longer pair up."""
import math

from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_plan_keeps_the_global_batch_at_every_world_size"]


class BatchPlan(_reference.BatchPlan):
    def micro_batches(self, rank):
        steps = math.ceil(self.shares[rank] / self.max_per_rank)  # the bug: per rank, not the same everywhere
        base, extra = divmod(self.shares[rank], steps)
        return tuple(base + (i < extra) for i in range(steps))


def plan_batches(global_batch, world_size, max_per_rank):
    plan = _reference.plan_batches(global_batch, world_size, max_per_rank)
    return BatchPlan(plan.global_batch, plan.world_size, plan.shares, plan.accumulation, plan.max_per_rank)
