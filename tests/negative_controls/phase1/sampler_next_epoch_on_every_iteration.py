"""Every pass over the sampler starts a new epoch by itself: iterating twice without set_epoch gives two orders."""
from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_any_arguments_give_torch_shards_stable_across_calls"]


class ShardSampler(_reference.ShardSampler):
    def __iter__(self):
        shard = super().__iter__()
        self.epoch += 1  # "the loop forgets set_epoch anyway": but then the order depends on how often it was read
        return shard
