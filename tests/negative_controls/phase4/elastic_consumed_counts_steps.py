"""The data position counts committed STEPS (advance adds 1) where the contract counts the epoch's samples over
all ranks: the same number at every world size, so it resumes right, but every consumer that reads `consumed` as
samples (the trainer's batch sampler sizes the rest of the epoch as steps_per_epoch - consumed // global_batch)
believes nothing was trained."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_data_position_does_not_depend_on_the_world_size"]


class ElasticSampler(_reference.ElasticSampler):
    def rank_batches(self, rank, world_size):
        share = rank_share(self.global_batch, world_size, rank)
        order = self.order()
        return [order[t * self.global_batch:(t + 1) * self.global_batch][share]
                for t in range(self.consumed, self.steps_per_epoch)]

    def advance(self):
        self.consumed += 1  # the bug: steps, not samples
        if self.consumed >= self.steps_per_epoch:
            self.epoch += 1
            self.consumed = 0
