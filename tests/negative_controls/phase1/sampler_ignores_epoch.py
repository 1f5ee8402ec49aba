"""The permutation is seeded with the seed only: every epoch sees the same order."""
import torch

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_same_order_on_every_rank_and_new_order_each_epoch", "test_1_1_matches_torch_distributed_sampler"]


class ShardSampler(_reference.ShardSampler):
    def __iter__(self):
        epoch, self.epoch = self.epoch, 0
        try:
            return super().__iter__()
        finally:
            self.epoch = epoch
