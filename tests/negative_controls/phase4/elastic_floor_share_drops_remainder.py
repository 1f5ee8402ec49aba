"""rank_batches gives each rank global_batch // world_size samples at any world size: when the world does not divide the global batch, the remainder of every global batch is silently dropped (those samples are never trained on) and the global batch shrinks."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    def rank_batches(self, rank, world_size):
        share = self.global_batch // world_size  # the bug: the B mod W extra samples go to no rank
        order = self.order()
        first = self.consumed // self.global_batch
        return [order[t * self.global_batch + rank * share: t * self.global_batch + (rank + 1) * share]
                for t in range(first, self.steps_per_epoch)]
