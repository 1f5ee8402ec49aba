"""What the trainer's DataLoader workers do to one sample: decode, crop, flip, augment, and
draw (not apply) its random-erasing box. Batches leave the workers as uint8 images; the
float conversion, normalisation and erasing run on the training device (device_stage.py).

    ImageNet (--decode)   tensor: torchvision.io.decode_image on the file's bytes, then
                                  torchvision.transforms.v2 on the uint8 tensor (the default;
                                  benchmarks/loader_bench.py measures it against PIL)
                          pil:    PIL decode and PIL resampling (the pipeline of earlier
                                  versions, bit for bit once normalised)
                          cuda:   the worker sends the file's bytes and draws the crop and flip;
                                  the GPU decodes the batch (nvjpeg) and crops it
                                  (device_stage.DeviceDecode)
    train                 RandomResizedCrop(--train-crop-size), horizontal flip, then
                          --auto-augment (RandAugment or TrivialAugmentWide), as torchvision's
                          references/classification/presets.py orders them
    eval                  Resize(--val-resize-size), CenterCrop(--val-crop-size)
    CIFAR-10              RandomCrop(32, padding 4) and flip (train), as before, as uint8
    digits, synthetic     float tensors as stored (already in [0, 1] or standard normal);
                          --auto-augment applies to them too (torchvision's v2 ops take float
                          images)
    --random-erase p      every sample draws, after its other augmentation, whether it is
                          erased (probability p) and where: torchvision.transforms.v2.RandomErasing's
                          own make_params (scale 0.02-0.33, ratio 0.3-3.3, value 0); the box
                          travels with the sample, the device zeroes it after normalisation

Every draw here comes from torch's CPU generator, which data.SeededSamples seeds by
(seed, epoch, index, copy) around each sample: a sample's augmentation does not depend on
which worker loads it, nor on whether the run was restarted.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.utils.data import Dataset

DECODES = ("tensor", "pil", "cuda")
AUTO_AUGMENTS = ("none", "ra", "ta_wide")
NO_BOX = (0, 0, 0, 0)  # an erasing box of no pixels: the sample is not erased


def auto_augment(policy: str):
    """torchvision.transforms.v2's RandAugment ("ra", magnitude 9 as torchvision's reference
    default) or TrivialAugmentWide ("ta_wide"), bilinear as the references; None for "none"."""
    from torchvision.transforms import v2

    if policy == "ra":
        return v2.RandAugment(interpolation=v2.InterpolationMode.BILINEAR)
    if policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)
    return None


def erase_box(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """(i, j, h, w) of the region to erase in an image of `shape` (C, H, W), drawn as
    torchvision.transforms.v2.RandomErasing(p, value=0) draws it (torch.rand(1) >= p: none;
    then its make_params); (0, 0, 0, 0) when the sample is not erased (also when its 10
    attempts find no box that fits, as torchvision's)."""
    from torchvision.transforms import v2

    if torch.rand(1) >= p:
        return torch.tensor(NO_BOX, dtype=torch.int32)
    params = v2.RandomErasing(p=1.0, value=0).make_params([torch.empty(1, 1, 1).expand(*shape)])
    if params["v"] is None:
        return torch.tensor(NO_BOX, dtype=torch.int32)
    return torch.tensor([params["i"], params["j"], params["h"], params["w"]], dtype=torch.int32)


class Augmented(Dataset):
    """dataset[i] = (x, y) with `transform` applied to x (digits, synthetic: float tensors)."""

    def __init__(self, dataset: Dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        return self.transform(x), y


class Erasing(Dataset):
    """dataset[i] = (x, y, box): the sample and its random-erasing box (erase_box), drawn
    after the sample's other augmentation. The box of a sample decoded on the GPU is drawn
    for its crop (`crop` x `crop`)."""

    def __init__(self, dataset: Dataset, p: float, crop: int | None = None):
        self.dataset, self.p, self.crop = dataset, p, crop

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        shape = (3, self.crop, self.crop) if isinstance(x, dict) else tuple(x.shape)
        return x, y, erase_box(shape, self.p)


# ---------------------------------------------------------------- ImageNet: file -> uint8


def read_rgb_tensor(path: str) -> torch.Tensor:
    """uint8 (3, H, W): torchvision.io.decode_image on the file's bytes (libjpeg-turbo for JPEG;
    PNG, WebP, GIF too), converted to RGB. An unreadable file: ValueError naming it."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    try:
        return decode_image(read_file(path), mode=ImageReadMode.RGB)
    except RuntimeError as exc:  # torchvision's C++ errors: "read_file, <source>:83, Expected a non empty file"
        raise _unreadable(path, str(exc).strip().splitlines()[-1].rsplit(", ", 1)[-1]) from None


def read_rgb_pil(path: str):
    """A PIL RGB image, as torchvision's ImageFolder loads one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise _unreadable(path, str(exc)) from None


class UnreadableImage(ValueError):
    """A file of the dataset that is not an image the decoder can read (empty, truncated, another
    format): no restart fixes it, so a ValueError (one line, exit 2). One argument, the message,
    as DataLoader re-raises a worker's exception by its type and message."""


def _unreadable(path: str, why: str) -> UnreadableImage:
    return UnreadableImage(f"cannot read the image {path}: {why}; remove or replace the file")


def read_bytes(path: str) -> torch.Tensor:
    """The file's bytes as a uint8 1-D tensor (for decoding on the GPU)."""
    from torchvision.io import read_file

    return read_file(path)


class ToUint8:
    """A PIL image or a uint8 tensor -> uint8 tensor (3, H, W)."""

    def __call__(self, image):
        if isinstance(image, torch.Tensor):
            return image
        from torchvision.transforms.v2.functional import pil_to_tensor

        return pil_to_tensor(image)


def image_transform(train: bool, crop: int, resize: int, policy: str = "none"):
    """The per-sample transform of an ImageNet image (PIL or uint8 tensor) -> uint8 (3, crop,
    crop): torchvision's ClassificationPresetTrain/Eval without the float steps."""
    from torchvision.transforms import v2

    if train:
        steps = [v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()]
        extra = auto_augment(policy)
        steps += [extra] if extra is not None else []
    else:
        steps = [v2.Resize(resize, antialias=True), v2.CenterCrop(crop)]
    return v2.Compose([*steps, ToUint8()])


class JpegPlan:
    """--decode cuda, in the worker: the file's bytes and the geometry the GPU applies after
    decoding. Train: RandomResizedCrop's box (drawn from the size in the header, the same
    draws as on the CPU paths) and the flip; eval: nothing (the GPU resizes and center-crops).
    --auto-augment runs on the GPU per sample, seeded by the sample's seed (device_stage)."""

    def __init__(self, train: bool, crop: int):
        self.train, self.crop = train, crop

    def __call__(self, data: torch.Tensor) -> dict[str, Any]:
        if not self.train:
            return {"jpeg": data}
        from PIL import Image
        from torchvision.transforms import v2

        width, height = Image.open(io.BytesIO(data.numpy().tobytes())).size  # the header only
        box = v2.RandomResizedCrop(self.crop).make_params([torch.empty(1, 1, 1).expand(3, height, width)])
        flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip's draw
        return {"jpeg": data, "box": torch.tensor([box["top"], box["left"], box["height"], box["width"]]),
                "flip": torch.tensor(flip), "seed": torch.randint(2**62, ())}


def imagenet(root: str, train: bool, crop: int, resize: int, decode: str, policy: str = "none") -> Dataset:
    """The ImageFolder of `root`/train or `root`/val (common.data.image_folder's checks and one-line
    errors), loading and transforming as --decode says (module docstring)."""
    from common.data import image_folder

    folder = image_folder(root, "train" if train else "val", image_size=crop)
    if decode == "cuda":
        folder.loader, folder.transform = read_bytes, JpegPlan(train, crop)
    else:
        folder.loader = read_rgb_tensor if decode == "tensor" else read_rgb_pil
        folder.transform = image_transform(train, crop, resize, policy)
    return folder


def cifar10(root: str, train: bool, policy: str = "none") -> Dataset:
    """CIFAR-10 (common.data.cifar10's checks) as uint8 (3, 32, 32): RandomCrop(32, padding 4),
    flip and --auto-augment for training, the same draws as the float pipeline of before."""
    from torchvision.transforms import v2

    from common.data import cifar10 as load

    data = load(root, train=train, augment=False)
    steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if train else []
    extra = auto_augment(policy) if train else None
    data.transform = v2.Compose([*steps, *([extra] if extra is not None else []), ToUint8()])
    return data
