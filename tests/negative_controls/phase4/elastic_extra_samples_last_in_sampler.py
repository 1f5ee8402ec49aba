"""rank_batches gives the B mod W extra samples to the LAST ranks while plan_batches (rank_share) gives them to
the first: every sample is still trained on once, but each rank's loss weights are computed for a share of
another size, so the gradient is not that of the global batch's mean loss."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    def rank_batches(self, rank, world_size):
        mirrored = rank_share(self.global_batch, world_size, world_size - 1 - rank)  # sizes of the mirror rank
        size = mirrored.stop - mirrored.start
        base, extra = divmod(self.global_batch, world_size)
        start = rank * base + max(0, rank - (world_size - extra))  # the bug: extras on the last ranks
        order = self.order()
        first = self.consumed // self.global_batch
        return [order[t * self.global_batch:(t + 1) * self.global_batch][start:start + size]
                for t in range(first, self.steps_per_epoch)]
