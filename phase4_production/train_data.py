"""The trainer's data: datasets, a resumable distributed batch sampler, seeded augmentation.

    ElasticSampler (4.3)      the epoch's order and position, the same at every world size
      -> RankBatches          this rank's share of each remaining global batch, as
                              [(epoch, sample index), ...] lists (a DataLoader batch_sampler)
      -> SeededSamples        item (epoch, i): dataset[i] with the torch RNG seeded by
                              (seed, epoch, i), so a sample's random crop and flip do not
                              depend on which worker loads it, how many workers there are,
                              or whether the run was restarted in between
      -> DataLoader           worker processes, pinned memory, persistent workers

Why seed each sample: DataLoader workers draw their seeds from the training process's RNG
when an iterator starts; a resumed run starts its iterator at another moment than a run
that was never stopped, so its augmentation would differ. Per-sample seeds make a resumed
run see exactly the images an uninterrupted run sees.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from common.data import DATASET_SHAPES, get_dataset
from phase4_production.elastic import ElasticSampler
from phase4_production.lifecycle import loader_worker_init


class SyntheticImages(Dataset):
    """`n` images (3, size, size) drawn on demand (no memory held), random labels: for
    throughput runs at real image sizes, where a materialised set would take gigabytes."""

    def __init__(self, n: int, size: int, num_classes: int, seed: int = 0):
        self.n, self.shape, self.num_classes, self.seed = n, (3, size, size), num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.shape, generator=gen), int(torch.randint(self.num_classes, (), generator=gen))


def build_datasets(dataset: str, data_root: str | None, image_size: int | None,
                   synthetic_size: int) -> tuple[Dataset, Dataset, tuple[int, ...], int]:
    """(train set, test set, input shape (C, H, W), number of classes). Missing files raise
    FileNotFoundError with a one-line message saying where the data should be."""
    shape, classes = DATASET_SHAPES[dataset]
    if dataset == "synthetic" and image_size:
        return (SyntheticImages(synthetic_size, image_size, classes, seed=0),
                SyntheticImages(max(synthetic_size // 4, 1), image_size, classes, seed=1), (3, image_size, image_size),
                classes)
    train_kw: dict = {"n": synthetic_size} if dataset == "synthetic" else {}
    test_kw: dict = {}
    if dataset in ("cifar10", "imagenet"):
        train_kw["augment"] = True
    if dataset == "imagenet" and image_size:
        train_kw["image_size"] = test_kw["image_size"] = image_size
        shape = (3, image_size, image_size)
    return (get_dataset(dataset, "train", data_root, **train_kw), get_dataset(dataset, "test", data_root, **test_kw),
            shape, classes)


class SeededSamples(Dataset):
    """Items are (epoch, index) pairs: dataset[index] with torch's CPU generator (the one
    torchvision's random transforms draw from) seeded by (seed, epoch, index) and put back
    afterwards, so the caller's RNG streams are untouched. Only the CPU generator: the
    `torch.manual_seed` of every CUDA device costs ~170 us a sample (each lazy per-device
    seed records a stack trace) and, in a process that uses a GPU, would reset its stream."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)
            return self.dataset[index]


class RankBatches:
    """DataLoader batch_sampler: iterating it yields this rank's share of each global batch
    of the sampler's CURRENT epoch not consumed yet, as [(epoch, index), ...]. The training
    loop calls sampler.advance() after each optimizer step; the next iteration starts
    where that left off (after a resume, at any world size)."""

    def __init__(self, sampler: ElasticSampler, rank: int, world_size: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch
        for batch in self.sampler.rank_batches(self.rank, self.world_size):
            yield [(epoch, i) for i in batch]

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch - self.sampler.consumed // self.sampler.global_batch


def train_loader(dataset: Dataset, batches: RankBatches, seed: int, workers: int, pin_memory: bool) -> DataLoader:
    """The training DataLoader over `batches`. Its own generator: creating an iterator draws
    the workers' base seed from it, never from the global RNG a checkpoint restores. Its
    workers ignore stop signals and die with the rank (lifecycle.loader_worker_init)."""
    return DataLoader(SeededSamples(dataset, seed), batch_sampler=batches, num_workers=workers,
                      pin_memory=pin_memory, persistent_workers=workers > 0,
                      generator=torch.Generator().manual_seed(seed), worker_init_fn=loader_worker_init)


def eval_loader(dataset: Dataset, rank: int, world_size: int, batch_size: int, workers: int,
                pin_memory: bool) -> DataLoader:
    """This rank's contiguous slice of the test set, unshuffled and unpadded (the ranks'
    correct counts and totals are summed, so every test sample counts exactly once)."""
    from common.split import balanced_ranges

    part = balanced_ranges(len(dataset), world_size, "test samples")[rank]
    subset = torch.utils.data.Subset(dataset, list(part))
    return DataLoader(subset, batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                      persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0),
                      worker_init_fn=loader_worker_init)
