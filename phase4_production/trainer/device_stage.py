"""The trainer's input pipeline on the training device: the part of data loading that runs
where the model runs, after the DataLoader workers (augment.py) have done theirs.

    DeviceBatches(loader, stage, device)   iterate the loader's batches, ready on the device:
                                           on CUDA the NEXT batch is copied from pinned memory
                                           and prepared on a side stream while the current
                                           step runs (timm's PrefetchLoader pattern); on the
                                           CPU the same code, with the CPU as the device and
                                           no stream; each wait for the loader's workers an
                                           entry of the flight record (flight.py), so that a
                                           stuck worker is named when --loader-timeout ends it
    InputStage(device, stats, decode)      one batch: to the device (non-blocking), --decode
                                           cuda's batched decode and crops, uint8 -> float in
                                           [0, 1], normalised (mean, std), then each sample's
                                           random-erasing box set to 0 (torchvision's
                                           RandomErasing value 0, after Normalize)
    BatchMixing(cfg, classes)              MixUp or CutMix, chosen per step as torchvision's
                                           reference chooses them (v2.RandomChoice), with
                                           torchvision's own v2.MixUp/v2.CutMix; its draws
                                           come from a host generator seeded by (seed, step)

Nothing here reads a value back from the device: no .item(), no synchronisation (the test
counts them). Batch mixing pairs each sample with the one before it in the GLOBAL batch (the
loader sends each rank the sample before its share, data.RankBatches), and every rank
draws the same (lambda, box) for a step, so the mixed batch is the same at every world size.
data.build_inputs puts the pipeline together (the one entry point).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from common.launch import USER_ERRORS
from phase4_production.trainer.augment import auto_augment


class InputStage:
    """A loader batch -> (x, y) on `device`, float x, as the model takes it (module docstring).
    stats: (mean, std) per channel for uint8 images, None for float datasets (used as they
    are). decode: augment's --decode (cuda: the batch holds file bytes to decode here);
    crop/resize: the sizes the GPU decode path crops and resizes to; policy: --auto-augment,
    applied per sample on the device on the cuda path (CPU paths: in the workers)."""

    def __init__(self, device: torch.device, stats=None, decode: str = "tensor", train: bool = True,
                 crop: int | None = None, resize: int | None = None, policy: str = "none"):
        self.device, self.decode, self.train = device, decode, train
        self.mean = self.std = None
        if stats is not None:
            self.mean = torch.tensor(stats[0], device=device).view(1, -1, 1, 1)
            self.std = torch.tensor(stats[1], device=device).view(1, -1, 1, 1)
        self.decoder = DeviceDecode(device, train, crop, resize, policy) if decode == "cuda" else None

    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, *box = batch
        y = y.to(self.device, non_blocking=True)
        if isinstance(x, dict):  # --decode cuda: file bytes and the crops the workers drew
            x = self.decoder(x)
        else:
            x = x.to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:  # torchvision's ToDtype(float32, scale=True), then Normalize
            x = x.float().div_(255)
            if self.mean is not None:
                x = x.sub_(self.mean).div_(self.std)
        if box:
            x = erase(x, box[0].to(self.device, non_blocking=True))
        return x, y


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Set box (i, j, h, w) of each image of x (N, C, H, W) to 0; a box of h = w = 0 erases
    nothing. One mask for the batch, no per-sample loop, nothing read back to the host."""
    rows = torch.arange(x.shape[-2], device=x.device).view(1, -1, 1)
    cols = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
    i, j, h, w = (boxes[:, k].view(-1, 1, 1) for k in range(4))
    inside = (rows >= i) & (rows < i + h) & (cols >= j) & (cols < j + w)
    return x.masked_fill_(inside.unsqueeze(1), 0.0)


def split_files(batch: dict) -> list[torch.Tensor]:
    """The files' bytes of a --decode cuda batch (data.collate): views of its one
    "jpeg" tensor, one 1-D uint8 tensor per file."""
    return list(torch.split(batch["jpeg"], batch["jpeg_sizes"].tolist()))


