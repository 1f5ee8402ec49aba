"""The world-size check rejects floats and numbers < 1, but a string or None fails with a TypeError instead of a clear ValueError."""
import math

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_bad_arguments_fail_clearly"]


class ShardSampler(_reference.ShardSampler):
    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        if isinstance(num_replicas, float) or num_replicas < 1:  # "2" < 1 and None < 1: TypeError
            raise ValueError(f"num_replicas (world size) must be an integer >= 1, got {num_replicas!r}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}] for a world of {num_replicas}, got {rank!r}")
        if len(dataset) == 0:
            raise ValueError("cannot shard an empty dataset: check the dataset path and split")
        self.num_samples = len(dataset) // num_replicas if drop_last else math.ceil(len(dataset) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.dataset_len, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
