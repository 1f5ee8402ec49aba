"""Exercise 1.1: give every rank its own, disjoint shard of the dataset.

    dataset indices      0 1 2 3 4 5 6 7 8 9            (n = 10, world_size = 3)
    shuffled (seed+epoch) 7 2 9 0 5 3 8 1 6 4 | 7 2     (padded by wrapping to 12)
    rank 0 takes [0::3]   7     0     8     4
    rank 1 takes [1::3]     2     5     1     7
    rank 2 takes [2::3]       9     3     6     2

Every rank computes the *same* permutation (same seed, same epoch), then keeps every
world_size-th index starting at its rank. Semantics and output are exactly those of
torch.utils.data.DistributedSampler, which is what you use in production.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ShardSampler(Sampler[int]):
    """Yields the indices of this rank's shard of a dataset of `len(dataset)` items.

    Invariants (for a fixed seed and epoch):
      * every rank yields exactly `len(self)` indices (ranks stay in lock-step);
      * shards are disjoint, except for the <= world_size-1 padding indices
        repeated to make them equal (drop_last=False);
      * together the shards cover the dataset (drop_last=False) or all but
        < world_size items (drop_last=True);
      * the order depends only on (seed, epoch), never on the rank.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        raise NotImplementedError('TODO 1.1: raise ValueError for num_replicas < 1, rank outside [0, num_replicas), or an empty dataset; then set num_samples (per rank) and total_size (padded or truncated)')
        self.dataset_len = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of every epoch, on every rank, so each epoch is shuffled differently."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError('TODO 1.1: same permutation on every rank (torch.randperm with a generator seeded seed+epoch), pad by wrapping or truncate, then take indices[rank::num_replicas]')


def make_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> DataLoader:
    """A DataLoader over this rank's shard: `batch_size` is per rank, not global.

    Call `loader.sampler.set_epoch(epoch)` at the start of every epoch.
    """
    raise NotImplementedError('TODO 1.1: build a ShardSampler for this rank and hand it to a DataLoader (sampler=..., not shuffle=True)')
