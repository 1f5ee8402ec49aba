"""One optimizer step of the trainer, and what it is built from.

    lr_schedule, make_optimizer   the optimizer and its schedule (from the config's optim section)
    autocast_dtype                --amp on this device
    StepParts + train_step        one step over this rank's share of a global batch:
                                  forward/backward per micro-batch (the parallel strategy reduces on
                                  the last), unscale + clip, optimizer, loss scaler, compression memory
    Stepper                       the loop's step: the batch, train_step in the flight record, the
                                  schedule and the data position, the step's loss and times (kept
                                  on the device until a logged, saved or reported step reads them)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn

from phase4_production.compression import CompressionState
from phase4_production.elastic import BatchPlan
from phase4_production.monitoring import StepTimer
from phase4_production.recovery import FaultInjector


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


def peak_lr(optim, global_batch: int) -> float:
    """--lr, tuned for --reference-batch, moved to --global-batch: linearly for SGD (Goyal et
    al. 2017, the rule 3.5 derives: k times the batch, k times the step), by the square root
    for AdamW. That last is a heuristic: Malladi et al. (NeurIPS 2022)'s square-root rule for
    Adam scales, for k times the batch, the lr by sqrt(k) AND 1 - beta1, 1 - beta2 by k and
    eps by 1/sqrt(k); this trainer keeps betas (0.9, 0.999) and eps 1e-8, so it is their rule
    only at k = 1 (for beta1 = 0.9 their rule has no valid beta1 beyond k = 10). Decoupled
    weight decay (AdamW: p *= 1 - lr * wd each step) then decays sqrt(k) times more per step
    over k times fewer steps an epoch: 1/sqrt(k) of the reference's decay per epoch unless
    --weight-decay is raised by sqrt(k). Equal batches: --lr as given."""
    ratio = global_batch / optim.reference_batch
    return optim.lr * (math.sqrt(ratio) if optim.optimizer == "adamw" else ratio)


# ViT's learned embeddings (torchvision's VisionTransformer: class_token, encoder.pos_embedding);
# torchvision's --transformer-embedding-decay names class_token, position_embedding and
# relative_position_bias_table (references/classification/train.py), which misses ViT's
# pos_embedding: this trainer takes both of ViT's.
EMBEDDINGS = ("class_token", "pos_embedding", "position_embedding", "relative_position_bias_table")
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
          nn.LocalResponseNorm)  # torchvision's set_weight_decay's norm_classes


def parameter_groups(optim, model: nn.Module) -> list[tuple[str, float, list[torch.Tensor]]]:
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
    embedding = optim.weight_decay if optim.transformer_embedding_decay is None else optim.transformer_embedding_decay
    decays = {"weights": optim.weight_decay, "norms": optim.norm_weight_decay, "biases": optim.bias_weight_decay,
              "embeddings": embedding}
    return [(name, decays[name], params) for name, params in groups.items() if params]


def weight_decays(optim, model: nn.Module) -> dict[int, float]:
    """{id(parameter): its weight decay} (parameter_groups), for --compression dgc's hook."""
    return {id(p): decay for _, decay, params in parameter_groups(optim, model) for p in params}


