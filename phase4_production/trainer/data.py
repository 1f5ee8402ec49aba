"""The trainer's data: datasets, a resumable distributed batch sampler, seeded augmentation.

    inputs = build_inputs(cfg.data, seed, device, rank, world, flight)   the one entry point:
        inputs.train, inputs.test    training and test batches, ready on the device
        inputs.sampler, inputs.plan  the data position (4.3) and this world's split of a batch
        inputs.mix                   MixUp/CutMix of a training batch, or None
        inputs.progress(), inputs.restore(progress)   the data position in a checkpoint

The pipeline it builds, worker side first:

    ElasticSampler (4.3)      the epoch's order and position, the same at every world size
      -> RankBatches          this rank's share of each remaining global batch, as
                              [(epoch, sample index, copy), ...] lists (a DataLoader
                              batch_sampler); with --ra-reps R each global batch holds
                              ceil(B / R) samples of the order, R copies each (repeated
                              augmentation); with --mixup-alpha/--cutmix-alpha each share
                              is preceded by the sample before it in the global batch
      -> SeededSamples        item (epoch, i, copy): dataset[i] with the torch RNG seeded by
                              (seed, epoch, i, copy), so a sample's random crop and flip do not
                              depend on which worker loads it, how many workers there are,
                              or whether the run was restarted in between
      -> DataLoader           worker processes, pinned memory, persistent workers; uint8
                              images for CIFAR-10 and ImageNet (augment.py)
      -> DeviceBatches        prepared on the device, the next batch while a step runs
                              (device_stage.py: normalise, erase, GPU decode; BatchMixing)

Why seed each sample: DataLoader workers draw their seeds from the training process's RNG
when an iterator starts; a resumed run starts its iterator at another moment than a run
that was never stopped, so its augmentation would differ. Per-sample seeds make a resumed
run see exactly the images an uninterrupted run sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from common.data import CIFAR10_MEAN, CIFAR10_STD, DATASET_SHAPES, IMAGENET_MEAN, IMAGENET_STD, get_dataset
from phase4_production.elastic import BatchPlan, ElasticSampler, plan_batches, rank_share
from phase4_production.trainer import augment, data_checks
from phase4_production.trainer.device_stage import BatchMixing, DeviceBatches, InputStage
from phase4_production.trainer.lifecycle import kill_workers_at_exit, loader_worker_init


@dataclass
class Inputs:
    """The input pipeline of one rank (build_inputs)."""

    train: DeviceBatches           # this rank's share of each remaining global batch of the epoch
    test: DeviceBatches            # this rank's slice of the test set
    sampler: ElasticSampler        # the epoch's order and position
    plan: BatchPlan                # every rank's share of a global batch, in micro-batches
    shape: tuple[int, ...]         # the model's input (C, H, W)
    sample_shape: tuple[int, ...]  # a training sample as the model sees it (ImageNet: the crop)
    classes: int
    mix: BatchMixing | None        # --mixup-alpha/--cutmix-alpha
    identity: dict | None = None   # what the splits are (data_checks.identity)

    def progress(self) -> dict:
        """The data position, for a checkpoint's progress (world-size free: 4.3), and the
        dataset it is a position in."""
        return {"data": self.sampler.state_dict(), **({"dataset": self.identity} if self.identity else {})}

    def restore(self, progress: dict) -> None:
        """Continue from a checkpoint's position; ValueError (one line) if its dataset is not this one."""
        if self.identity:
            data_checks.refuse_changed(progress.get("dataset"), self.identity, progress.get("step", 0))
        self.sampler.load_state_dict(progress["data"])


