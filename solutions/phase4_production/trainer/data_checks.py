"""What the trainer checks of its dataset before it trains on it or reports a test accuracy.

    identity(train, test)                 {"train": {"samples", "sha256"}, "test": {...}}: what the
                                          splits are, kept in every checkpoint (data.Inputs.progress)
    refuse_changed(saved, now, step)      a start that resumes a checkpoint whose dataset is not this
                                          one: one line (ValueError), before a step is trained
    held_out(train, test, rank)           the test set without the samples that are also training
                                          samples (byte for byte), said in a note; one line if none is left
    align_classes(train, test, classes)   ImageFolder: the test split labelled by the training split's
                                          class folders; one line for a test class the training split lacks

What each identity hashes. The digits, synthetic points and CIFAR-10: every sample's bytes and
label, as loaded (a few megabytes; CIFAR-10's 180 MB in about 0.3 s). ImageNet (ImageFolder):
every file's path below its split and its class folder, not the files' bytes (1.3 million files
would take minutes to read at every start): a file added, removed or renamed is seen, a file
rewritten in place under the same name is not. Synthetic images: their generator's parameters.

Why. The data position a checkpoint holds (4.3: epoch and samples consumed, an order drawn from
the seed and the dataset's size) means other samples once the files change, and a test split
that shares samples with the training split reports an accuracy on samples the model was
trained on. Both used to go unseen: a file renamed between two starts resumed on another
order, and a validation folder copied from the training folder inflated the test accuracy.
ImageFolder numbers the class folders of each split by itself, so a validation split that lacks
one class had every label after it shifted.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset


def _base(dataset: Dataset) -> Dataset:
    """The dataset below the wrappers that transform its samples (augment.Augmented, Erasing)."""
    while hasattr(dataset, "dataset") and not isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


def _arrays(dataset: Dataset) -> tuple[Any, Any] | None:
    """(inputs, labels) as numpy arrays for a dataset held in memory (TensorDataset, CIFAR-10), else None."""
    if hasattr(dataset, "tensors"):
        return dataset.tensors[0].numpy(), dataset.tensors[1].numpy()
    data, targets = getattr(dataset, "data", None), getattr(dataset, "targets", None)
    if hasattr(data, "tobytes") and targets is not None:
        return data, np.asarray(targets)
    return None


def _split_identity(dataset: Dataset) -> dict | None:
    """{"samples": n, "sha256": ...} of one split (module docstring), None for a kind of dataset
    this does not know."""
    base, digest = _base(dataset), hashlib.sha256()
    arrays = _arrays(base)
    if arrays is not None:
        for array in arrays:
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array))
    elif hasattr(base, "samples") and hasattr(base, "root"):  # ImageFolder
        skip = len(str(base.root).rstrip(os.sep)) + 1
        for path, label in base.samples:
            digest.update(f"{path[skip:]}\0{base.classes[label]}\n".encode())
    elif hasattr(base, "seed") and hasattr(base, "shape"):  # data.SyntheticImages: drawn from its parameters
        digest.update(repr((len(base), base.shape, base.num_classes, base.seed)).encode())
    else:
        return None
    return {"samples": len(dataset), "sha256": digest.hexdigest()}


def identity(train: Dataset, test: Dataset) -> dict:
    """What a checkpoint records of the dataset it was trained on (module docstring)."""
    return {"train": _split_identity(train), "test": _split_identity(test)}


def refuse_changed(saved: dict | None, now: dict, step: int) -> None:
    """Raise ValueError (one line) when the checkpoint of `step`, trained on `saved`, is resumed
    on another dataset (`now`); checkpoints that predate the record pass."""
    if not saved:
        return
    for split in ("train", "test"):
        was, is_ = saved.get(split), now.get(split)
        if was is None or is_ is None or was == is_:
            continue
        raise ValueError(f"the {split} split is not the one the checkpoint of step {step} was trained with "
                         f"({was['samples']} samples, sha256 {was['sha256'][:12]} then; {is_['samples']} samples, "
                         f"{is_['sha256'][:12]} now): files under --data-root changed between two starts of this "
                         "run; put them back, or start a new run from that checkpoint's weights (another "
                         "--output-dir, --init-from the checkpoint file)")


def _row_keys(arrays) -> list[bytes]:
    inputs = arrays[0].reshape(len(arrays[0]), -1)
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in inputs]


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return hashlib.sha256(fa.read()).digest() == hashlib.sha256(fb.read()).digest()
    except OSError:
        return False


def shared_samples(train: Dataset, test: Dataset) -> list[int]:
    """Indices of the test samples whose input is byte for byte a training sample's. In-memory
    datasets: every sample compared (by hash). ImageFolder: a test file and a training file of
    the same name, compared by content (a copy renamed on the way is not found)."""
    train, test = _base(train), _base(test)
    train_arrays, test_arrays = _arrays(train), _arrays(test)
    if train_arrays is not None and test_arrays is not None:
        if train_arrays[0].shape[1:] != test_arrays[0].shape[1:]:
            return []
        seen = set(_row_keys(train_arrays))
        return [i for i, key in enumerate(_row_keys(test_arrays)) if key in seen]
    if hasattr(train, "samples") and hasattr(test, "samples"):
        by_name: dict[str, list[str]] = {}
        for path, _ in train.samples:
            by_name.setdefault(os.path.basename(path), []).append(path)
        return [i for i, (path, _) in enumerate(test.samples)
                if any(_same_file(path, other) for other in by_name.get(os.path.basename(path), ()))]
    return []


def held_out(train: Dataset, test: Dataset, rank: int) -> Dataset:
    """`test` without the samples that are also training samples (shared_samples), said on rank
    0 in a note; `test` itself when it shares none. ValueError (one line) when it shares all."""
    shared = shared_samples(train, test)
    if not shared:
        return test
    if len(shared) == len(test):
        raise ValueError(f"every one of the {len(test)} test samples is also a training sample: the test split is a "
                         "copy of training data, and its accuracy would measure memory; point --data-root at a "
                         "dataset whose test split is held out")
    if rank == 0:
        print(f"note: {len(shared)} of the {len(test)} test samples are byte for byte training samples (test "
              f"indices {', '.join(map(str, shared[:5]))}{', ...' if len(shared) > 5 else ''}); they are left out of "
              f"the test accuracy, which is over the other {len(test) - len(shared)}", file=sys.stderr, flush=True)
    dropped = set(shared)
    return Subset(test, [i for i in range(len(test)) if i not in dropped])


def align_classes(train: Dataset, test: Dataset, classes: int) -> None:
    """ImageFolder splits: label `test`'s samples by `train`'s class folders (ImageFolder numbers
    each split's own folders, so a class missing from one split shifts the other's labels).
    ValueError (one line) for a test class the training split lacks, or more classes than the
    model's `classes` outputs."""
    if len(train.classes) > classes:
        raise ValueError(f"{train.root} has {len(train.classes)} class folders and the model {classes} outputs: "
                         f"use at most {classes} classes")
    extra = [name for name in test.classes if name not in train.class_to_idx]
    if extra:
        raise ValueError(f"{test.root} has class folders that {train.root} lacks ({', '.join(extra[:3])}"
                         f"{', ...' if len(extra) > 3 else ''}): its samples have no label the model learns; "
                         "give both splits the same class folders")
    if test.class_to_idx == train.class_to_idx:
        return
    test.samples = [(path, train.class_to_idx[test.classes[label]]) for path, label in test.samples]
    test.imgs, test.targets = test.samples, [label for _, label in test.samples]
    test.classes, test.class_to_idx = list(train.classes), dict(train.class_to_idx)
