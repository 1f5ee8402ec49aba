"""The trainer's ImageNet input pipeline: images/s per loader worker, side by side.

    python benchmarks/loader_bench.py                      # 512 JPEGs of 500x375, 224 px crops
    python benchmarks/loader_bench.py --images 64 --rounds 1 --json out.json

It writes the JPEG files itself (an ImageFolder of real-sized images: smooth colour fields
with texture and noise, quality 90, about 70 KB each) and times, in one run and in
alternating order (so that a shared machine's drift hits each alike), a DataLoader with
--workers worker processes (default 1: its rate is one core's) over each pipeline:

    before        the trainer's pipeline before the uint8 change, kept here for comparison:
                  per-sample seeding (SeededSamples), PIL decode, RandomResizedCrop and flip
                  on the PIL image, ToTensor and Normalize in the worker: float32 batches
    torchvision   plain torchvision: ImageFolder + DataLoader (RandomSampler), the same
                  transforms, no seeding
    pil           --decode pil: the same PIL steps, uint8 out (normalised on the device)
    tensor        --decode tensor (the default): torchvision.io.decode_image on the file's
                  bytes, transforms.v2 on the uint8 tensor
    cuda          --decode cuda: workers read bytes and draw crops, the GPU decodes the batch
                  (nvjpeg); GPUs only, reported as skipped elsewhere

images/s per worker = images / seconds / workers, the main process only receiving batches:
the workers' work, which is what the paths change. For the uint8 paths the device's share
(float conversion, normalisation, erasing: trainer/device_stage.py: InputStage) runs where the model
runs, on the GPU in training; it is timed apart, on this CPU, on the batches received (the
"device stage" line: what it costs a CPU-only run's training process). The ratios are what
the README quotes; absolute numbers depend on the machine.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._util import OneLineParser, save_outputs  # noqa: E402

PIPELINES = ("before", "torchvision", "pil", "tensor", "cuda")


def write_jpegs(folder: Path, n: int, width: int, height: int, first: int = 0) -> None:
    """n JPEG files in ImageFolder layout (two classes), quality 90: files first..first+n-1
    (several processes can write one folder, each its own range)."""
    from PIL import Image

    rng = np.random.default_rng(first)
    yy, xx = np.mgrid[0:height, 0:width]
    for k in range(first, first + n):
        cls = folder / "train" / f"class{k % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        f = 12 + k % 17
        pixels = np.stack([np.sin(xx / (f + 3 * c) + k) * 70 + np.cos(yy / (f + 5 * c)) * 50 + 128
                           for c in range(3)], -1) + rng.normal(0, 10, (height, width, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(cls / f"{k}.jpg", quality=90)
    (folder / "val").mkdir(exist_ok=True)
    for cls in (folder / "train").iterdir():  # a val split, so that the trainer's folder checks pass
        (folder / "val" / cls.name).mkdir(exist_ok=True)
        first = next(cls.iterdir())
        (folder / "val" / cls.name / first.name).write_bytes(first.read_bytes())


def _old_transform(crop: int):
    """The trainer's training transform before the uint8 pipeline (common.data.image_folder)."""
    from torchvision import transforms as T

    from common.data import IMAGENET_MEAN, IMAGENET_STD

    return T.Compose([T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class _Keys(torch.utils.data.Sampler):
    """`batches` batches of (epoch, index) keys in seeded random orders, epoch after epoch, as
    the trainer's RankBatches hands them out."""

    def __init__(self, n: int, batch: int, batches: int):
        self.n, self.batch, self.batches = n, batch, batches

    def __iter__(self):
        done, epoch = 0, 0
        while True:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist()
            for start in range(0, self.n - self.batch + 1, self.batch):
                if done == self.batches:
                    return
                yield [(epoch, i) for i in order[start:start + self.batch]]
                done += 1
            epoch += 1

    def __len__(self) -> int:
        return self.batches


def make_loader(name: str, root: Path, crop: int, batch: int, workers: int, batches: int):
    """(DataLoader of `batches` batches, the device stage or None) of pipeline `name`."""
    from torch.utils.data import DataLoader
    from torchvision import datasets

    from common.data import IMAGENET_MEAN, IMAGENET_STD
    from solutions.phase4_production.trainer.augment import imagenet
    from solutions.phase4_production.trainer.data import SeededSamples, collate, worker_options
    from solutions.phase4_production.trainer.device_stage import InputStage

    options = worker_options(workers)
    if name == "torchvision":
        data = datasets.ImageFolder(str(root / "train"), transform=_old_transform(crop))
        sampler = torch.utils.data.RandomSampler(data, num_samples=batches * batch)  # epoch after epoch
        return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True, **options), None
    if name == "before":
        data = datasets.ImageFolder(str(root / "train"), transform=_old_transform(crop))
    else:
        data = imagenet(str(root), True, crop, int(crop * 256 / 224), name)
    loader = DataLoader(SeededSamples(data, seed=0), batch_sampler=_Keys(len(data), batch, batches), collate_fn=collate,
                        generator=torch.Generator().manual_seed(0), **options)
    device = torch.device("cuda") if name == "cuda" else torch.device("cpu")
    stage = None if name == "before" else InputStage(device, (IMAGENET_MEAN, IMAGENET_STD), name, True, crop,
                                                     int(crop * 256 / 224))
    return loader, stage


def time_pipeline(loader, stage) -> tuple[float, int, float | None]:
    """(seconds, images) of the loader's batches after the first (worker start-up), and the
    device stage's images/s on the last batch (None without a stage)."""
    iterator = iter(loader)
    batch = next(iterator)
    began, images = time.perf_counter(), 0
    for batch in iterator:
        images += len(batch[1])
    seconds = time.perf_counter() - began
    if stage is None:
        return seconds, images, None
    stage(batch)  # warm-up (the GPU path: nvjpeg's first call)
    began = time.perf_counter()
    for _ in range(3):
        x = stage(batch)[0]
    if x.is_cuda:
        torch.cuda.synchronize()
    return seconds, images, 3 * len(batch[1]) / (time.perf_counter() - began)


def run(args) -> dict:
    torch.set_num_threads(1)  # as in a DataLoader worker: one core per pipeline step
    names = [p for p in PIPELINES if p != "cuda" or torch.cuda.is_available()]
    rates: dict[str, list[float]] = {name: [] for name in names}
    stages: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_jpegs(root, args.images, args.width, args.height)
        kbytes = statistics.mean(p.stat().st_size for p in (root / "train").rglob("*.jpg")) / 1024
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                loader, stage = make_loader(name, root, args.crop, args.batch, args.workers, args.batches + 1)
                seconds, images, stage_rate = time_pipeline(loader, stage)
                rates[name].append(images / seconds / max(args.workers, 1))
                if stage_rate is not None:
                    stages[name].append(stage_rate)
                del loader
    return {"rates": rates, "stages": {k: v for k, v in stages.items() if v}, "kbytes": kbytes, "skipped": [p for p in PIPELINES if p not in names],
            "settings": vars(args)}


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512, help="JPEG files written (and read)")
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--crop", type=int, default=224, help="the training crop (RandomResizedCrop)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=32, help="batches timed per pipeline and round")
    parser.add_argument("--workers", type=int, default=1, help="loader worker processes per pipeline")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating the pipelines' order")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args(argv)
    if min(args.images, args.batch, args.batches, args.rounds, args.crop) < 1 or args.workers < 0 \
            or args.images < args.batch:
        parser.error("need positive sizes, --workers >= 0 and --images >= --batch")
    result = run(args)
    rates = {name: statistics.median(values) for name, values in result["rates"].items()}
    print(f"{args.images} JPEGs of {args.width}x{args.height} ({result['kbytes']:.0f} KB average), crop {args.crop}, "
          f"batch {args.batch}, {args.workers} worker(s) per pipeline, {args.rounds} alternating round(s); "
          f"torch {torch.__version__}, torchvision {__import__('torchvision').__version__}")
    print(f"{'pipeline':<14}{'images/s per worker':>21}{'vs before':>11}{'vs torchvision':>16}   (rounds)")
    for name, rate in rates.items():
        spread = ", ".join(f"{v:.0f}" for v in result["rates"][name])
        print(f"{name:<14}{rate:>21.0f}{rate / rates['before']:>10.2f}x{rate / rates['torchvision']:>15.2f}x   ({spread})")
    for name in result["skipped"]:
        print(f"{name:<14}{'skipped: no GPU':>21}")
    stages = {name: statistics.median(v) for name, v in result["stages"].items()}
    print("device stage (uint8 -> normalised float, on " + ("the GPU for cuda, " if "cuda" in stages else "")
          + "this CPU otherwise; in training it runs where the model runs): "
          + ", ".join(f"{name} {rate:.0f} images/s" for name, rate in stages.items()))
    save_outputs({**result, "medians": rates}, args.json)


if __name__ == "__main__":
    main()