def build_inputs(data, seed: int, device: torch.device, rank: int, world: int, flight=None) -> Inputs:
    """The data section's pipeline for rank `rank` of `world` (`data`: the config's data
    section; `seed`: the run's; `flight`: the flight record the loaders' waits go in).
    ValueError (one line) for --decode cuda on a device that is not a GPU; FileNotFoundError
    for a missing dataset."""
    if data.decode == "cuda" and device.type != "cuda":
        raise ValueError("--decode cuda decodes on the GPU (nvjpeg); this run trains on the CPU: use --decode tensor")
    train_set, test_set, shape, classes = build_datasets(
        data.dataset, data.data_root, data.image_size, data.synthetic_size, data.train_crop_size,
        data.val_resize_size, data.val_crop_size, data.decode, data.auto_augment, data.random_erase)
    identity = data_checks.identity(train_set, test_set)
    test_set = data_checks.held_out(train_set, test_set, rank)  # no test sample the model trains on
    plan = plan_batches(data.global_batch, world, data.micro_batch or data.global_batch)
    sampler = ElasticSampler(len(train_set), data.global_batch, seed=seed)
    pin = device.type == "cuda"
    mixing = data.mixup_alpha > 0 or data.cutmix_alpha > 0
    loader = train_loader(train_set, RankBatches(sampler, rank, world, data.ra_reps, neighbour=mixing), seed,
                          data.workers, pin, data.loader_timeout)
    crop, resize, test_crop = crop_sizes(data.dataset, data.image_size, data.train_crop_size, data.val_resize_size,
                                         data.val_crop_size)
    stats = input_stats(data.dataset, data.image_size)
    train = DeviceBatches(loader, InputStage(device, stats, data.decode, True, crop, resize, data.auto_augment),
                          device, flight)
    test = DeviceBatches(eval_loader(test_set, rank, world, max(plan.micro_batches(0)), data.workers, pin,
                                     data.loader_timeout),
                         InputStage(device, stats, data.decode, False, test_crop, resize), device, flight)
    return Inputs(train, test, sampler, plan, shape, (shape[0], crop, crop) if data.dataset == "imagenet" else shape,
                  classes, BatchMixing(data.mixup_alpha, data.cutmix_alpha, classes, seed) if mixing else None,
                  identity)


class SyntheticImages(Dataset):
    """`n` uint8 images (3, size, size) of uniform random bytes, drawn on demand (no memory
    held), random labels: for throughput runs at real image sizes, where a materialised set
    would take gigabytes. uint8, as ImageNet's images leave the workers: the device turns them
    into floats (input_stats: the mean and std of uniform bytes). A float image of 224 px
    drawn with torch.randn cost a worker 0.45 ms and the queue 602 KB; these bytes (numpy's
    PCG64) cost 0.13 ms and 150 KB (measured on this project's 2-core machine): at a compiled
    ResNet-50's 6,000 images/s the float set needed 3 cores and 3.6 GB/s of copies."""

    def __init__(self, n: int, size: int, num_classes: int, seed: int = 0):
        self.n, self.shape, self.num_classes, self.seed = n, (3, size, size), num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        draws = np.random.default_rng(self.seed * 1_000_003 + index)
        image = torch.from_numpy(draws.integers(0, 256, self.shape, dtype=np.uint8))
        return image, int(draws.integers(self.num_classes))


# The synthetic test images' seed: sample i draws from seed * 1_000_003 + i, so a test seed of 1
# made test sample i the training sample 1_000_003 + i of any set larger than that; this one
# keeps the test draws apart from every training set of fewer than 10**12 samples.
SYNTHETIC_TEST_SEED = 1_000_003

# mean and std of a uniform byte in [0, 1] units: 127.5 / 255, sqrt((256^2 - 1) / 12) / 255
SYNTHETIC_MEAN, SYNTHETIC_STD = (0.5,) * 3, (((256 ** 2 - 1) / 12) ** 0.5 / 255,) * 3


def crop_sizes(dataset: str, image_size: int | None, train_crop: int | None = None, val_resize: int | None = None,
               val_crop: int | None = None) -> tuple[int, int, int]:
    """(train crop, eval resize, eval crop) of ImageNet: --train-crop-size, --val-resize-size,
    --val-crop-size, each defaulting as torchvision's reference does from --image-size (224):
    the crops to it, the resize to 256/224 of the eval crop."""
    side = image_size or DATASET_SHAPES[dataset][0][-1]
    crop = val_crop or side
    return train_crop or side, val_resize or int(crop * 256 / 224), crop


