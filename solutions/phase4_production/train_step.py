"""One optimizer step of the trainer, and what it is built from.

    lr_schedule, make_optimizer   the optimizer and its schedule (from the config)
    autocast_dtype                --amp on this device
    StepParts + train_step        one step over this rank's share of a global batch:
                                  forward/backward per micro-batch (DDP or FSDP reduces on the last),
                                  unscale + clip, optimizer, loss scaler, compression memory
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn

from solutions.phase4_production.compression import CompressionState
from solutions.phase4_production.config import TrainConfig
from solutions.phase4_production.elastic import BatchPlan
from solutions.phase4_production.monitoring import StepTimer
from solutions.phase4_production.recovery import FaultInjector
from solutions.phase4_production.train_parallel import Parallel


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for --amp on this device (None: full precision). auto: bf16 on a
    GPU that has it natively (Ampere or newer), fp16 on older GPUs, off on CPU."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.bfloat16 if mode == "bf16" else torch.float16


def lr_schedule(steps_per_epoch: int, epochs: int, warmup_epochs: float):
    """Multiplier of the peak lr at step s: a torchvision-style linear warm-up from a tenth of
    the peak over warmup_epochs (torchvision's reference ramps from --lr-warmup-decay x peak,
    0.01 by default; Goyal et al. ramp from the small-batch lr, peak x reference / global),
    then cosine decay to 0 at the last step (a function for LambdaLR)."""
    total = steps_per_epoch * epochs
    warmup = min(int(round(warmup_epochs * steps_per_epoch)), total - 1)

    def factor(step: int) -> float:
        if step < warmup:
            return 0.1 + 0.9 * step / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def peak_lr(cfg: TrainConfig) -> float:
    """--lr, tuned for --reference-batch, moved to --global-batch: linearly for SGD (Goyal et
    al. 2017, the rule 3.5 derives: k times the batch, k times the step), by the square root
    for AdamW. That last is a heuristic: Malladi et al. (NeurIPS 2022)'s square-root rule for
    Adam scales, for k times the batch, the lr by sqrt(k) AND 1 - beta1, 1 - beta2 by k and
    eps by 1/sqrt(k); this trainer keeps betas (0.9, 0.999) and eps 1e-8, so it is their rule
    only at k = 1 (for beta1 = 0.9 their rule has no valid beta1 beyond k = 10). Decoupled
    weight decay (AdamW: p *= 1 - lr * wd each step) then decays sqrt(k) times more per step
    over k times fewer steps an epoch: 1/sqrt(k) of the reference's decay per epoch unless
    --weight-decay is raised by sqrt(k). Equal batches: --lr as given."""
    ratio = cfg.global_batch / cfg.reference_batch
    return cfg.lr * (math.sqrt(ratio) if cfg.optimizer == "adamw" else ratio)


# ViT's learned embeddings (torchvision's VisionTransformer: class_token, encoder.pos_embedding);
# torchvision's --transformer-embedding-decay names class_token, position_embedding and
# relative_position_bias_table (references/classification/train.py), which misses ViT's
# pos_embedding: this trainer takes both of ViT's.
EMBEDDINGS = ("class_token", "pos_embedding", "position_embedding", "relative_position_bias_table")
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
          nn.LocalResponseNorm)  # torchvision's set_weight_decay's norm_classes


def parameter_groups(cfg: TrainConfig, model: nn.Module) -> list[tuple[str, float, list[torch.Tensor]]]:
    """The model's parameters in weight-decay groups, (name, decay, params), empty ones left
    out, in this order (a parameter falls in the first that takes it):
        embeddings   ViT's class_token and pos_embedding: --transformer-embedding-decay
                     (default: --weight-decay, as any weight)
        norms        parameters of normalisation layers (BatchNorm, LayerNorm, GroupNorm, ...),
                     bias included: --norm-weight-decay (default 0)
        biases       the other 1-D parameters (Linear and conv biases, attention's
                     in_proj_bias): --bias-weight-decay (default 0)
        weights      the rest: --weight-decay
    With the defaults every 1-D parameter gets none and every other one --weight-decay, the
    rule of earlier versions. torchvision (set_weight_decay) differs in two places: a norm
    layer's bias is a bias there when --bias-weight-decay is given, and only a parameter named
    exactly "bias" counts (ViT's in_proj_bias is decayed as a weight)."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, _NORMS) for p in m.parameters(recurse=False)}
    groups: dict[str, list[torch.Tensor]] = {"weights": [], "norms": [], "biases": [], "embeddings": []}
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in EMBEDDINGS:
            groups["embeddings"].append(p)
        elif id(p) in norm_params:
            groups["norms"].append(p)
        elif p.ndim <= 1:
            groups["biases"].append(p)
        else:
            groups["weights"].append(p)
    embedding = cfg.weight_decay if cfg.transformer_embedding_decay is None else cfg.transformer_embedding_decay
    decays = {"weights": cfg.weight_decay, "norms": cfg.norm_weight_decay, "biases": cfg.bias_weight_decay,
              "embeddings": embedding}
    return [(name, decays[name], params) for name, params in groups.items() if params]


def weight_decays(cfg: TrainConfig, model: nn.Module) -> dict[int, float]:
    """{id(parameter): its weight decay} (parameter_groups), for --compression dgc's hook."""
    return {id(p): decay for _, decay, params in parameter_groups(cfg, model) for p in params}


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (nesterov) or AdamW at peak_lr(cfg), one param group per weight decay that
    parameter_groups gives: --weight-decay's group first, each group's parameters in the
    model's order. With the defaults that is the two groups of earlier versions (ndim > 1
    decayed, the rest not), so their checkpoints still resume. With --compression dgc the
    comm hook carries SGD's momentum and weight decay (4.4, DGC's momentum correction): the
    SGD here has neither, .grad is the update.
    On a GPU the step is torch's fused kernel (fused=True: one launch per group instead of
    one per foreach operation, and an fp16 GradScaler's found_inf stays on the device), except
    SGD under fsdp (torch 2.14.1's DTensor has fused Adam/AdamW rules, no fused SGD one:
    torch/distributed/tensor/_ops/_pointwise_ops.py). The choice is kept across a resume
    (keep_implementation)."""
    dgc = cfg.compression == "dgc"
    decay_of = weight_decays(cfg, model)
    values = list(dict.fromkeys([cfg.weight_decay, *(decay_of[id(p)] for p in model.parameters())]))
    groups = [{"params": [p for p in model.parameters() if decay_of[id(p)] == value],
               "weight_decay": 0.0 if dgc else value} for value in values]
    groups = [group for group in groups if group["params"]]
    on_gpu = next(model.parameters()).device.type == "cuda"
    fused = on_gpu and (cfg.optimizer == "adamw" or cfg.parallel == "ddp") or None
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=peak_lr(cfg), fused=fused)
    elif dgc:
        optimizer = torch.optim.SGD(groups, lr=peak_lr(cfg), momentum=0.0, fused=fused)
    else:
        optimizer = torch.optim.SGD(groups, lr=peak_lr(cfg), momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                                    fused=fused)
    optimizer.register_load_state_dict_post_hook(keep_implementation)
    return optimizer


def keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: each group's kernel choice (fused, foreach) back to the one this
    optimizer was built with. torch 2.14.1's load_state_dict takes every group entry from the
    checkpoint, these two included, so a run resumed on a GPU from a checkpoint written on the
    CPU (or by an earlier version) would otherwise step with the CPU's kernels."""
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]


