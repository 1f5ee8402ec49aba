"""The sampler seeds the global RNG (torch.manual_seed) instead of its own generator: same order, but dropout and init elsewhere change."""
import torch

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_sampler_leaves_the_global_rng_alone"]


class ShardSampler(_reference.ShardSampler):
    def __iter__(self):
        torch.manual_seed(self.seed + self.epoch)
        indices = torch.randperm(self.dataset_len).tolist() if self.shuffle else list(range(self.dataset_len))
        indices = (indices * (self.total_size // max(len(indices), 1) + 1))[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])
