"""Datasets every phase trains on, behind one function: `get_dataset(name, split)`.

  * "digits"    : 1797 real 8x8 hand-written digits bundled in data/digits.csv.gz.
                  Trains in seconds on a laptop CPU, so every exercise runs anywhere.
  * "synthetic" : random inputs labelled by a fixed random linear "teacher"; any shape.
  * "cifar10"   : 32x32 colour images; you download it (see data/README.md).
  * "imagenet"  : ILSVRC2012 in ImageFolder layout; you download it (see data/README.md).

Every dataset yields (image, label) pairs: image float32 (C, H, W), label int64 scalar.
Nothing here touches the global RNG or the network.
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DIGITS_FILE = "digits.csv.gz"
DIGITS_N_TRAIN = 1437  # of 1797 rows; the other 360 are the test split

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# name -> (input shape (C, H, W), number of classes)
DATASET_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((1, 8, 8), 10),
    "synthetic": ((1, 8, 8), 10),
    "cifar10": ((3, 32, 32), 10),
    "imagenet": ((3, 224, 224), 1000),
}


# ---------------------------------------------------------------------------- digits


@functools.lru_cache(maxsize=4)
def _read_digits(path: str) -> np.ndarray:
    """Parse digits.csv.gz once per process: int64 array (1797, 65), 64 pixels then label."""
    try:
        rows = np.loadtxt(path, delimiter=",", dtype=np.int64)
    except (OSError, EOFError, ValueError, zlib.error) as exc:  # truncated, not gzip, not numbers
        raise ValueError(f"{path} is not a readable digits file ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
                         f"restore the bundled one with `git checkout data/{DIGITS_FILE}`") from None
    if rows.ndim != 2 or rows.shape[1] != 65:
        raise ValueError(f"{path} is not the digits file: expected 65 columns, got shape {rows.shape}")
    return rows


def load_digits(split: str = "train", root: str | Path | None = None) -> TensorDataset:
    """The UCI hand-written digits, split 1437 train / 360 test.

    Returns TensorDataset(images, labels): images float32 (N, 1, 8, 8) in [0, 1],
    labels int64 (N,) in 0..9. The split is a fixed permutation (numpy seed 0), so every
    process and every run sees the same rows; train and test never share a row.
    """
    if split not in ("train", "test"):
        raise ValueError(f"digits split must be 'train' or 'test', got {split!r}")
    path = Path(root if root is not None else DATA_DIR) / DIGITS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"digits dataset not found at {path}: it ships with the repository, "
            f"restore it with `git checkout data/{DIGITS_FILE}` (or re-clone)"
        )
    rows = _read_digits(str(path.resolve()))
    perm = np.random.default_rng(0).permutation(len(rows))
    idx = perm[:DIGITS_N_TRAIN] if split == "train" else perm[DIGITS_N_TRAIN:]
    rows = rows[idx]  # fancy indexing copies, so callers can't corrupt the cache
    images = torch.from_numpy(rows[:, :64]).float().div_(16.0).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(rows[:, 64]).long()
    return TensorDataset(images, labels)


# ------------------------------------------------------------------------- synthetic


def synthetic_classification(
    n: int = 1024,
    num_classes: int = 10,
    shape: tuple = (1, 8, 8),
    seed: int = 0,
    teacher_seed: int = 0,
) -> TensorDataset:
    """n samples x ~ N(0, 1) of `shape`, labelled y = argmax(W @ x.flatten()).

    W (num_classes, prod(shape)) is the "teacher", drawn from `teacher_seed`; x is drawn
    from `seed`. Two sets with the same teacher_seed follow the same rule, so a model
    trained on one can be tested on the other. Returns TensorDataset(x float32
    (n, *shape), y int64 (n,)); same arguments give identical tensors.
    """
    dim = int(np.prod(shape))
    teacher = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(teacher_seed))
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))
    y = (x.reshape(n, dim) @ teacher.T).argmax(dim=1)
    return TensorDataset(x, y)


# ---------------------------------------------------------------- downloaded datasets
# torchvision is imported inside these functions: it takes a second to import, and
# the digits/synthetic path (every rank of every exercise) never needs it.


def _make_cifar10_class() -> type:
    from torchvision.datasets import CIFAR10

    class _CIFAR10(CIFAR10):
        # torchvision checks the md5 of every file, which the tiny files the tests write
        # in the real format cannot match. Existence is enough: a corrupt real file still
        # fails loudly when it is unpickled.
        __qualname__ = "_CIFAR10"  # so pickle finds it as common.data._CIFAR10
        meta = {**CIFAR10.meta, "md5": None}  # md5=None: _load_meta only checks existence

        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

    return _CIFAR10


def _cifar10_class() -> type:
    """The one _CIFAR10 class of this process (pickle insists instances match it)."""
    if "_CIFAR10" not in globals():
        globals()["_CIFAR10"] = _make_cifar10_class()
    return globals()["_CIFAR10"]


def __getattr__(name: str):
    # Module-level __getattr__ (PEP 562) creates _CIFAR10 on first use. DataLoader workers
    # started with "spawn" (macOS, Windows) unpickle the dataset in a fresh process and
    # look its class up by name; a class defined inside a function alone could not be found.
    if name == "_CIFAR10":
        return _cifar10_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cifar10(root: str | Path, train: bool = True, augment: bool = False) -> Dataset:
    """CIFAR-10 from <root>/cifar-10-batches-py (the "python version"; never downloads).

    Items are (float32 (3, 32, 32) normalised per channel, int label 0..9); 50000 train,
    10000 test. augment adds the standard random crop (padding 4) and horizontal flip.
    """
    from torchvision import transforms as T

    folder = Path(root) / "cifar-10-batches-py"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"CIFAR-10 not found under {root}: expected {folder} (see data/README.md for how to download it)"
        )
    cls = _cifar10_class()
    needed = [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 under {folder} is incomplete, missing {', '.join(missing)}: "
            f"extract cifar-10-python.tar.gz again (see data/README.md)"
        )
    steps = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()] if augment else []
    steps += [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    try:
        return cls(str(root), train=train, download=False, transform=T.Compose(steps))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: unpickling raises any of many types
        raise ValueError(f"CIFAR-10 under {folder} cannot be read ({_unreadable_cifar_file(folder, needed)}: "
                         f"{type(exc).__name__}): extract cifar-10-python.tar.gz again (see data/README.md)") from None


def _unreadable_cifar_file(folder: Path, names: list[str]) -> str:
    """The first of `names` in `folder` that does not unpickle as torchvision reads it."""
    import pickle

    for name in names:
        try:
            with open(folder / name, "rb") as f:
                pickle.load(f, encoding="latin1")
        except Exception:  # noqa: BLE001
            return name
    return "a file"


def image_folder(root: str | Path, split: str = "train", image_size: int = 224, augment: bool = False) -> Dataset:
    """ImageNet-style folders: <root>/<split>/<class_name>/<image files>, split train or val.

    Items are (float32 (3, image_size, image_size) normalised, int label); labels index the
    sorted class folder names. augment: random resized crop + flip (training);
    otherwise resize to image_size*256/224 and center crop (evaluation).
    """
    from torchvision import datasets
    from torchvision import transforms as T

    if split not in ("train", "val"):
        raise ValueError(f"image folder split must be 'train' or 'val', got {split!r}")
    folder = Path(root) / split
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no {split} folder at {folder}: expected {root}/{split}/<class_name>/<images> (see data/README.md)"
        )
    if augment:
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size)]
    steps += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    try:
        return datasets.ImageFolder(str(folder), transform=T.Compose(steps))
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise FileNotFoundError(
            f"{folder} is not in ImageFolder layout ({e}): expected {folder}/<class_name>/<images> "
            f"(see data/README.md)"
        ) from None


# ------------------------------------------------------------------------ entry point


def get_dataset(name: str, split: str = "train", root: str | Path | None = None, **kwargs) -> Dataset:
    """The dataset `name` ("digits", "synthetic", "cifar10", "imagenet") for `split`.

    split is "train" or "test"; "val" means the same as "test" (ImageNet calls its
    held-out split val). root is required for cifar10 and imagenet; for digits it
    defaults to DATA_DIR. kwargs go to the builder (e.g. augment=True, image_size=160,
    n=4096). Synthetic train and test are different samples labelled by one teacher.
    """
    if name not in DATASET_SHAPES:
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASET_SHAPES)}")
    if split not in ("train", "test", "val"):
        raise ValueError(f"split must be 'train', 'test' or 'val', got {split!r}")
    train = split == "train"
    if name in ("cifar10", "imagenet") and root is None:
        raise ValueError(f"dataset {name!r} needs --data-root pointing at its files (see data/README.md)")

    if name == "digits":
        return load_digits("train" if train else "test", root=root, **kwargs)
    if name == "synthetic":
        defaults = dict(n=1024, seed=0) if train else dict(n=256, seed=1)
        return synthetic_classification(**{**defaults, **kwargs})
    if name == "cifar10":
        return cifar10(root, train=train, **kwargs)
    return image_folder(root, split="train" if train else "val", **kwargs)
