"""Exercise 1.1: give every rank its own, disjoint shard of the dataset.

    dataset indices       0 1 2 3 4 5 6 7 8 9             (n = 10, world_size = 3)
    shuffled (seed+epoch) 4 1 7 5 3 9 0 8 6 2 | 4 1       (seed 0, epoch 0; padded to 12)
    rank 0 takes [0::3]   4     5     0     2        -> [4, 5, 0, 2]
    rank 1 takes [1::3]     1     3     8       4    -> [1, 3, 8, 4]
    rank 2 takes [2::3]       7     9     6       1  -> [7, 9, 6, 1]

Every rank computes the *same* permutation (same seed, same epoch), then keeps every
world_size-th index starting at its rank. The permutation comes from a private
torch.Generator: the global RNG (torch.manual_seed, dropout, init) is neither read nor
changed. Semantics and output are exactly those of torch.utils.data.DistributedSampler,
which is what you use in production (the example above is its real output).
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
      * the order depends only on (seed, epoch), never on the rank, nor on how often
        the sampler was iterated (the epoch is 0 until set_epoch is called).

    ValueError for a num_replicas that is not an integer >= 1 (2.0, "2" and None are
    not), a rank outside [0, num_replicas) and an empty dataset.
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
        # EXERCISE 1.1: ValueError for a bad world size, rank or empty dataset; set num_samples and total_size; pointer: drop_last rounds n/p
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas (world size) must be an integer >= 1, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}] for a world of {num_replicas}, got {rank!r}")
        if len(dataset) == 0:
            raise ValueError("cannot shard an empty dataset: check the dataset path and split")
        if drop_last:
            self.num_samples = len(dataset) // num_replicas
        else:
            self.num_samples = math.ceil(len(dataset) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        # END EXERCISE
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
        # EXERCISE 1.1: this rank's len(self) indices in DistributedSampler's order for (seed, epoch), global RNG untouched; see the diagram
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_len))

        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            padding = self.total_size - len(indices)
            while padding > 0:  # wrap around, repeatedly if the dataset is tiny
                indices += indices[:padding]
                padding = self.total_size - len(indices)

        shard = indices[self.rank : self.total_size : self.num_replicas]
        assert len(shard) == self.num_samples
        return iter(shard)
        # END EXERCISE


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

    `shuffle`, `seed` and `drop_last` mean what they mean for ShardSampler (drop_last
    trims the dataset so that the shards are equal; the loader still yields its last
    partial batch). Call `loader.sampler.set_epoch(epoch)` at the start of every epoch.
    """
    # EXERCISE 1.1: a DataLoader yielding this rank's shard (ordered as ShardSampler orders it) in batches; pointer: DataLoader's sampler
    sampler = ShardSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    # END EXERCISE