class DeviceDecode:
    """--decode cuda: torchvision.io.decode_jpeg on a list of files' bytes with device=the
    training device (nvjpeg, batched), then per sample what the workers drew: train:
    RandomResizedCrop's box resized to `crop`, the flip, --auto-augment (seeded by the
    sample's seed); eval: Resize(`resize`), CenterCrop(`crop`). Files that are not JPEG
    (nvjpeg reads JPEG only) are decoded on the CPU (decode_image) and copied."""

    def __init__(self, device: torch.device, train: bool, crop: int, resize: int | None, policy: str = "none"):
        self.device, self.train, self.crop, self.resize = device, train, crop, resize
        self.augment = auto_augment(policy) if train else None

    def __call__(self, batch: dict) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_image, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        files = split_files(batch)
        jpeg = [k for k, data in enumerate(files) if data.numel() > 2 and data[0] == 0xFF and data[1] == 0xD8]
        images: list = [None] * len(files)
        if jpeg:
            decoded = decode_jpeg([files[k] for k in jpeg], mode=ImageReadMode.RGB, device=self.device)
            for k, image in zip(jpeg, decoded):
                images[k] = image
        for k, data in enumerate(files):
            if images[k] is None:
                images[k] = decode_image(data, mode=ImageReadMode.RGB).to(self.device, non_blocking=True)
        out = []
        for k, image in enumerate(images):
            if self.train:
                top, left, height, width = batch["box"][k].tolist()  # drawn in the worker: host values
                image = F.resized_crop(image, top, left, height, width, [self.crop, self.crop], antialias=True)
                if bool(batch["flip"][k]):
                    image = F.horizontal_flip(image)
                if self.augment is not None:
                    with torch.random.fork_rng(devices=[]):  # the sample's own draws, as in a worker
                        torch.default_generator.manual_seed(int(batch["seed"][k]))
                        image = self.augment(image)
            else:
                image = F.center_crop(F.resize(image, self.resize, antialias=True), self.crop)
            out.append(image)
        return torch.stack(out)


def worker_error_line(message: str) -> str:
    """The error itself out of what DataLoader re-raises for a worker ("Caught ValueError in
    DataLoader worker process 0.", the worker's traceback, then "ValueError: <message>"): its
    message; any other message as it is."""
    lines = message.strip().splitlines()
    if not (lines and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]):
        return message
    return lines[-1].split(": ", 1)[-1]


class DeviceBatches:
    """The batches of `loader` prepared by `stage`, one ahead: while step k runs, batch k+1 is
    copied and prepared. On CUDA the copy and preparation run on a side stream (pinned memory
    makes the copy asynchronous); the training stream waits for that stream before it uses
    the batch, and the batch's memory is marked as used by the training stream (record_stream)
    so the caching allocator does not hand it out while the step still reads it. On the CPU
    the same code prepares the batch in place (there is no stream to overlap with)."""

    def __init__(self, loader, stage: InputStage, device: torch.device, flight=None):
        self.loader, self.stage, self.device, self.flight = loader, stage, device, flight

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        batches = iter(self.loader)
        ready = self._prepare(batches, stream)
        while ready is not None:
            if stream is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(stream)
                for t in ready:
                    t.record_stream(current)
            following = self._prepare(batches, stream)  # the next batch's copy overlaps this step
            yield ready
            ready = following

    def _prepare(self, batches, stream):
        try:
            with self.flight.loading(self.loader) if self.flight is not None else contextlib.nullcontext():
                batch = next(batches, None)
        except USER_ERRORS as exc:  # bad input, raised in a loader worker
            raise type(exc)(worker_error_line(str(exc))) from None
        if batch is None:
            return None
        if stream is None:
            return self.stage(batch)
        with torch.cuda.stream(stream):
            return self.stage(batch)


