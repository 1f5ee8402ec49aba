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
    # EXERCISE 4.3: shares of global_batch // world_size, one more for the first global_batch % world_size ranks
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if world_size > global_batch:
        raise ValueError(f"{world_size} ranks cannot share a global batch of {global_batch}: a rank would get no "
                         f"sample; use at most {global_batch} ranks or a larger --global-batch")
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))
    # END EXERCISE


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
        # EXERCISE 4.3: cut this rank's share into `accumulation` near-equal parts
        base, extra = divmod(self.shares[rank], self.accumulation)
        return tuple(base + (i < extra) for i in range(self.accumulation))
        # END EXERCISE

    def micro_slices(self, rank: int) -> list[tuple[slice, float]]:
        """(slice of rank `rank`'s share, loss weight) per micro-batch. With the mean loss of
        each micro-batch times its weight, and the gradients AVERAGED over the ranks (DDP's
        all-reduce), the result is the gradient of the mean loss over the whole global batch,
        at every world size, also when the shares are not equal."""
        # EXERCISE 4.3: a micro-batch of n samples holds n / global_batch of the global mean; the all-reduce divides by world_size
        out, start = [], 0
        for size in self.micro_batches(rank):
            out.append((slice(start, start + size), size * self.world_size / self.global_batch))
            start += size
        return out
        # END EXERCISE


def plan_batches(global_batch: int, world_size: int, max_per_rank: int) -> BatchPlan:
    """The split of a fixed global batch over `world_size` ranks: the shares of
    rank_share, and the fewest micro-batches per step, the same number on every rank,
    that keep every micro-batch within `max_per_rank` samples. Raises ValueError (one line)
    when an argument is not positive, the world has more ranks than the batch has samples,
    or a rank's share is smaller than that number of micro-batches (a micro-batch would be
    empty: raise max_per_rank)."""
    # EXERCISE 4.3: the shares of rank_share; accumulation steps so that the largest share's micro-batches fit
    if min(global_batch, world_size, max_per_rank) < 1:
        raise ValueError(f"global_batch={global_batch}, world_size={world_size}, max_per_rank={max_per_rank}: "
                         "all must be positive")
    bounds = [rank_share(global_batch, world_size, rank) for rank in range(world_size)]
    shares = tuple(b.stop - b.start for b in bounds)
    accumulation = math.ceil(max(shares) / max_per_rank)
    if min(shares) < accumulation:
        raise ValueError(f"shares of {min(shares)}..{max(shares)} samples in {accumulation} micro-batches of at most "
                         f"{max_per_rank}: a micro-batch of the smaller shares would be empty; raise the micro-batch "
                         "size or use fewer ranks")
    return BatchPlan(global_batch, world_size, shares, accumulation, max_per_rank)
    # END EXERCISE


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
        # EXERCISE 4.3: the rest of the epoch's order, in global batches; this rank takes its slice of each
        share = rank_share(self.global_batch, world_size, rank)
        order = self.order()
        first = self.consumed // self.global_batch
        return [order[t * self.global_batch:(t + 1) * self.global_batch][share]
                for t in range(first, self.steps_per_epoch)]
        # END EXERCISE

    def advance(self) -> None:
        """One global batch was trained on (one committed optimizer step, on every rank);
        after the last one of the epoch the position moves to the start of the next epoch."""
        # EXERCISE 4.3: count samples of the epoch over all ranks; roll over to the next epoch
        self.consumed += self.global_batch
        if self.consumed >= self.steps_per_epoch * self.global_batch:
            self.epoch += 1
            self.consumed = 0
        # END EXERCISE

    def state_dict(self) -> dict[str, Any]:
        """The position and what it means, as plain ints and bools; no world size in it."""
        # EXERCISE 4.3: what a resumed run at ANY world size needs to continue the same epoch
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_size": self.dataset_size, "global_batch": self.global_batch, "shuffle": self.shuffle}
        # END EXERCISE

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s position. Raises ValueError if it was saved for
        another dataset size, global batch, seed or shuffle (its position would mean other samples)."""
        # EXERCISE 4.3: check it describes the same order, then take its position
        mine = {"seed": self.seed, "dataset_size": self.dataset_size, "global_batch": self.global_batch,
                "shuffle": self.shuffle}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"data position saved for {theirs}, this sampler has {mine}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        # END EXERCISE


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
