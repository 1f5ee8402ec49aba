"""The trainer's configuration: one dataclass, a recipe file, command-line overrides.

    defaults (TrainConfig)  <  --config recipe.toml  <  --flags on the command line

Every field is a flag (`max_restarts` would be `--max-restarts`); `--help` lists them all
with their defaults. A recipe is a TOML file whose keys are field names, e.g.
recipes/cifar10_resnet18.toml. Values are checked here, before any process starts, so a
typo is one line on stderr, not a traceback from every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from common.data import DATASET_SHAPES
from common.models import MODEL_NAMES

_HERE = Path(__file__).resolve().parent
# The recipes ship once, with the reference; the learner's copy of this file finds them there.
RECIPES = _HERE / "recipes" if (_HERE / "recipes").is_dir() else _HERE.parent / "solutions" / _HERE.name / "recipes"
AMP_MODES = ("auto", "bf16", "fp16", "off")
OPTIMIZERS = ("sgd", "adamw")
COMPRESSIONS = ("none", "powersgd", "topk", "dgc")


def _opt(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class TrainConfig:
    """Everything a run depends on. Sizes are samples; lr is for `reference_batch`."""

    # data
    dataset: str = _opt("digits", "dataset to train on", choices=sorted(DATASET_SHAPES))
    data_root: str | None = _opt(None, "folder holding CIFAR-10 or ImageNet (see data/README.md)")
    image_size: int | None = _opt(None, "ImageNet: the model's input side in pixels (ViT's size) and the default of "
                                        "--train-crop-size and --val-crop-size (None: 224)")
    synthetic_size: int = _opt(4096, "samples of the synthetic training set")
    workers: int = _opt(0, "DataLoader worker processes per rank (0: load in the training process, right for in-memory digits)")
    decode: str = _opt("tensor", "ImageNet: how the loader workers decode and crop: tensor (torchvision.io.decode_image "
                                 "on the file's bytes, transforms.v2 on uint8 tensors), pil (PIL, the pipeline of "
                                 "earlier versions) or cuda (the GPU decodes each batch with nvjpeg; GPUs only); "
                                 "the same augmentation either way", choices=("tensor", "pil", "cuda"))
    train_crop_size: int | None = _opt(None, "ImageNet: side of the training crop, RandomResizedCrop (torchvision's "
                                             "--train-crop-size; None: --image-size)")
    val_resize_size: int | None = _opt(None, "ImageNet: evaluation images are resized to this shorter side, then "
                                             "center-cropped (torchvision's --val-resize-size; None: 256/224 of the "
                                             "crop)")
    val_crop_size: int | None = _opt(None, "ImageNet: side of the evaluation center crop (torchvision's "
                                           "--val-crop-size; None: --image-size)")
    auto_augment: str = _opt("none", "per-sample augmentation policy after crop and flip: ra (RandAugment, "
                                     "magnitude 9) or ta_wide (TrivialAugmentWide), torchvision's --auto-augment",
                             choices=("none", "ra", "ta_wide"))
    random_erase: float = _opt(0.0, "probability that a training sample gets a random box erased (RandomErasing "
                                    "after normalisation, applied on the device; torchvision's --random-erase)")
    mixup_alpha: float = _opt(0.0, "MixUp of each sample with its predecessor in the global batch, lambda ~ "
                                   "Beta(alpha, alpha); with --cutmix-alpha one of the two per step (0: off)")
    cutmix_alpha: float = _opt(0.0, "CutMix, as --mixup-alpha (0: off)")
    ra_reps: int = _opt(1, "repeated augmentation: each global batch holds 1/R as many samples, R differently "
                           "augmented copies of each (torchvision's --ra-sampler --ra-reps R; 1: off)")
    # model
    model: str = _opt("resnet18", "torchvision model (CIFAR stem below 64 px)", choices=MODEL_NAMES)
    sync_bn: bool = _opt(False, "BatchNorm statistics over the global batch (SyncBatchNorm, GPUs only): for small "
                                "per-GPU batches; costs an all-reduce per BatchNorm layer in forward and backward")
    init_from: str | None = _opt(None, "start a new run from these weights: a checkpoint of this trainer, or a "
                                       "state_dict file such as torchvision's (ignored when the run resumes)")
    channels_last: str = _opt("auto", "channels_last memory format (auto: on GPU only); under --parallel fsdp the "
                                      "inputs only, the parameters stay contiguous as fully_shard requires (a "
                                      "channels_last input alone makes cuDNN's convolution channels_last)",
                              choices=("auto", "on", "off"))
    parallel: str = _opt("ddp", "how the ranks hold the model: ddp (every rank a full replica; rank 0 writes one "
                                "checkpoint file) or fsdp (torch's fully_shard: each rank 1/N of the parameters, "
                                "gradients and optimizer state, and writes only its shards; for models whose "
                                "training state does not fit one GPU)", choices=("ddp", "fsdp"))
    reshard_after_forward: bool = _opt(True, "fsdp: free each unit's gathered parameters after its forward and "
                                             "all-gather them again for its backward (false: keep them until the "
                                             "backward, ZeRO-2-like memory for one all-gather less per unit)")
    cpu_offload: bool = _opt(False, "fsdp: keep the parameter shards, gradients and optimizer state in CPU memory "
                                    "(CPUOffloadPolicy; the optimizer steps on the CPU): for models that do not fit "
                                    "even sharded, at the cost of host-device copies every step")
    compile: bool = _opt(False, "torch.compile the model")
    # optimisation
    epochs: int = _opt(3, "epochs to train")
    global_batch: int = _opt(64, "samples per optimizer step over all ranks (fixed at any world size)")
    micro_batch: int | None = _opt(None, "most samples per forward pass on one rank; more: gradient accumulation")
    optimizer: str = _opt("sgd", "sgd (momentum, nesterov) or adamw", choices=OPTIMIZERS)
    lr: float = _opt(0.02, "peak learning rate for a global batch of --reference-batch")
    reference_batch: int = _opt(64, "the global batch --lr was tuned for: the lr scales by global_batch / this "
                                    "(sgd, the linear rule) or its square root (adamw: a heuristic, the lr alone; "
                                    "betas, eps and --weight-decay are not rescaled)")
    momentum: float = _opt(0.9, "SGD momentum (nesterov)")
    weight_decay: float = _opt(5e-4, "weight decay of the weights (see the next three for norms, biases and "
                                     "embeddings)")
    norm_weight_decay: float = _opt(0.0, "weight decay of normalisation layers' parameters (torchvision's "
                                         "--norm-weight-decay)")
    bias_weight_decay: float = _opt(0.0, "weight decay of the other 1-D parameters, biases (torchvision's "
                                         "--bias-weight-decay)")
    transformer_embedding_decay: float | None = _opt(None, "weight decay of ViT's class token and position "
                                                           "embedding (torchvision's --transformer-embedding-decay; "
                                                           "None: --weight-decay)")
    warmup_epochs: float = _opt(0.5, "linear warm-up from a tenth of the peak lr to it (torchvision-style), then "
                                     "cosine decay to 0")
    label_smoothing: float = _opt(0.0, "label smoothing of the cross-entropy loss")
    grad_clip: float = _opt(0.0, "clip the gradient norm to this (0: off)")
    model_ema: bool = _opt(False, "keep an exponential moving average of the weights (and BatchNorm statistics), "
                                  "evaluated beside the model at every epoch end (torchvision's --model-ema)")
    model_ema_steps: int = _opt(32, "update the average every N optimizer steps (torchvision's --model-ema-steps)")
    model_ema_decay: float = _opt(0.99998, "EMA decay per sample-epoch, adjusted for --model-ema-steps, the "
                                           "global batch and --epochs as torchvision's --model-ema-decay")
    amp: str = _opt("auto", "mixed precision (auto: bf16 on GPUs that have it, else fp16 + GradScaler; off on CPU)",
                    choices=AMP_MODES)
    compression: str = _opt("none", "gradient compression as a DDP comm hook (4.4); dgc: top-k with DGC's momentum "
                                    "correction (SGD's momentum and weight decay move into the hook)", choices=COMPRESSIONS)
    compression_rank: int = _opt(4, "PowerSGD rank")
    topk_ratio: float = _opt(0.01, "top-k: fraction of gradient elements sent")
    topk_warmup: int = _opt(0, "top-k and dgc: steps from --compression-start over which the fraction sent falls "
                               "exponentially from 0.25 to --topk-ratio (DGC's sparsity warm-up; 0: none)")
    compression_start: int = _opt(10, "step from which --compression compresses (plain all-reduce before it, "
                                      "and in the first 2 steps of every restart; torch's PowerSGD default: 1000)")
    seed: int = _opt(0, "seed of the weights, the data order and the augmentation")
    deterministic: bool = _opt(False, "deterministic kernels (torch.use_deterministic_algorithms; on GPUs also "
                                      "CUBLAS_WORKSPACE_CONFIG and no cuDNN autotuning)")
    # fault tolerance
    output_dir: str = _opt("runs/digits", "checkpoints, metrics and traces go here; a run resumes from it")
    checkpoint_every: int = _opt(20, "save every N steps (and at every epoch end)")
    keep: int = _opt(3, "checkpoints kept (the newest)")
    async_checkpoint: str = _opt("auto", "write each checkpoint in a background thread from a CPU copy of the "
                                         "state, so the step waits for the copy, not for the write, hash and fsync "
                                         "(auto: on GPUs; off on the CPU, where the thread slows a CPU-bound step "
                                         "more than the write it hides: benchmarks/checkpoint_bench.py)",
                                 choices=("auto", "on", "off"))
    fail_at_step: int | None = _opt(None, "chaos: on the first attempt one rank SIGKILLs itself at this step")
    fail_rank: int = _opt(1, "the rank --fail-at-step kills")
    evaluate: bool = _opt(False, "evaluate the newest checkpoint in --output-dir (or --init-from's weights) on the "
                                 "test set and exit: no training, nothing written")
    export: str | None = _opt(None, "write the model weights of the newest checkpoint in --output-dir to this file "
                                    "as one plain state_dict (torch.save; loads into the torchvision model, or "
                                    "as --init-from) and exit; works for sharded (fsdp) and ddp checkpoints")
    # observability
    log_every: int = _opt(10, "metrics line every N steps")
    straggler_every: int = _opt(50, "gather per-rank step times every N steps and name slow ranks")
    straggler_threshold: float = _opt(0.2, "a rank this much slower than the median is a straggler")
    profile_steps: int = _opt(0, "record N steps with torch.profiler (after 5 skipped and 2 warm-up)")
    tensorboard: bool | None = _opt(None, "also write TensorBoard scalars (train/loss, eval/accuracy, ...) to "
                                          "OUTPUT_DIR/tensorboard (None: when tensorboard is installed; true: warn "
                                          "when it is not)")
    progress: bool = _opt(True, "show progress on rank 0: a bar on a terminal, a plain line every --log-every steps "
                                "when stderr is not one (a log file)")
    max_steps: int | None = _opt(None, "stop after this many steps in all (a shorter run of the same schedule)")
    benchmark_loader: int | None = _opt(None, "run only the input pipeline (loader workers and the device stage) "
                                              "for N steps, print images/s and exit: nothing trained or written")
    apply_changes: bool = _opt(False, "on resume, continue with hyperparameters that differ from the checkpoint's "
                                      "(--lr, --momentum, --weight-decay, --epochs, --warmup-epochs, ...) instead of "
                                      "refusing: the optimizer takes the new values, and the LR schedule is recomputed "
                                      "for the new --epochs/--warmup-epochs at the resumed step (the LR jumps to it)")
    stop_check_every: int = _opt(1, "agree on a stop signal every N steps (an all-reduce of a CPU flag over a "
                                    "gloo group per check: a host collective, no device synchronisation); a "
                                    "preemption then waits up to N steps longer before the save: keep N x step time "
                                    "well inside the grace period")
    pg_timeout: float = _opt(300.0, "seconds a collective may wait for the other ranks once the first step is done: "
                                    "a rank stuck or dead ends the attempt after this long (torchrun restarts it)")
    pg_init_timeout: float = _opt(900.0, "the same, from the start to the end of the first step (data, model, "
                                         "resume, compilation and autotuning may be slow on some ranks)")
    loader_timeout: float = _opt(900.0, "seconds the loop waits for one batch from its loader workers (--workers > "
                                        "0): a worker stuck on a file system that stopped answering, or on a "
                                        "sample that never returns, ends the attempt after this long (torchrun "
                                        "restarts it) instead of hanging the run")
    # launch
    device: str = _opt("auto", "train on GPUs (one per local rank; fewer GPUs than ranks is an error) or the CPU "
                               "(auto: GPUs when this node has any)", choices=("auto", "cuda", "cpu"))
    nproc: int | None = _opt(None, "ranks to start on this machine without torchrun (default: GPUs, else 2)")
    timeout: float = _opt(86400.0, "seconds before a run started without torchrun is declared hung")

    def validate(self) -> "TrainConfig":
        """Raise ValueError (one line naming the option) for a value no run can use: every
        number against its range (NaN and infinity never pass). Recipes go through here too."""
        for name, (low, high, closed) in _RANGES.items():
            value = getattr(self, name)
            if value is None:
                continue
            inside = math.isfinite(value) and low <= value and (value <= high if closed else value < high)
            if not inside:
                top = "2**32" if high == 2**32 else high
                allowed = f">= {low}" if high == _INF else f"in [{low}, {top}{']' if closed else ')'}"
                kind = "a finite number " if isinstance(value, float) else ""
                raise ValueError(f"--{_flag(name)} must be {kind}{allowed}, got {value}")
        if self.dataset in ("cifar10", "imagenet") and not self.data_root:
            raise ValueError(f"--dataset {self.dataset} needs --data-root (see data/README.md for how to get it)")
        if self.compression == "dgc" and self.optimizer != "sgd":
            raise ValueError(f"--compression dgc moves SGD's momentum into the comm hook; it cannot carry "
                             f"--optimizer {self.optimizer}'s moments: use --optimizer sgd or --compression topk")
        if self.parallel == "fsdp" and self.compression != "none":
            raise ValueError(f"--compression {self.compression} is a DDP communication hook; --parallel fsdp "
                             "reduce-scatters gradient shards and takes no comm hook: use --compression none "
                             "with fsdp")
        if self.parallel == "fsdp" and self.async_checkpoint == "on":
            raise ValueError("--async-checkpoint on: the background writer writes ddp's single file; --parallel "
                             "fsdp writes its shards synchronously: use --async-checkpoint off or auto")
        if self.parallel != "fsdp" and (self.cpu_offload or not self.reshard_after_forward):
            flag = "--cpu-offload" if self.cpu_offload else "--reshard-after-forward false"
            raise ValueError(f"{flag} applies to --parallel fsdp only; DDP keeps every parameter on every rank")
        if sum([self.export is not None, self.evaluate, self.benchmark_loader is not None]) > 1:
            chosen = [f for f, on in (("--export", self.export is not None), ("--evaluate", self.evaluate),
                                      ("--benchmark-loader", self.benchmark_loader is not None)) if on]
            raise ValueError(f"{' and '.join(chosen)}: choose one (each runs alone and exits)")
        for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
            if getattr(self, name) is not None and self.dataset != "imagenet":
                raise ValueError(f"--{_flag(name)} applies to --dataset imagenet (its crops); --dataset "
                                 f"{self.dataset} has images of one size")
        if self.decode == "cuda" and self.dataset != "imagenet":
            raise ValueError(f"--decode cuda decodes ImageNet's JPEG files on the GPU; --dataset {self.dataset} has "
                             "no files to decode: leave --decode at its default")
        side = self.image_size or 224
        crops = {"--train-crop-size": self.train_crop_size, "--val-crop-size": self.val_crop_size}
        if self.model.startswith("vit") and any(v not in (None, side) for v in crops.values()):
            flag = next(f for f, v in crops.items() if v not in (None, side))
            raise ValueError(f"{flag} {crops[flag]}: {self.model} takes images of its --image-size ({side}) only; set "
                             f"--image-size instead")
        crop = self.val_crop_size or side
        if self.val_resize_size is not None and self.val_resize_size < crop:
            raise ValueError(f"--val-resize-size {self.val_resize_size} is smaller than the evaluation crop ({crop}, "
                             "--val-crop-size): the center crop would reach outside the image")
        if self.ra_reps > self.global_batch:
            raise ValueError(f"--ra-reps {self.ra_reps} is more copies than a global batch of {self.global_batch} "
                             "holds samples: use at most --global-batch")
        if self.compression == "dgc" and self.grad_clip > 0:
            raise ValueError("--grad-clip clips the gradient before momentum, but with --compression dgc .grad holds "
                             "the update after it (momentum is inside the comm hook): use --grad-clip 0 or "
                             "--compression topk")
        return self

    def check_paths(self) -> "TrainConfig":
        """Raise ValueError (one line) for a path option that this machine cannot use: a
        --data-root that is not a folder, an --output-dir that is a file or not writable."""
        if self.data_root is not None and not Path(self.data_root).is_dir():
            raise ValueError(f"--data-root {self.data_root} is not a folder (see data/README.md for how to get "
                             "CIFAR-10 or ImageNet)")
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ValueError(f"--init-from {self.init_from} is not a file (a checkpoint, or a saved state_dict)")
        if not self.evaluate and self.export is None and self.benchmark_loader is None:
            _check_output_dir(self.output_dir)
        if self.export is not None:
            _check_output_file(self.export)
        return self


_INF = math.inf
# field -> (lowest, highest, highest included): the values a run can use
_RANGES = {
    "epochs": (1, _INF, False), "global_batch": (1, _INF, False), "reference_batch": (1, _INF, False),
    "checkpoint_every": (1, _INF, False), "keep": (1, _INF, False), "log_every": (1, _INF, False),
    "straggler_every": (1, _INF, False), "synthetic_size": (1, _INF, False), "compression_rank": (1, _INF, False),
    "micro_batch": (1, _INF, False), "nproc": (1, _INF, False), "max_steps": (1, _INF, False),
    "image_size": (8, _INF, False), "workers": (0, _INF, False), "profile_steps": (0, _INF, False),
    "fail_rank": (0, _INF, False), "stop_check_every": (1, _INF, False), "fail_at_step": (0, _INF, False), "compression_start": (0, _INF, False),
    "topk_warmup": (0, _INF, False), "train_crop_size": (8, _INF, False), "val_resize_size": (8, _INF, False),
    "val_crop_size": (8, _INF, False), "ra_reps": (1, _INF, False), "model_ema_steps": (1, _INF, False),
    "benchmark_loader": (1, _INF, False), "random_erase": (0.0, 1.0, True), "mixup_alpha": (0.0, 1e3, True),
    "cutmix_alpha": (0.0, 1e3, True), "model_ema_decay": (0.0, 1.0, True), "norm_weight_decay": (0.0, 1.0, True),
    "bias_weight_decay": (0.0, 1.0, True), "transformer_embedding_decay": (0.0, 1.0, True),
    "seed": (0, 2**32, False),
    "lr": (1e-12, 100.0, True), "momentum": (0.0, 1.0, False), "weight_decay": (0.0, 1.0, True),
    "warmup_epochs": (0.0, 1e6, True), "label_smoothing": (0.0, 1.0, False), "grad_clip": (0.0, 1e12, True),
    "topk_ratio": (1e-9, 1.0, True), "straggler_threshold": (1e-6, 1e6, True), "timeout": (1.0, 1e9, True),
    "pg_timeout": (1.0, 1e7, True), "pg_init_timeout": (1.0, 1e7, True), "loader_timeout": (1.0, 1e7, True),
}


def _check_output_file(path: str) -> None:
    """--export names a file that can be written: not a folder, in a writable folder."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--export {path} is a folder: name the file to write (e.g. {target / 'weights.pt'})")
    if not target.parent.is_dir() or not os.access(target.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--export {path}: {target.parent} is not a writable folder")


def _check_output_dir(path: str) -> None:
    """--output-dir is a writable folder, or can be made as one (its nearest existing
    parent is a writable folder)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"--output-dir {path} exists and is not a folder: name a folder (it is created if missing)")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--output-dir {path}: {existing} is not a folder, so the output folder cannot be made there")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {path}: {existing} is not writable by this user; name a folder you can write")


# What a run is: checkpoints of another identity are refused (another --output-dir).
IDENTITY = ("model", "dataset", "image_size", "global_batch", "seed")
# Where and how it runs, not what it computes: may change between two starts of a run.
OPERATIONAL = frozenset({
    "data_root", "workers", "channels_last", "compile", "micro_batch", "deterministic", "output_dir",
    "checkpoint_every", "keep", "async_checkpoint", "fail_at_step", "fail_rank", "log_every", "straggler_every", "straggler_threshold",
    "profile_steps", "tensorboard", "progress", "max_steps", "nproc", "timeout", "device", "apply_changes",
    "pg_timeout", "pg_init_timeout", "loader_timeout", "evaluate", "init_from", "stop_check_every", "reshard_after_forward",
    "cpu_offload", "export", "benchmark_loader",
    # the same augmentation decoded another way: tensor and pil differ by resampling rounding only
    "decode"})
# Cannot change in the middle of a run, even with --apply-changes: the optimizer's state, the
# loss scaler's, the data order or the format of the checkpoint (one file for ddp, a folder of
# shards for fsdp; with or without the --model-ema average) would not fit.
FIXED = ("optimizer", "amp", "synthetic_size", "parallel", "model_ema")


def changed_hyperparameters(saved: dict, cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (value in the checkpoint's config, value now)} for every field that changes
    what the run computes (not its identity, not OPERATIONAL) and differs."""
    now = dataclasses.asdict(cfg)
    return {name: (saved[name], now[name]) for name in now
            if name in saved and name not in OPERATIONAL and name not in IDENTITY and saved[name] != now[name]}


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"--{_flag(name)} {old} -> {new}" for name, (old, new) in changes.items())


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _field_type(f: dataclasses.Field) -> type:
    """str | int | float | bool of a field (its annotation is a string under `from __future__`)."""
    text = str(f.type).replace(" | None", "")
    return {"str": str, "int": int, "float": float, "bool": bool}[text]


