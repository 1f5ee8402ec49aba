"""rank_share refuses every world size that does not divide the global batch (the contract before shares could
differ): an elastic job of 2..4 nodes x 8 GPUs with a global batch of 1024 fails at 3 nodes (24 ranks) and burns
its restarts."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_plan_keeps_the_global_batch_at_every_world_size", "test_4_3_rank_share_tiles_the_global_batch",
             "test_4_3_resized_run_sees_every_sample_of_the_epoch_once", "test_4_3_resized_training_matches_one_process"]


def rank_share(global_batch, world_size, rank):
    if global_batch % world_size:  # the bug
        raise ValueError(f"a global batch of {global_batch} does not split evenly over {world_size} ranks")
    return _reference.rank_share(global_batch, world_size, rank)


def plan_batches(global_batch, world_size, max_per_rank):
    if min(global_batch, world_size, max_per_rank) >= 1:
        rank_share(global_batch, world_size, 0)
    return _reference.plan_batches(global_batch, world_size, max_per_rank)


class ElasticSampler(_reference.ElasticSampler):
    def rank_batches(self, rank, world_size):
        rank_share(self.global_batch, world_size, rank)
        return super().rank_batches(rank, world_size)
