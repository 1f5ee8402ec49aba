"""The trainer's configuration: sections, a recipe file, command-line overrides.

    defaults (the sections below)  <  --config recipe.toml  <  --flags on the command line

    TrainConfig   run          where the run lives, its seed and length; train or a read-only mode
                  data         the dataset, the global batch and its micro-batches, loaders, augmentation
                  model        the network, its first weights, memory format, compilation, its EMA
                  optim        optimizer, learning-rate schedule, regularisation, precision
                  parallel     how the ranks hold the model (ddp, fsdp) and exchange gradients
                  checkpoint   how often, how many, in the background or not; changes on resume
                  report       progress, metrics, stragglers, profiles
                  faults       how long a rank waits for the others, stop agreement, planned kills

Each component of the trainer is built from its own section (build.py). Flags stay flat: every
field is a flag named after it (`--lr` sets optim.lr); two fields have a flag of another name,
model.name (`--model`) and parallel.layout (`--parallel`). `--help` lists the flags by section,
with their defaults. A recipe is a TOML file (recipes/*.toml): a table per section whose keys
are its fields (`[optim]` then `lr = 0.1`), or top-level keys named like the flags (`lr =
0.1`, the flat format of earlier recipes), or both. Values are checked here, before any
process starts, so a typo is one line on stderr, not a traceback from every rank.

What a checkpoint records and resume compares is the flat view, {flag name: value}
(TrainConfig.flat(): the command line's vocabulary, unchanged since the config was one flat
dataclass, so older checkpoints compare key for key); the run folder's config.json holds the
sections (TrainConfig.by_section()).
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
from solutions.phase4_production.trainer.parallel import STRATEGIES, strategy_class

_PHASE = Path(__file__).resolve().parent.parent
# The recipes ship once, with the reference; the learner's copy of this file finds them there.
RECIPES = _PHASE / "recipes" if (_PHASE / "recipes").is_dir() else _PHASE.parent / "solutions" / _PHASE.name / "recipes"
AMP_MODES = ("auto", "bf16", "fp16", "off")
OPTIMIZERS = ("sgd", "adamw")
COMPRESSIONS = ("none", "powersgd", "topk", "dgc")


def _opt(default: Any, help: str, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A field: its default, its --help text, its flag's name if not the field's, argparse's choices."""
    return field(default=default, metadata={"help": help, "flag": flag, **argparse_kwargs})


@dataclass
class RunConfig:
    """Where the run lives, its seed and length, and what this start does: train, or one read-only mode."""

    output_dir: str = _opt("runs/digits", "checkpoints, metrics and traces go here; a run resumes from it")
    seed: int = _opt(0, "seed of the weights, the data order and the augmentation")
    deterministic: bool = _opt(False, "deterministic kernels (torch.use_deterministic_algorithms; on GPUs also "
                                      "CUBLAS_WORKSPACE_CONFIG and no cuDNN autotuning)")
    max_steps: int | None = _opt(None, "stop after this many steps in all (a shorter run of the same schedule)")
    evaluate: bool = _opt(False, "evaluate the newest checkpoint in --output-dir (or --init-from's weights) on the "
                                 "test set and exit: no training, nothing written")
    export: str | None = _opt(None, "write the model weights of the newest checkpoint in --output-dir to this file "
                                    "as one plain state_dict (torch.save; loads into the torchvision model, or "
                                    "as --init-from) and exit; works for sharded (fsdp) and ddp checkpoints")
    benchmark_loader: int | None = _opt(None, "run only the input pipeline (loader workers and the device stage) "
                                              "for N steps, print images/s and exit: nothing trained or written")
    device: str = _opt("auto", "train on GPUs (one per local rank; fewer GPUs than ranks is an error) or the CPU "
                               "(auto: GPUs when this node has any)", choices=("auto", "cuda", "cpu"))
    nproc: int | None = _opt(None, "ranks to start on this machine without torchrun (default: GPUs, else 2)")
    timeout: float = _opt(86400.0, "seconds before a run started without torchrun is declared hung")