def build_datasets(dataset: str, data_root: str | None, image_size: int | None, synthetic_size: int,
                   train_crop: int | None = None, val_resize: int | None = None, val_crop: int | None = None,
                   decode: str = "tensor", auto_augment: str = "none", random_erase: float = 0.0,
                   ) -> tuple[Dataset, Dataset, tuple[int, ...], int]:
    """(train set, test set, model input shape (C, H, W), number of classes). CIFAR-10,
    ImageNet and synthetic --image-size items are uint8 images (augment.py,
    SyntheticImages; normalised on the device, see input_stats), the others float. With
    random_erase > 0 training items carry their erasing box: (x, y, box). Missing files raise
    FileNotFoundError with a one-line message saying where the data should be."""
    shape, classes = DATASET_SHAPES[dataset]
    if dataset == "synthetic" and image_size:
        train_set, test_set = (SyntheticImages(synthetic_size, image_size, classes, seed=0),
                               SyntheticImages(max(synthetic_size // 4, 1), image_size, classes,
                                               seed=SYNTHETIC_TEST_SEED))
        shape = (3, image_size, image_size)
    elif dataset == "imagenet":
        crop, resize, test_crop = crop_sizes(dataset, image_size, train_crop, val_resize, val_crop)
        train_set = augment.imagenet(data_root, True, crop, resize, decode, auto_augment)
        test_set = augment.imagenet(data_root, False, test_crop, resize, decode)
        data_checks.align_classes(train_set, test_set, classes)
        shape = (3, image_size or shape[-1], image_size or shape[-1])
    elif dataset == "cifar10":
        train_set = augment.cifar10(data_root, True, auto_augment)
        test_set = augment.cifar10(data_root, False)
    else:
        train_kw: dict = {"n": synthetic_size} if dataset == "synthetic" else {}
        train_set, test_set = get_dataset(dataset, "train", data_root, **train_kw), get_dataset(dataset, "test",
                                                                                                data_root)
    if auto_augment != "none" and dataset not in ("imagenet", "cifar10"):
        train_set = augment.Augmented(train_set, augment.auto_augment(auto_augment))
    if random_erase > 0:
        crop = crop_sizes(dataset, image_size, train_crop)[0] if decode == "cuda" else None
        train_set = augment.Erasing(train_set, random_erase, crop)
    return train_set, test_set, shape, classes


def input_stats(dataset: str, image_size: int | None = None) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) the device normalises uint8 images with, per channel in [0, 1] units; None
    for the float datasets (digits, and synthetic without --image-size), used as they are."""
    if dataset == "synthetic":
        return (SYNTHETIC_MEAN, SYNTHETIC_STD) if image_size else None
    return {"cifar10": (CIFAR10_MEAN, CIFAR10_STD), "imagenet": (IMAGENET_MEAN, IMAGENET_STD)}.get(dataset)


def sample_seed(seed: int, epoch: int, index: int, copy: int = 0) -> int:
    """The seed of sample `index`'s augmentation in `epoch` (copy c of it under --ra-reps)."""
    value = ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63
    return (value * 1_000_000_009 + copy) % 2**63 if copy else value


