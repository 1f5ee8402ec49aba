"""Each rank takes every world_size-th sample of the global batch (global_batch[rank::world_size], as
DistributedSampler strides the dataset) instead of its contiguous rank_share slice: the sizes match the plan, and
every sample is still trained once, but the micro-batches and loss weights are computed for slices the rank does
not hold in that order, and the data a rank sees no longer follows the documented layout."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    def rank_batches(self, rank, world_size):
        rank_share(self.global_batch, world_size, rank)  # the checks
        order = self.order()
        first = self.consumed // self.global_batch
        return [order[t * self.global_batch:(t + 1) * self.global_batch][rank::world_size]  # the bug
                for t in range(first, self.steps_per_epoch)]
