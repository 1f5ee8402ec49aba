"""Strided shards of the unpadded permutation: ranks get different numbers of samples."""
import torch

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_shards_are_equal_disjoint_and_cover", "test_1_1_matches_torch_distributed_sampler"]


class ShardSampler(_reference.ShardSampler):
    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        indices = torch.randperm(self.dataset_len, generator=generator).tolist() if self.shuffle else list(range(self.dataset_len))
        return iter(indices[self.rank :: self.num_replicas])
