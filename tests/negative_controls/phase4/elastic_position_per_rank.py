"""The data position counts this rank's samples (its batch index x its share), not the epoch's samples over all ranks: after a resize the rest of the epoch starts at the wrong place, repeating or skipping samples."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_data_position_does_not_depend_on_the_world_size",
             "test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    _share = None

    def rank_batches(self, rank, world_size):
        mine = rank_share(self.global_batch, world_size, rank)
        self._share = share = mine.stop - mine.start
        order = self.order()
        first = self.consumed // share  # the bug: `consumed` counts this rank's samples
        return [order[t * self.global_batch:(t + 1) * self.global_batch][mine]
                for t in range(first, self.steps_per_epoch)]

    def advance(self):
        self.consumed += self._share
        if self.consumed >= self.steps_per_epoch * self._share:
            self.epoch += 1
            self.consumed = 0
