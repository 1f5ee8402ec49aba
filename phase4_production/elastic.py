"""4.3 Elastic training: the world size may change between restarts; the run may not notice.

Three things must not depend on how many ranks there are:

    the data position   ElasticSampler: (epoch, samples of the epoch consumed), the same
                        numbers at every world size; each rank takes its share of the
                        SAME global batch, so after a resize the rest of the epoch is
                        resharded and every sample is still seen exactly once
    the global batch    plan_batches: rank r takes rank_share(global_batch, world_size, r),
                        shares that differ by at most one sample at ANY world size, cut into
                        the fewest micro-batches that fit in memory (gradient accumulation);
                        each micro-batch's loss is weighted by its part of the global batch
    sharded state       save_sharded / load_sharded: torch.distributed.checkpoint writes
                        each rank's shard with its global offsets, and loads them into the
                        shards of ANOTHER world (2 ranks -> 1, 3 or 4)

Epoch e visits the samples in the order `ElasticSampler.order(e)`, a permutation seeded
by (seed, e), in global batches of B samples: global batch t = order[t*B : (t+1)*B] for
t < N // B. The N mod B samples left at the end of the order are not used in epoch e:
every step then has exactly B samples (the batch size the learning rate was tuned for),
and since the order changes every epoch, a different, random set of at most B - 1
samples sits out each epoch; none is systematically lost, and which ones sit out does
not depend on the world size. Nothing is ever padded or repeated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


# ---------------------------------------------------------------- global batch, any world size


def rank_share(global_batch: int, world_size: int, rank: int) -> slice:
    """Where rank `rank` takes its share of a global batch: a slice of range(global_batch).
    Shares differ by at most one sample and the first global_batch % world_size ranks take
    the larger ones, so the slices of ranks 0..world_size-1 tile the global batch in order:
    rank_share(10, 4, r) for r = 0..3 -> 0:3, 3:6, 6:8, 8:10. Raises ValueError (one line)
    when the rank is not in the world or the world has more ranks than the batch has samples."""
    raise NotImplementedError('TODO 4.3: shares of global_batch // world_size, one more for the first global_batch % world_size ranks')


@dataclass(frozen=True)
class BatchPlan:
    """How one step of `global_batch` samples is split over `world_size` ranks.

    shares         samples rank r takes per step, shares[r] == len(rank_share(global_batch,
                   world_size, r)): they sum to global_batch and differ by at most one
    accumulation   forward/backward passes per optimizer step, THE SAME on every rank: the
                   collectives some forward passes run (SyncBatchNorm's statistics, DDP's
                   buffer broadcast) pair up only if every rank runs as many
    max_per_rank   the most samples one micro-batch may hold
    """

    global_batch: int
    world_size: int
    shares: tuple[int, ...]
    accumulation: int
    max_per_rank: int

    def micro_batches(self, rank: int) -> tuple[int, ...]:
        """Sizes of the `accumulation` micro-batches rank `rank` runs in turn: they sum to
        shares[rank], differ by at most one, and each holds 1..max_per_rank samples."""
        raise NotImplementedError("TODO 4.3: cut this rank's share into `accumulation` near-equal parts")

    def micro_slices(self, rank: int) -> list[tuple[slice, float]]:
        """(slice of rank `rank`'s share, loss weight) per micro-batch. With the mean loss of
        each micro-batch times its weight, and the gradients AVERAGED over the ranks (DDP's
        all-reduce), the result is the gradient of the mean loss over the whole global batch,
        at every world size, also when the shares are not equal."""
        raise NotImplementedError('TODO 4.3: a micro-batch of n samples holds n / global_batch of the global mean; the all-reduce divides by world_size')


def plan_batches(global_batch: int, world_size: int, max_per_rank: int) -> BatchPlan:
    """The split of a fixed global batch over `world_size` ranks: the shares of
    rank_share, and the fewest micro-batches per step, the same number on every rank,
    that keep every micro-batch within `max_per_rank` samples. Raises ValueError (one line)
    when an argument is not positive, the world has more ranks than the batch has samples,
    or a rank's share is smaller than that number of micro-batches (a micro-batch would be
    empty: raise max_per_rank)."""
    raise NotImplementedError("TODO 4.3: the shares of rank_share; accumulation steps so that the largest share's micro-batches fit")


# ---------------------------------------------------------------- data position, any world size


class ElasticSampler:
    """Which samples each rank trains on, step by step, resumable at another world size.

    The position is (epoch, consumed): `consumed` samples of epoch `epoch`'s order were
    trained on by committed steps (a multiple of global_batch, counted over ALL ranks).
    `rank_batches(rank, world_size)` gives this rank's share of each remaining global
    batch of the epoch; the loop calls `advance()` once per committed optimizer step.
    The global batch of every step depends on (seed, epoch, step) only, never on the
    world size. `state_dict()` is plain data, the same at every world size.

        sampler = ElasticSampler(len(dataset), global_batch=256, seed=0)
        sampler.load_state_dict(checkpoint["data"])          # on resume, at any world size
        for indices in sampler.rank_batches(rank, world):   # or DataLoader(batch_sampler=...)
            train_step(dataset[indices]); sampler.advance()
    """

    def __init__(self, dataset_size: int, global_batch: int, seed: int = 0, shuffle: bool = True):
        if dataset_size < global_batch or global_batch < 1:
            raise ValueError(f"a dataset of {dataset_size} samples cannot fill one global batch of {global_batch}")
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch: dataset_size // global_batch (the rest sits out)."""
        return self.dataset_size // self.global_batch

    def order(self, epoch: int | None = None) -> list[int]:
        """The order of epoch `epoch` (default: the current one): a permutation of
        range(dataset_size) seeded by seed + epoch, or the identity without shuffle."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_size))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=gen).tolist()

    def rank_batches(self, rank: int, world_size: int) -> list[list[int]]:
        """This rank's share (the `rank_share` slice) of each global batch of the current
        epoch not consumed yet, in step order. Raises ValueError when the rank is not in
        the world or the world has more ranks than the global batch has samples."""
        raise NotImplementedError("TODO 4.3: the rest of the epoch's order, in global batches; this rank takes its slice of each")

    def advance(self) -> None:
        """One global batch was trained on (one committed optimizer step, on every rank);
        after the last one of the epoch the position moves to the start of the next epoch."""
        raise NotImplementedError('TODO 4.3: count samples of the epoch over all ranks; roll over to the next epoch')

    def state_dict(self) -> dict[str, Any]:
        """The position and what it means, as plain ints and bools; no world size in it."""
        raise NotImplementedError('TODO 4.3: what a resumed run at ANY world size needs to continue the same epoch')

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s position. Raises ValueError if it was saved for
        another dataset size, global batch, seed or shuffle (its position would mean other samples)."""
        raise NotImplementedError('TODO 4.3: check it describes the same order, then take its position')


# ---------------------------------------------------------------- sharded state (DCP)


def save_sharded(state: dict[str, Any], folder: str, process_group=None) -> None:
    """torch.distributed.checkpoint.save: every rank of `process_group` (default: the world)
    writes its own shards (DTensor local pieces, with their global offsets) and one rank
    the metadata. Plain tensors are taken as replicated (written once)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=folder, process_group=process_group)


def load_sharded(state: dict[str, Any], folder: str, process_group=None) -> dict[str, Any]:
    """torch.distributed.checkpoint.load IN PLACE into `state`, whose DTensors already have
    the layout wanted NOW (e.g. Shard(0) on this world's mesh): each rank reads the pieces
    of the saved shards that overlap its own, whatever world size saved them. Returns `state`."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=folder, process_group=process_group)
    return state