@dataclass
class DataConfig:
    """The input pipeline: the dataset, the global batch and its micro-batches, the loader workers, the augmentation."""

    dataset: str = _opt("digits", "dataset to train on", choices=sorted(DATASET_SHAPES))
    data_root: str | None = _opt(None, "folder holding CIFAR-10 or ImageNet (see data/README.md)")
    image_size: int | None = _opt(None, "ImageNet: the model's input side in pixels (ViT's size) and the default of "
                                        "--train-crop-size and --val-crop-size (None: 224)")
    synthetic_size: int = _opt(4096, "samples of the synthetic training set")
    global_batch: int = _opt(64, "samples per optimizer step over all ranks (fixed at any world size)")
    micro_batch: int | None = _opt(None, "most samples per forward pass on one rank; more: gradient accumulation")
    workers: int = _opt(0, "DataLoader worker processes per rank (0: load in the training process, right for in-memory digits)")
    loader_timeout: float = _opt(900.0, "seconds the loop waits for one batch from its loader workers (--workers > "
                                        "0): a worker stuck on a file system that stopped answering, or on a "
                                        "sample that never returns, ends the attempt after this long (torchrun "
                                        "restarts it) instead of hanging the run")
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


@dataclass
class ModelConfig:
    """The network: which one, its first weights, its memory format, compilation, and the EMA of its weights."""

    name: str = _opt("resnet18", "torchvision model (CIFAR stem below 64 px)", choices=MODEL_NAMES,
                    flag="model")
    sync_bn: bool = _opt(False, "BatchNorm statistics over the global batch (SyncBatchNorm, GPUs only): for small "
                                "per-GPU batches; costs an all-reduce per BatchNorm layer in forward and backward")
    init_from: str | None = _opt(None, "start a new run from these weights: a checkpoint of this trainer, or a "
                                       "state_dict file such as torchvision's (ignored when the run resumes)")
    channels_last: str = _opt("auto", "channels_last memory format (auto: on GPU only); under --parallel fsdp the "
                                      "inputs only, the parameters stay contiguous as fully_shard requires (a "
                                      "channels_last input alone makes cuDNN's convolution channels_last)",
                              choices=("auto", "on", "off"))
    compile: bool = _opt(False, "torch.compile the model")
    model_ema: bool = _opt(False, "keep an exponential moving average of the weights (and BatchNorm statistics), "
                                  "evaluated beside the model at every epoch end (torchvision's --model-ema)")
    model_ema_steps: int = _opt(32, "update the average every N optimizer steps (torchvision's --model-ema-steps)")
    model_ema_decay: float = _opt(0.99998, "EMA decay per sample-epoch, adjusted for --model-ema-steps, the "
                                           "global batch and --epochs as torchvision's --model-ema-decay")


@dataclass
class OptimConfig:
    """The optimizer, its learning-rate schedule, regularisation, the precision of the step (lr: for reference_batch)."""

    epochs: int = _opt(3, "epochs to train")
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
    amp: str = _opt("auto", "mixed precision (auto: bf16 on GPUs that have it, else fp16 + GradScaler; off on CPU)",
                    choices=AMP_MODES)


@dataclass
class ParallelConfig:
    """How the ranks hold the model (the layout: a strategy of parallel.py) and exchange its gradients."""

    layout: str = _opt("ddp", "how the ranks hold the model: ddp (every rank a full replica; rank 0 writes one "
                              "checkpoint file) or fsdp (torch's fully_shard: each rank 1/N of the parameters, "
                              "gradients and optimizer state, and writes only its shards; for models whose "
                              "training state does not fit one GPU)", choices=tuple(STRATEGIES),
                    flag="parallel")
    reshard_after_forward: bool = _opt(True, "fsdp: free each unit's gathered parameters after its forward and "
                                             "all-gather them again for its backward (false: keep them until the "
                                             "backward, ZeRO-2-like memory for one all-gather less per unit)")
    cpu_offload: bool = _opt(False, "fsdp: keep the parameter shards, gradients and optimizer state in CPU memory "
                                    "(CPUOffloadPolicy; the optimizer steps on the CPU): for models that do not fit "
                                    "even sharded, at the cost of host-device copies every step")
    compression: str = _opt("none", "gradient compression as a DDP comm hook (4.4); dgc: top-k with DGC's momentum "
                                    "correction (SGD's momentum and weight decay move into the hook)", choices=COMPRESSIONS)
    compression_rank: int = _opt(4, "PowerSGD rank")
    topk_ratio: float = _opt(0.01, "top-k: fraction of gradient elements sent")
    topk_warmup: int = _opt(0, "top-k and dgc: steps from --compression-start over which the fraction sent falls "
                               "exponentially from 0.25 to --topk-ratio (DGC's sparsity warm-up; 0: none)")
    compression_start: int = _opt(10, "step from which --compression compresses (plain all-reduce before it, "
                                      "and in the first 2 steps of every restart; torch's PowerSGD default: 1000)")