def make_optimizer(optim, model: nn.Module, global_batch: int, dgc: bool = False,
                   fused_sgd: bool = True) -> torch.optim.Optimizer:
    """SGD (nesterov) or AdamW at peak_lr (`optim`: the config's optim section; `global_batch`:
    the data section's), one param group per weight decay that
    parameter_groups gives: --weight-decay's group first, each group's parameters in the
    model's order. With the defaults that is the two groups of earlier versions (ndim > 1
    decayed, the rest not), so their checkpoints still resume. With `dgc` (--compression dgc)
    the comm hook carries SGD's momentum and weight decay (4.4, DGC's momentum correction):
    the SGD here has neither, .grad is the update.
    On a GPU the step is torch's fused kernel (fused=True: one launch per group instead of
    one per foreach operation, and an fp16 GradScaler's found_inf stays on the device), except
    SGD where the parallel strategy says `fused_sgd` False (fsdp: torch 2.14.1's DTensor has
    fused Adam/AdamW rules, no fused SGD one: torch/distributed/tensor/_ops/_pointwise_ops.py).
    The choice is kept across a resume (keep_implementation)."""
    decay_of = weight_decays(optim, model)
    values = list(dict.fromkeys([optim.weight_decay, *(decay_of[id(p)] for p in model.parameters())]))
    groups = [{"params": [p for p in model.parameters() if decay_of[id(p)] == value],
               "weight_decay": 0.0 if dgc else value} for value in values]
    groups = [group for group in groups if group["params"]]
    on_gpu = next(model.parameters()).device.type == "cuda"
    fused = True if on_gpu and (optim.optimizer == "adamw" or fused_sgd) else None
    lr = peak_lr(optim, global_batch)
    if optim.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=fused)
    elif dgc:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.0, fused=fused)
    else:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=optim.momentum, nesterov=optim.momentum > 0,
                                    fused=fused)
    optimizer.register_load_state_dict_post_hook(keep_implementation)
    return optimizer


def build_optimizer(cfg, strategy) -> torch.optim.Optimizer:
    """make_optimizer for a run: `cfg`'s optim section over the strategy's model (after it is
    wrapped: fully_shard makes the parameters DTensors), at the data section's global batch,
    fused where the strategy allows it, without momentum and decay under --compression dgc."""
    return make_optimizer(cfg.optim, strategy.module, cfg.data.global_batch, dgc=cfg.parallel.compression == "dgc",
                          fused_sgd=strategy.fused_sgd)


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

    net: nn.Module                        # what the forward calls: strategy.net, or torch.compile of it
    strategy: "Strategy"                  # the parallel layout (parallel.py): no_sync, buffers, clipping
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
    sync_points: "SyncPoints | None" = None  # parallel.SyncPoints: DDP's forward and backward, work and waiting
    mix: "Callable | None" = None         # batch mixing (device_stage.BatchMixing): (x, y, step) -> (x, y)