class NonFiniteLoss(ValueError):
    """The loss became NaN or infinite: the run stops, and that state is never saved."""


@dataclasses.dataclass
class StepParts:
    """What every optimizer step of an attempt uses."""

    net: nn.Module                        # what the forward calls: parallel.net, or torch.compile of it
    parallel: Parallel                    # DDP or FSDP: no_sync, buffers, the parameters
    plan: BatchPlan                       # every rank's share of the global batch, in passes
    rank: int                             # whose share this process trains on
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler          # enabled for fp16 only
    dtype: torch.dtype | None             # autocast dtype, None: full precision
    device: torch.device
    channels_last: bool = False
    grad_clip: float = 0.0                # max gradient norm, 0: no clipping
    compression: CompressionState | None = None  # the comm hook's state (4.4)
    sync_points: "SyncPoints | None" = None  # splits DDP's forward and backward into work and waiting
    mix: "Callable | None" = None         # batch mixing (train_loader.BatchMixing): (x, y, step) -> (x, y)


class SyncPoints:
    """Where DDP's collectives end inside one forward() and one backward() call, so that
    the time a rank spends waiting for the others counts as "comm", not as its own work.

    forward(): in a step's first forward DDP first broadcasts rank 0's buffers (BatchNorm
    statistics; a collective that waits for every rank: torch 2.14.1 broadcasts in a forward
    whose predecessor ran with gradients outside no_sync(), tests/test_claims.py), then
    calls the module: a forward pre-hook on the module marks
    that moment (`synced`) and fires the fault injector's "forward" point. backward(): DDP
    launches each bucket's all-reduce as its gradients become ready; after this rank's last
    gradient (`last_grad`, a post-accumulate-grad hook per parameter) the rest of backward()
    waits for the buckets in flight and for slower ranks. Without the split every rank's
    busy time is the same (the fast ones wait inside DDP for the slow one), and the
    straggler detector could never name anyone."""

    def __init__(self, ddp: nn.Module, timer: StepTimer, faults: FaultInjector):
        self.timer, self.faults = timer, faults
        self.synced = self.last_grad = None
        module = ddp.module
        self.handles = [module.register_forward_pre_hook(self._forward_starts)]
        self.handles += [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in module.parameters() if p.requires_grad]

    def _forward_starts(self, module: nn.Module, args) -> None:
        self.synced = self.timer.mark()
        self.faults.point("forward")

    def _grad_ready(self, param: torch.Tensor) -> None:
        self.last_grad = self.timer.mark()

    def split(self, name: str, begin, point, end) -> None:
        """Count begin..point as comm, point..end as `name` (forward), or the reverse
        (backward: work first, then the wait)."""
        point = point if point is not None else (begin if name == "forward" else end)
        first, second = ("comm", name) if name == "forward" else (name, "comm")
        self.timer.add_span(first, begin, point)
        self.timer.add_span(second, point, end)


