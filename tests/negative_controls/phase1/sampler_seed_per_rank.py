"""Each rank seeds its shuffle with seed + epoch + rank, so the shards overlap."""
import torch

from solutions.phase1_data_parallel import sampler as _reference
from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403

EXERCISE = "1.1"
CAUGHT_BY = ["test_1_1_matches_torch_distributed_sampler", "test_1_1_shards_are_equal_disjoint_and_cover"]


class ShardSampler(_reference.ShardSampler):
    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch + self.rank)
        indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        indices = (indices * self.num_replicas)[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])