@dataclass
class CheckpointConfig:
    """How often the run saves, how many checkpoints it keeps, how it writes them, what a resume may change."""

    checkpoint_every: int = _opt(20, "save every N steps (and at every epoch end)")
    keep: int = _opt(3, "checkpoints kept (the newest)")
    async_checkpoint: str = _opt("auto", "write each checkpoint in a background thread from a CPU copy of the "
                                         "state, so the step waits for the copy, not for the write, hash and fsync "
                                         "(auto: on GPUs; off on the CPU, where the thread slows a CPU-bound step "
                                         "more than the write it hides: benchmarks/checkpoint_bench.py)",
                                 choices=("auto", "on", "off"))
    apply_changes: bool = _opt(False, "on resume, continue with hyperparameters that differ from the checkpoint's "
                                      "(--lr, --momentum, --weight-decay, --epochs, --warmup-epochs, ...) instead of "
                                      "refusing: the optimizer takes the new values, and the LR schedule is recomputed "
                                      "for the new --epochs/--warmup-epochs at the resumed step (the LR jumps to it)")


@dataclass
class ReportConfig:
    """What rank 0 shows and records: progress, metrics, stragglers, profiles."""

    log_every: int = _opt(10, "metrics line every N steps")
    progress: bool = _opt(True, "show progress on rank 0: a bar on a terminal, a plain line every --log-every steps "
                                "when stderr is not one (a log file)")
    tensorboard: bool | None = _opt(None, "also write TensorBoard scalars (train/loss, eval/accuracy, ...) to "
                                          "OUTPUT_DIR/tensorboard (None: when tensorboard is installed; true: warn "
                                          "when it is not)")
    straggler_every: int = _opt(50, "gather per-rank step times every N steps and name slow ranks")
    straggler_threshold: float = _opt(0.2, "a rank this much slower than the median is a straggler")
    profile_steps: int = _opt(0, "record N steps with torch.profiler (after 5 skipped and 2 warm-up)")


@dataclass
class FaultsConfig:
    """How long a rank waits for the others, how often the ranks agree on a stop signal, and planned kills (chaos)."""

    pg_timeout: float = _opt(300.0, "seconds a collective may wait for the other ranks once the first step is done: "
                                    "a rank stuck or dead ends the attempt after this long (torchrun restarts it)")
    pg_init_timeout: float = _opt(900.0, "the same, from the start to the end of the first step (data, model, "
                                         "resume, compilation and autotuning may be slow on some ranks)")
    stop_check_every: int = _opt(1, "agree on a stop signal every N steps (an all-reduce of a CPU flag over a "
                                    "gloo group per check: a host collective, no device synchronisation); a "
                                    "preemption then waits up to N steps longer before the save: keep N x step time "
                                    "well inside the grace period")
    fail_at_step: int | None = _opt(None, "chaos: on the first attempt one rank SIGKILLs itself at this step")
    fail_rank: int = _opt(1, "the rank --fail-at-step kills")


# section name -> its dataclass, in --help's order
SECTIONS: dict[str, type] = {"run": RunConfig, "data": DataConfig, "model": ModelConfig, "optim": OptimConfig,
                             "parallel": ParallelConfig, "checkpoint": CheckpointConfig, "report": ReportConfig,
                             "faults": FaultsConfig}
# flag name (`--max-steps` -> "max_steps") -> (section, field)
FLAGS: dict[str, tuple[str, dataclasses.Field]] = {
    f.metadata["flag"] or f.name: (section, f) for section, kind in SECTIONS.items() for f in fields(kind)}