class BatchMixing:
    """MixUp (alpha --mixup-alpha) or CutMix (alpha --cutmix-alpha) of a batch whose first
    sample is the predecessor of the rank's share (data.RankBatches' neighbour):
    torchvision.transforms.v2.MixUp/CutMix pair each sample with the previous one (roll by 1),
    so after dropping the first sample every sample is mixed with its predecessor in the global
    batch. One of the two is chosen per step with equal probability when both alphas are set
    (torchvision's reference: v2.RandomChoice([MixUp, CutMix])). The labels become soft
    targets (N, classes) that CrossEntropyLoss takes, label smoothing included.

    The draws (the choice, lambda ~ Beta(alpha, alpha), CutMix's box centre) are the ones
    torchvision makes, from numpy's generator seeded by (seed, step) instead of torch's global
    one: every rank draws the same values for a step, a resumed run draws what the
    uninterrupted one drew, and no draw is a tensor read back from the device."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int):
        from torchvision.transforms import v2

        class _Drawn:  # v2's transform with the parameters drawn here
            params: dict = {}

            def make_params(self, flat_inputs):
                return self.params

        self.mixers, self.cutmix = [], []  # v2's transforms; whether each is CutMix
        if mixup_alpha > 0:
            self.mixers.append(type("MixUp", (_Drawn, v2.MixUp), {})(alpha=mixup_alpha, num_classes=num_classes))
            self.cutmix.append(False)
        if cutmix_alpha > 0:
            self.mixers.append(type("CutMix", (_Drawn, v2.CutMix), {})(alpha=cutmix_alpha, num_classes=num_classes))
            self.cutmix.append(True)
        self.seed = seed

    def draw(self, step: int, height: int, width: int) -> tuple[int, dict]:
        """(which mixer, its parameters) of global step `step`: the same on every rank."""
        rng = np.random.default_rng([self.seed, step, 0x6D6978])
        which = int(rng.integers(len(self.mixers))) if len(self.mixers) > 1 else 0
        mixer = self.mixers[which]
        lam = float(rng.beta(mixer.alpha, mixer.alpha))
        if not self.cutmix[which]:
            return which, {"lam": lam}
        r_x, r_y = int(rng.integers(width)), int(rng.integers(height))  # v2.CutMix.make_params, as drawn there
        r = 0.5 * np.sqrt(1.0 - lam)
        r_w_half, r_h_half = int(r * width), int(r * height)
        x1, y1 = max(r_x - r_w_half, 0), max(r_y - r_h_half, 0)
        x2, y2 = min(r_x + r_w_half, width), min(r_y + r_h_half, height)
        return which, {"box": (x1, y1, x2, y2), "lam_adjusted": float(1.0 - (x2 - x1) * (y2 - y1) / (width * height))}

    def __call__(self, x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        which, params = self.draw(step, x.shape[-2], x.shape[-1])
        mixer = self.mixers[which]
        mixer.params = params
        x, y = mixer(x, y)
        return x[1:], y[1:]


def measure_loader(batches: DeviceBatches, steps: int, device: torch.device, warmup: int = 3) -> dict:
    """--benchmark-loader: images/s of the input pipeline alone (workers, the copy to the
    device and the device stage; no model), over `steps` batches after `warmup` (worker
    start-up), the data position standing still (the epoch's batches again if it ends).
    Rank 0's rate, and the sum over the ranks (collective)."""
    import time

    import torch.distributed as dist

    seen, began, images = 0, None, 0
    iterator = iter(batches)
    while seen < warmup + steps:
        batch = next(iterator, None)
        if batch is None:
            iterator = iter(batches)
            continue
        seen += 1
        if seen == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
        elif seen > warmup:
            images += len(batch[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - (began if began is not None else time.perf_counter())
    rate = images / seconds if seconds > 0 else 0.0
    total = torch.tensor([rate], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo")
        dist.all_reduce(total, group=group)
    return {"images_per_s": rate, "all_images_per_s": float(total[0]), "steps": steps, "warmup": warmup,
            "seconds": seconds, "batch": images // max(steps, 1)}