class ConfigError(ValueError):
    """A flag or recipe no run can use; str() is the one line to print."""


class _Parser(argparse.ArgumentParser):
    raise_errors = False

    def error(self, message: str):
        """One line, not the usage of forty flags."""
        line = f"{self.prog}: error: {message} (--help lists every option)"
        if self.raise_errors:
            raise ConfigError(line)
        self.exit(2, line + "\n")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser: --config plus one flag per TrainConfig field.

    Parsed values are None unless given on the command line, so a recipe's values are
    overridden only by flags the user actually typed."""
    parser = _Parser(
        prog="python -m solutions.phase4_production.train",
        description="Fault-tolerant data-parallel trainer (ResNet/ViT; digits, synthetic, CIFAR-10, ImageNet). "
                    "The same command starts, restarts and resumes a run.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="RECIPE.toml",
                        help=f"a recipe: TOML with field names as keys (shipped: {RECIPES})")
    for f in fields(TrainConfig):
        kind, meta = _field_type(f), dict(f.metadata)
        help_text = meta.pop("help") + f" (default: {f.default})"
        if kind is bool:
            parser.add_argument(f"--{_flag(f.name)}", type=_parse_bool, nargs="?", const=True, metavar="BOOL",
                                help=help_text, **meta)
        else:
            parser.add_argument(f"--{_flag(f.name)}", type=kind, metavar=f.name.upper() if "choices" not in meta
                                else None, help=help_text, **meta)
    return parser


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The fields a TOML recipe sets. Raises ValueError for a missing file or an unknown key."""
    path = Path(path)
    if not path.is_file() and (RECIPES / path).is_file():
        path = RECIPES / path
    if not path.is_file():
        raise ValueError(f"--config {path}: recipe not found (shipped recipes: {', '.join(sorted(p.name for p in RECIPES.glob('*.toml')))})")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown} (the keys are TrainConfig's fields, see --help)")
    for key, value in values.items():
        kind = _field_type(known[key])
        if not (isinstance(value, kind) or (kind is float and isinstance(value, int))) or \
                (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"--config {path}: {key} = {value!r} should be a {kind.__name__}")
        choices = known[key].metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"--config {path}: {key} = {value!r} is not one of {list(choices)}")
    return values


def parse_config(argv: list[str] | None = None, *, check_paths: bool = True, raise_errors: bool = False) -> TrainConfig:
    """defaults < recipe < command line; exits with a one-line error (code 2) on bad input,
    or raises it as ConfigError with raise_errors=True. check_paths=False skips the
    file-system checks (for command lines of another machine)."""
    parser = build_parser()
    parser.raise_errors = raise_errors
    given = vars(parser.parse_args(argv))
    try:
        values = load_recipe(given.pop("config")) if "config" in given else {}
        values.update({k: v for k, v in given.items()})
        cfg = TrainConfig(**values).validate()
        return cfg.check_paths() if check_paths else cfg
    except ValueError as exc:
        parser.error(str(exc))