@dataclass
class TrainConfig:
    """Everything a run depends on, in sections (see the module docstring). Sizes are samples."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "TrainConfig":
        """The config of {flag name: value} (the flags' and flat recipes' vocabulary); every
        option not named keeps its default. ValueError for a name that is no flag."""
        unknown = sorted(set(values) - set(FLAGS))
        if unknown:
            raise ValueError(f"unknown options {unknown} (the options are the flags, see --help)")
        given: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in values.items():
            section, f = FLAGS[name]
            given[section][f.name] = value
        return cls(**{section: SECTIONS[section](**kwargs) for section, kwargs in given.items()})

    def flat(self) -> dict[str, Any]:
        """{flag name: value} of every option: what a checkpoint records as its config and what
        a resume compares (changed_hyperparameters)."""
        return {name: getattr(getattr(self, section), f.name) for name, (section, f) in FLAGS.items()}

    def by_section(self) -> dict[str, dict[str, Any]]:
        """{section: {field: value}}: the run folder's config.json (the keys a recipe's tables take)."""
        return dataclasses.asdict(self)

    @property
    def read_only(self) -> bool:
        """--evaluate, --export or --benchmark-loader: nothing is trained or written in --output-dir."""
        run = self.run
        return run.evaluate or run.export is not None or run.benchmark_loader is not None

    def validate(self) -> "TrainConfig":
        """Raise ValueError (one line naming the option) for a value no run can use: every
        number against its range (NaN and infinity never pass), then the options that exclude
        each other (the layout's own through its strategy's check). Recipes go through here too."""
        values = self.flat()
        for name, (low, high, closed) in _RANGES.items():
            value = values[name]
            if value is None:
                continue
            inside = math.isfinite(value) and low <= value and (value <= high if closed else value < high)
            if not inside:
                top = "2**32" if high == 2**32 else high
                allowed = f">= {low}" if high == _INF else f"in [{low}, {top}{']' if closed else ')'}"
                kind = "a finite number " if isinstance(value, float) else ""
                raise ValueError(f"--{_flag(name)} must be {kind}{allowed}, got {value}")
        data, optim, run, parallel = self.data, self.optim, self.run, self.parallel
        if data.dataset in ("cifar10", "imagenet") and not data.data_root:
            raise ValueError(f"--dataset {data.dataset} needs --data-root (see data/README.md for how to get it)")
        if parallel.compression == "dgc" and optim.optimizer != "sgd":
            raise ValueError(f"--compression dgc moves SGD's momentum into the comm hook; it cannot carry "
                             f"--optimizer {optim.optimizer}'s moments: use --optimizer sgd or --compression topk")
        strategy_class(parallel.layout).check(self)
        if sum([run.export is not None, run.evaluate, run.benchmark_loader is not None]) > 1:
            chosen = [f for f, on in (("--export", run.export is not None), ("--evaluate", run.evaluate),
                                      ("--benchmark-loader", run.benchmark_loader is not None)) if on]
            raise ValueError(f"{' and '.join(chosen)}: choose one (each runs alone and exits)")
        for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
            if getattr(data, name) is not None and data.dataset != "imagenet":
                raise ValueError(f"--{_flag(name)} applies to --dataset imagenet (its crops); --dataset "
                                 f"{data.dataset} has images of one size")
        if data.decode == "cuda" and data.dataset != "imagenet":
            raise ValueError(f"--decode cuda decodes ImageNet's JPEG files on the GPU; --dataset {data.dataset} has "
                             "no files to decode: leave --decode at its default")
        side = data.image_size or 224
        crops = {"--train-crop-size": data.train_crop_size, "--val-crop-size": data.val_crop_size}
        if self.model.name.startswith("vit") and any(v not in (None, side) for v in crops.values()):
            flag = next(f for f, v in crops.items() if v not in (None, side))
            raise ValueError(f"{flag} {crops[flag]}: {self.model.name} takes images of its --image-size ({side}) "
                             "only; set --image-size instead")
        crop = data.val_crop_size or side
        if data.val_resize_size is not None and data.val_resize_size < crop:
            raise ValueError(f"--val-resize-size {data.val_resize_size} is smaller than the evaluation crop ({crop}, "
                             "--val-crop-size): the center crop would reach outside the image")
        if data.ra_reps > data.global_batch:
            raise ValueError(f"--ra-reps {data.ra_reps} is more copies than a global batch of {data.global_batch} "
                             "holds samples: use at most --global-batch")
        if parallel.compression == "dgc" and optim.grad_clip > 0:
            raise ValueError("--grad-clip clips the gradient before momentum, but with --compression dgc .grad holds "
                             "the update after it (momentum is inside the comm hook): use --grad-clip 0 or "
                             "--compression topk")
        return self

    def check_paths(self) -> "TrainConfig":
        """Raise ValueError (one line) for a path option that this machine cannot use: a
        --data-root that is not a folder, an --output-dir that is a file or not writable."""
        if self.data.data_root is not None and not Path(self.data.data_root).is_dir():
            raise ValueError(f"--data-root {self.data.data_root} is not a folder (see data/README.md for how to get "
                             "CIFAR-10 or ImageNet)")
        if self.model.init_from is not None and not Path(self.model.init_from).is_file():
            raise ValueError(f"--init-from {self.model.init_from} is not a file (a checkpoint, or a saved state_dict)")
        if not self.read_only:
            _check_output_dir(self.run.output_dir)
        if self.run.export is not None:
            _check_output_file(self.run.export)
        return self


_INF = math.inf
# flag name -> (lowest, highest, highest included): the values a run can use
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
    """{flag name: (value in the checkpoint's config, value now)} for every option that
    changes what the run computes (not its identity, not OPERATIONAL) and differs. `saved`:
    the checkpoint's config, flat (TrainConfig.flat())."""
    now = cfg.flat()
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
        """One line, not the usage of seventy flags."""
        line = f"{self.prog}: error: {message} (--help lists every option)"
        if self.raise_errors:
            raise ConfigError(line)
        self.exit(2, line + "\n")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser: --config plus one flag per field of every section
    (listed by section in --help).

    Parsed values are None unless given on the command line, so a recipe's values are
    overridden only by flags the user actually typed; their names (`dest`) are the flags'."""
    parser = _Parser(
        prog=f"python -m {__package__.rpartition('.')[0]}.train",  # the learner's copy: phase4_production.train
        description="Fault-tolerant data-parallel trainer (ResNet/ViT; digits, synthetic, CIFAR-10, ImageNet). "
                    "The same command starts, restarts and resumes a run.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="RECIPE.toml",
                        help=f"a recipe: TOML, [section] tables or flat keys named like the flags (shipped: {RECIPES})")
    groups = {section: parser.add_argument_group(section, kind.__doc__) for section, kind in SECTIONS.items()}
    for name, (section, f) in FLAGS.items():
        kind, meta = _field_type(f), {k: v for k, v in f.metadata.items() if k != "flag"}
        help_text = meta.pop("help") + f" (default: {f.default})"
        if kind is bool:
            groups[section].add_argument(f"--{_flag(name)}", dest=name, type=_parse_bool, nargs="?", const=True,
                                         metavar="BOOL", help=help_text, **meta)
        else:
            groups[section].add_argument(f"--{_flag(name)}", dest=name, type=kind, help=help_text,
                                         metavar=name.upper() if "choices" not in meta else None, **meta)
    return parser


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The options a TOML recipe sets, as {flag name: value}: the keys of its [section] tables
    (a section's fields, or its flags' names) and its top-level keys (flag names: the flat
    format of earlier recipes). Raises ValueError for a missing file, an unknown key, a key
    set twice, or a value of the wrong type or not among the choices."""
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
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    keys: dict[str, tuple[str, Any]] = {}  # flag name -> (the key as written, value)
    unknown = []
    for key, value in document.items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, item in value.items():
                keys_of = {f.name: flag for flag, (section, f) in FLAGS.items() if section == key}
                flag = keys_of.get(inner, inner if inner in keys_of.values() else None)
                if flag is None:
                    home = f" (it belongs in [{FLAGS[inner][0]}])" if inner in FLAGS else ""
                    raise ValueError(f"--config {path}: [{key}] has no key {inner!r}{home}; its keys: "
                                     f"{', '.join(sorted(keys_of))}")
                _put(keys, flag, f"[{key}] {inner}", item, path)
        elif key in FLAGS:
            _put(keys, key, key, value, path)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {sorted(unknown)} (the keys are the flags' names, or "
                         f"[section] tables of their fields: {', '.join(SECTIONS)}; see --help)")
    for flag, (written, value) in keys.items():
        f = FLAGS[flag][1]
        kind = _field_type(f)
        if not (isinstance(value, kind) or (kind is float and isinstance(value, int))) or \
                (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"--config {path}: {written} = {value!r} should be a {kind.__name__}")
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"--config {path}: {written} = {value!r} is not one of {list(choices)}")
    return {flag: value for flag, (_, value) in keys.items()}


def _put(keys: dict, flag: str, written: str, value: Any, path: Path) -> None:
    if flag in keys:
        raise ValueError(f"--config {path}: {written} sets --{_flag(flag)}, which {keys[flag][0]} set already")
    keys[flag] = (written, value)


def parse_config(argv: list[str] | None = None, *, check_paths: bool = True, raise_errors: bool = False) -> TrainConfig:
    """defaults < recipe < command line; exits with a one-line error (code 2) on bad input,
    or raises it as ConfigError with raise_errors=True. check_paths=False skips the
    file-system checks (for command lines of another machine)."""
    parser = build_parser()
    parser.raise_errors = raise_errors
    given = vars(parser.parse_args(argv))
    try:
        values = load_recipe(given.pop("config")) if "config" in given else {}
        values.update(given)
        cfg = TrainConfig.from_flat(values).validate()
        return cfg.check_paths() if check_paths else cfg
    except ValueError as exc:
        parser.error(str(exc))