def _forward(parts: StepParts, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(parts.device.type, dtype=parts.dtype, enabled=parts.dtype is not None):
        return parts.loss_fn(parts.net(x), y)


def train_step(parts: StepParts, batch, timer: StepTimer, faults: FaultInjector, step: int = 0) -> torch.Tensor:
    """One optimizer step (global step `step`, 0-based) over this rank's share of a global
    batch, in plan.accumulation passes (DDP's all-reduce runs in the last backward only);
    returns this rank's mean loss as a 0-d tensor on the device (reading it is the caller's
    choice: it waits for the device). The batch is mixed first (parts.mix), if asked. A step
    the loss scaler skips (inf/NaN gradients) also empties the compression memory, which
    would otherwise carry the inf into every later step. Under fsdp the fault point
    "allreduce" fires as the last backward (the one that reduce-scatters) begins."""
    x, y = batch[0].to(parts.device, non_blocking=True), batch[1].to(parts.device, non_blocking=True)
    if parts.mix is not None:
        x, y = parts.mix(x, y, step)
    x = x.to(memory_format=torch.channels_last if parts.channels_last else torch.preserve_format)
    total = torch.zeros((), device=parts.device)
    slices = parts.plan.micro_slices(parts.rank)
    share = parts.plan.shares[parts.rank]
    if parts.parallel.kind == "fsdp":
        with timer.phase("comm"):
            parts.parallel.sync_buffers()  # rank 0's BatchNorm statistics, as DDP's forward broadcasts them
    for i, (part, weight) in enumerate(slices):
        last = i == len(slices) - 1
        sync = contextlib.nullcontext() if last else parts.parallel.no_sync()
        points = parts.sync_points
        with sync:
            if points is None:
                with timer.phase("forward"):
                    faults.point("forward")
                    loss = _forward(parts, x[part], y[part])
                with timer.phase("backward"):
                    faults.point("backward")
                    if last and parts.parallel.kind == "fsdp":
                        faults.point("allreduce")
                    parts.scaler.scale(loss * weight).backward()
            else:  # DDP's collectives inside forward() and backward() count as comm
                points.synced, begin = None, timer.mark()
                loss = _forward(parts, x[part], y[part])  # the pre-hook fires the "forward" point
                points.split("forward", begin, points.synced, timer.mark())
                faults.point("backward")
                points.last_grad, begin = None, timer.mark()
                parts.scaler.scale(loss * weight).backward()
                points.split("backward", begin, points.last_grad, timer.mark())
        total += loss.detach() * ((part.stop - part.start) / share)
    with timer.phase("optimizer"):
        scaler, optimizer = parts.scaler, parts.optimizer
        if parts.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parts.parallel.module.parameters(), parts.grad_clip)
        watch = parts.compression is not None and scaler.is_enabled()  # get_scale() reads the device
        scale = scaler.get_scale() if watch else None
        scaler.step(optimizer)
        scaler.update()  # the scale shrinks exactly when the gradients were not finite
        optimizer.zero_grad(set_to_none=True)
        if watch and scaler.get_scale() < scale:
            parts.compression.reset_memory()
    return total
