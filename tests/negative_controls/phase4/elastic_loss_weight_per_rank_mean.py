"""Each micro-batch's loss weight is its part of the RANK's share (size / share), as if every rank's mean
loss counted the same: right when the shares are equal, but with shares of 3 and 2 samples the samples of the
smaller shares weigh 3/2 as much, and the gradient is not that of the global batch's mean loss."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_plan_keeps_the_global_batch_at_every_world_size", "test_4_3_resized_training_matches_one_process"]


class BatchPlan(_reference.BatchPlan):
    def micro_slices(self, rank):
        out, start = [], 0
        for size in self.micro_batches(rank):
            out.append((slice(start, start + size), size / self.shares[rank]))  # the bug
            start += size
        return out


def plan_batches(global_batch, world_size, max_per_rank):
    plan = _reference.plan_batches(global_batch, world_size, max_per_rank)
    return BatchPlan(plan.global_batch, plan.world_size, plan.shares, plan.accumulation, plan.max_per_rank)
