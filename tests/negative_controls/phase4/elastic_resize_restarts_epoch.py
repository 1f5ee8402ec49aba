"""The state remembers the world size it was saved at, and a resume at another size starts the epoch over: the samples the old world already trained on are trained on again."""
from solutions.phase4_production import elastic as _reference
from solutions.phase4_production.elastic import *  # noqa: F401,F403

EXERCISE = "4.3"
CAUGHT_BY = ["test_4_3_data_position_does_not_depend_on_the_world_size",
             "test_4_3_resized_run_sees_every_sample_of_the_epoch_once"]


class ElasticSampler(_reference.ElasticSampler):
    world_size = None

    def rank_batches(self, rank, world_size):
        if self.world_size is not None and world_size != self.world_size:
            self.consumed = 0  # the bug: "the old shards mean nothing in the new world"
        self.world_size = world_size
        return super().rank_batches(rank, world_size)

    def state_dict(self):
        return dict(super().state_dict(), world_size=self.world_size)

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.world_size = state.get("world_size")
