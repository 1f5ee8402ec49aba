"""No argument checks: rank >= world size or an empty dataset silently give empty shards."""
import math

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_bad_arguments_fail_clearly"]


class ShardSampler(_reference.ShardSampler):
    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.dataset_len, self.num_replicas, self.rank = len(dataset), max(num_replicas, 1), rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.num_samples = math.ceil(self.dataset_len / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