class SeededSamples(Dataset):
    """Items are (epoch, index) or (epoch, index, copy) keys: dataset[index] with torch's CPU
    generator (the one torchvision's random transforms draw from) seeded by sample_seed and
    put back afterwards, so the caller's RNG streams are untouched. Only the CPU generator:
    the `torch.manual_seed` of every CUDA device costs ~170 us a sample (each lazy
    per-device seed records a stack trace) and, in a process that uses a GPU, would reset
    its stream."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, ...]):
        epoch, index, *copy = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index, *copy))
            return self.dataset[index]


def repeated_batch(order: list[int], step: int, global_batch: int, reps: int) -> list[tuple[int, int]]:
    """Global batch `step` of an epoch's `order` under repeated augmentation, as (sample index,
    copy) per position: ceil(B / reps) samples of the order (the step's slice of it), position
    j holding copy j // u of sample j % u (u = ceil(B / reps)), so the copies of a sample lie
    u positions apart and land on different ranks, as torchvision's RASampler spreads them.
    reps = 1: the ElasticSampler's own global batch, each sample once (copy 0)."""
    unique = math.ceil(global_batch / reps)
    chosen = order[step * unique:(step + 1) * unique]
    return [(chosen[j % unique], j // unique) for j in range(global_batch)]


class RankBatches:
    """DataLoader batch_sampler: iterating it yields this rank's share of each global batch
    of the sampler's CURRENT epoch not consumed yet, as [(epoch, index[, copy]), ...]. The
    training loop calls sampler.advance() after each optimizer step; the next iteration
    starts where that left off (after a resume, at any world size).

    The ElasticSampler's contract (order, position, rank_batches) is used as 4.3 defines it;
    two options change only what this wrapper makes of a global batch:
      reps > 1     repeated augmentation (repeated_batch): a step's global batch holds
                   ceil(B / reps) samples of the order, reps copies each, each copy its own
                   augmentation; steps per epoch do not change (each epoch sees about 1/reps
                   of the samples, reps times each), and neither does the position's meaning
      neighbour    each share begins with the sample just before it in the global batch (the
                   last one for rank 0): batch mixing (device_stage.BatchMixing) pairs every
                   sample with its predecessor in the GLOBAL batch, so the pairs are the same
                   at every world size; the extra sample is dropped after mixing."""

    def __init__(self, sampler: ElasticSampler, rank: int, world_size: int, reps: int = 1,
                 neighbour: bool = False):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.reps, self.neighbour = reps, neighbour

    def __iter__(self) -> Iterator[list[tuple[int, ...]]]:
        sampler, epoch = self.sampler, self.sampler.epoch
        if self.reps == 1 and not self.neighbour:  # the plain path: 4.3's rank_batches
            for batch in sampler.rank_batches(self.rank, self.world_size):
                yield [(epoch, i) for i in batch]
            return
        share = rank_share(sampler.global_batch, self.world_size, self.rank)
        order = sampler.order()
        for step in range(sampler.consumed // sampler.global_batch, sampler.steps_per_epoch):
            if self.reps > 1:
                keys = [(epoch, i, c) for i, c in repeated_batch(order, step, sampler.global_batch, self.reps)]
            else:
                keys = [(epoch, i) for i in order[step * sampler.global_batch:(step + 1) * sampler.global_batch]]
            yield ([keys[share.start - 1]] if self.neighbour else []) + keys[share]

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch - self.sampler.consumed // self.sampler.global_batch


def collate(batch: list):
    """default_collate, except for samples that are file bytes for the GPU to decode (--decode
    cuda): their "jpeg" entries become one uint8 tensor, the files end to end, and "jpeg_sizes"
    (N,) their lengths (device_stage.split_files undoes it). One tensor, not a list of N: each
    tensor a worker sends takes a file descriptor, and read_file's own tensors cannot be sent
    at all (torch 2.11 and 2.14: "OSError: Bad file descriptor" in the worker's queue thread,
    and the loader waits forever), so the bytes are copied into fresh memory here anyway."""
    from torch.utils.data import default_collate

    first = batch[0][0]
    if isinstance(first, dict):
        files = [sample[0]["jpeg"] for sample in batch]
        rest = [({k: v for k, v in sample[0].items() if k != "jpeg"}, *sample[1:]) for sample in batch]
        out = default_collate(rest)
        out[0]["jpeg"] = torch.cat(files)
        out[0]["jpeg_sizes"] = torch.tensor([f.numel() for f in files])
        return out
    return default_collate(batch)


def worker_options(workers: int, timeout: float = 0.0) -> dict:
    """The DataLoader options of the trainer's loaders: `workers` persistent worker processes
    that ignore stop signals and die with the rank (lifecycle.loader_worker_init), killed when
    this process exits (lifecycle.kill_workers_at_exit: its exit would wait on them), and
    `timeout` (seconds, with workers): a batch that takes longer raises DataLoader's
    RuntimeError "DataLoader timed out after N seconds"; 0 waits forever."""
    if workers == 0:
        return {"num_workers": 0}
    kill_workers_at_exit()
    return {"num_workers": workers, "persistent_workers": True, "worker_init_fn": loader_worker_init,
            "timeout": timeout}


def train_loader(dataset: Dataset, batches: RankBatches, seed: int, workers: int, pin_memory: bool,
                 timeout: float = 0.0) -> DataLoader:
    """The training DataLoader over `batches`. Its own generator: creating an iterator draws
    the workers' base seed from it, never from the global RNG a checkpoint restores. Workers
    and `timeout`: worker_options."""
    return DataLoader(SeededSamples(dataset, seed), batch_sampler=batches, pin_memory=pin_memory, collate_fn=collate,
                      generator=torch.Generator().manual_seed(seed), **worker_options(workers, timeout))


def eval_loader(dataset: Dataset, rank: int, world_size: int, batch_size: int, workers: int,
                pin_memory: bool, timeout: float = 0.0) -> DataLoader:
    """This rank's contiguous slice of the test set, unshuffled and unpadded (the ranks'
    correct counts and totals are summed, so every test sample counts exactly once).
    Workers and `timeout`: worker_options."""
    from common.split import balanced_ranges

    part = balanced_ranges(len(dataset), world_size, "test samples")[rank]
    subset = torch.utils.data.Subset(dataset, list(part))
    return DataLoader(subset, batch_size=batch_size, pin_memory=pin_memory, generator=torch.Generator().manual_seed(0),
                      collate_fn=collate, **worker_options(workers, timeout))