def _forward(parts: StepParts, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(parts.device.type, dtype=parts.dtype, enabled=parts.dtype is not None):
        return parts.loss_fn(parts.net(x), y)


def train_step(parts: StepParts, batch, timer: StepTimer, faults: FaultInjector, step: int = 0) -> torch.Tensor:
    """One optimizer step (global step `step`, 0-based) over this rank's share of a global
    batch, in plan.accumulation passes (DDP's all-reduce runs in the last backward only);
    returns this rank's mean loss as a 0-d tensor on the device (reading it is the caller's
    choice: it waits for the device). The batch is mixed first (parts.mix), if asked. A step
    the loss scaler skips (inf/NaN gradients) also empties the compression memory, which
    would otherwise carry the inf into every later step. Before the first forward the
    strategy begins the step (fsdp: rank 0's buffers; ddp: --topk-warmup's fraction); without
    sync points it is told as the last backward (the one that reduces) begins (fsdp: the fault
    point "allreduce")."""
    x, y = batch[0].to(parts.device, non_blocking=True), batch[1].to(parts.device, non_blocking=True)
    if parts.mix is not None:
        x, y = parts.mix(x, y, step)
    x = x.to(memory_format=torch.channels_last if parts.channels_last else torch.preserve_format)
    total = torch.zeros((), device=parts.device)
    slices = parts.plan.micro_slices(parts.rank)
    share = parts.plan.shares[parts.rank]
    parts.strategy.begin_step(step, timer)
    for i, (part, weight) in enumerate(slices):
        last = i == len(slices) - 1
        sync = contextlib.nullcontext() if last else parts.strategy.no_sync()
        points = parts.sync_points
        with sync:
            if points is None:
                with timer.phase("forward"):
                    faults.point("forward")
                    loss = _forward(parts, x[part], y[part])
                with timer.phase("backward"):
                    faults.point("backward")
                    if last:
                        parts.strategy.before_reduction(faults)
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
            parts.strategy.clip_grad_norm_(parts.grad_clip)
        watch = parts.compression is not None and scaler.is_enabled()  # get_scale() reads the device
        scale = scaler.get_scale() if watch else None
        scaler.step(optimizer)
        scaler.update()  # the scale shrinks exactly when the gradients were not finite
        optimizer.zero_grad(set_to_none=True)
        if watch and scaler.get_scale() < scale:
            parts.compression.reset_memory()
    return total


class Stepper:
    """One step of the training loop and what it measures (the loop calls it at every step):

        batch = stepper.next_batch(batches, step)   the fault injector's "data" point, timed
        stepper.step(batch, step)                   train_step in the flight record's entry named
                                                    after the strategy's collective; the LR schedule
                                                    and the data position advance
        stepper.loss()                              the last step's loss: one read of the device;
                                                    NonFiniteLoss if any step's loss was not finite
        stepper.times(step, logged, force)          (the step's times if logged, a straggler report)

    After the attempt's first step the flight record's limit becomes --pg-timeout (the first
    step may compile and autotune: until then --pg-init-timeout)."""

    def __init__(self, parts: StepParts, scheduler, sampler, faults: FaultInjector, flight, timer, losses,
                 stragglers, start: int, global_batch: int, pg_timeout: float, straggler_every: int, folder):
        self.parts, self.scheduler, self.sampler, self.faults, self.flight = parts, scheduler, sampler, faults, flight
        self.timer, self.losses, self.stragglers = timer, losses, stragglers
        self.start, self.global_batch, self.pg_timeout = start, global_batch, pg_timeout
        self.straggler_every, self.folder = straggler_every, folder
        self.samples, self.seconds = 0, 0.0  # trained by all ranks, and this rank's step time, this attempt

    def next_batch(self, batches, step: int):
        """The next batch of the epoch's iterator `batches` for step `step` (0-based), or None."""
        self.faults.begin_step(step)
        self.timer.start()
        with self.timer.phase("data"):
            self.faults.point("data")
            return next(batches, None)

    def step(self, batch, step: int) -> None:
        self.flight.step = step
        with self.flight.waiting(self.parts.strategy.collective):
            self.losses.add(train_step(self.parts, batch, self.timer, self.faults, step), step + 1)
        if step == self.start:  # every rank is in step: from now on, short
            self.flight.set_limit(self.pg_timeout)
        self.scheduler.step()
        self.sampler.advance()
        self.timer.stop(samples=self.parts.plan.shares[self.parts.rank])
        self.samples += self.global_batch

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def loss(self) -> float:
        """One read of the device: the last step's loss, and whether any was NaN or infinite."""
        value, bad_step, bad_value = self.losses.read()
        if bad_step is not None:
            raise NonFiniteLoss(f"the loss became {bad_value} at step {bad_step} (rank {self.parts.rank}): lower --lr "
                                f"or use --grad-clip; not saved, the newest checkpoint in {self.folder} is the last "
                                "good state")
        return value

    def times(self, step: int, logged: bool, force: bool) -> tuple[dict | None, dict | None]:
        """(the times of step `step` if `logged`, else None; a straggler report or None). The
        kept steps are read (one device sync) when the step is logged, a straggler report is
        due, `force` says so, or a thousand steps wait: the same decision on every rank."""
        due = self.stragglers is not None and (step - self.start) % self.straggler_every == 0
        times, report = None, None
        if logged or due or force or len(self.timer.pending) >= 1000:
            with self.flight.waiting("the straggler report's all-gather"):
                for times in self.timer.collect():
                    self.seconds += times["step"]
                    report = (self.stragglers.update(times) if self.stragglers else None) or report
        return (times if logged else None), report
