"""config -> Run: every component of one attempt on one rank, each built from its config section.

    attempt, started = begin_attempt(cfg)       seeds, deterministic kernels, the fault flags
    inputs = data.build_inputs(cfg.data, ...)   the input pipeline (the one entry point)
    run = build(cfg, inputs, ...)               the rest, in this order:

      model         common.models.build_model(cfg.model.name) (+ SyncBatchNorm)
      strategy      parallel.make_strategy(cfg.parallel.layout): the model's memory format, its
                    averages held like it, then the model wrapped (DDP or fully_shard)
      optimizer     step.build_optimizer(cfg.optim) after the wrap; LambdaLR(lr_schedule); GradScaler
      report        report.RunReport(cfg.report): silent until the loop opens it
      evaluator     evaluator.Evaluator: the model and its averages on the test set; the history
      checkpointer  checkpointer.Checkpointer over the strategy's store, with the stateful parts:
                    the data position (inputs), the history (evaluator), the registered features'
      averages      make_ema, register_ema: --model-ema (the one stateful feature today; see below)
      resume        checkpointer.load_latest(): the newest checkpoint that verifies, or --init-from

    run.start_training()   the loop's own instruments, built when training starts (read-only
                           modes never build them): DDP's comm hook, torch.compile, the opened
                           report, the stop agreement, the straggler detector, the Stepper, the profiler
    run.after_step(step)   the registered per-step work, each in its flight-record entry
    run.summary(step, preempted)   the final results and weights' fingerprint, reported

A stateful feature is registered here and nowhere else in the trainer's plumbing: make_ema
builds the average (held as the strategy holds the model), register_ema adds it to the
checkpointer (a part, and a module checkpointed beside the model), to the evaluator (evaluated
beside the model, reported as "EMA") and to the loop (an update after every step, a fresh
start from --init-from's weights). The feature itself lives in its own module (ema.py), its
options in its config section (config.ModelConfig).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

from common.models import build_model
from solutions.phase4_production.monitoring import StragglerDetector, peak_flops, training_flops, training_profiler
from solutions.phase4_production.recovery import Attempt, Fault, FaultInjector, current_attempt
from solutions.phase4_production.trainer.checkpointer import Checkpointer
from solutions.phase4_production.trainer.config import TrainConfig
from solutions.phase4_production.trainer.data import Inputs
from solutions.phase4_production.trainer.ema import WeightsEMA, ema_decay
from solutions.phase4_production.trainer.evaluator import Evaluator
from solutions.phase4_production.trainer.flight import FlightRecord
from solutions.phase4_production.trainer.parallel import Strategy, make_strategy, other_stores
from solutions.phase4_production.trainer.report import RunReport
from solutions.phase4_production.trainer.resume import load_weights
from solutions.phase4_production.trainer.step import (StepParts, Stepper, autocast_dtype, build_optimizer,
                                                      lr_schedule, weight_decays)
from solutions.phase4_production.trainer.stores import TrainingState
from solutions.phase4_production.trainer.sync import DeferredTimer, LossWatch, StopAgreement


@dataclass
class Run:
    """One attempt of a run on this rank, built (build()) and then trained or read (loop.py, modes.py)."""

    cfg: TrainConfig
    attempt: Attempt
    device: torch.device
    started: float                    # time.perf_counter() at the attempt's start
    inputs: Inputs
    model: nn.Module                  # the plain model (strategy.module)
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    dtype: torch.dtype | None         # autocast's (--amp), None: full precision
    channels_last: bool
    faults: FaultInjector
    flight: FlightRecord
    preemption: Any                   # 4.2's PreemptionHandler
    report: RunReport
    evaluator: Evaluator
    state: TrainingState              # what the checkpointer saves besides the progress
    parts: dict[str, Any]             # the checkpointer's stateful parts, by name
    total_steps: int                  # the schedule's length
    end: int                          # where this run stops (--max-steps)
    checkpointer: Checkpointer | None = None
    start: int = 0                    # steps done when this attempt began
    source: Path | None = None        # the checkpoint it resumed from
    after_steps: list[tuple[str, Callable[[int], None]]] = field(default_factory=list)
    on_init_from: list[Callable[[], None]] = field(default_factory=list)
    stepper: Stepper | None = None    # the loop's instruments (start_training)
    stop: StopAgreement | None = None
    profiler: Any = None

    @property
    def world(self) -> int:
        return self.attempt.world_size

    @property
    def resumed(self) -> bool:
        return self.source is not None

    def after_step(self, step: int) -> None:
        """The registered work after optimizer step `step` (1-based), each in its flight-record
        entry: collective where the work is (every rank calls it at every step)."""
        for what, work in self.after_steps:
            with self.flight.waiting(what):
                work(step)

    def start_training(self) -> None:
        """The loop's instruments (module docstring); the report opened: config files, the
        opening lines, the bar."""
        cfg, rank = self.cfg, self.attempt.rank
        compression = self.strategy.attach_comm_hook(cfg.parallel, self.faults, self.start, cfg.optim.momentum,
                                                     weight_decays(cfg.optim, self.model))
        net = torch.compile(self.strategy.net) if cfg.model.compile else self.strategy.net
        self.report.open(self.start, cfg.by_section(), self.opening_lines())
        timer, losses = DeferredTimer(self.device), LossWatch(self.device)
        self.stop = StopAgreement(self.preemption, self.flight, cfg.faults.stop_check_every)
        stragglers = StragglerDetector(every=cfg.report.straggler_every, threshold=cfg.report.straggler_threshold,
                                       min_excess_s=0.005, device=self.device) if self.world > 1 else None
        parts = StepParts(net, self.strategy, self.inputs.plan, rank,
                          nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing), self.optimizer, self.scaler,
                          self.dtype, self.device, self.channels_last, cfg.optim.grad_clip, compression,
                          self.strategy.sync_points(timer, self.faults, cfg.model.compile), self.inputs.mix)
        self.stepper = Stepper(parts, self.scheduler, self.inputs.sampler, self.faults, self.flight, timer, losses,
                               stragglers, self.start, cfg.data.global_batch, cfg.faults.pg_timeout,
                               cfg.report.straggler_every, self.checkpointer.folder)
        out = Path(cfg.run.output_dir)
        self.profiler = training_profiler(out / "traces", rank, wait=5, warmup=2, active=cfg.report.profile_steps) \
            if cfg.report.profile_steps else contextlib.nullcontext()
        self.flight.step = self.start

    def opening_lines(self) -> list[str]:
        """What rank 0 says as training starts: who, where, from which step; a planned restart."""
        plan, restart = self.inputs.plan, self.attempt.restart
        big, small = max(plan.shares), min(plan.shares)
        shares = f"{big}{'' if big == small else f' or {small}'} samples per rank"
        lines = [f"rank 0 of {self.world} on {self.device}, attempt {restart}: "
                 f"{'resuming' if self.start else 'starting'} at step {self.start} of {self.total_steps} "
                 f"({shares} per step, {plan.accumulation} accumulation pass(es)); "
                 f"checkpoints in {self.checkpointer.folder}"]
        if any(f.attempt == restart - 1 for f in self.faults.faults):
            fail_at = self.cfg.faults.fail_at_step
            lines.append(f"attempt {restart} is a planned restart: the fault injector "
                         f"({'--fail-at-step ' + str(fail_at) if fail_at is not None else 'COURSE_FAULTS'}) "
                         "killed a rank of an earlier attempt, and torchrun restarted the group; the errors printed "
                         "above by torchrun and the surviving rank are that kill, expected")
        return lines

    def summary(self, step: int, preempted: bool) -> dict:
        """The run's end on every rank: its results (evaluator.final), its weights' fingerprint
        (collective under fsdp), reported (the "summary" record)."""
        results = self.evaluator.final(step, preempted)
        seconds = time.perf_counter() - self.started
        with self.flight.waiting("the final weights' gather", at=f"after step {step}"):
            fingerprint = self.strategy.fingerprint()
        stepper = self.stepper
        summary = {"step": step, "total_steps": self.total_steps, "preempted": preempted, "world_size": self.world,
                   "epochs_done": self.inputs.sampler.epoch, **results, "history": self.evaluator.history,
                   "seconds": seconds, "images_per_s": stepper.samples / stepper.seconds if stepper.seconds else 0.0,
                   "fingerprint": fingerprint, "output_dir": str(Path(self.cfg.run.output_dir)),
                   "averages": self.evaluator.titles}
        self.report.close(step, summary)
        return summary


def begin_attempt(cfg: TrainConfig) -> tuple[Attempt, float]:
    """(this attempt, its start time): every generator seeded for this rank, deterministic
    kernels if asked, the fault flags checked against the world."""
    started = time.perf_counter()
    attempt = current_attempt()
    seed = cfg.run.seed * 1_000_003 + attempt.rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if cfg.run.deterministic:  # cuBLAS is deterministic only with a fixed workspace, read when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg.run.deterministic  # autotune convolutions: image sizes are fixed
    if cfg.faults.fail_at_step is not None and cfg.faults.fail_rank >= attempt.world_size:
        raise ValueError(f"--fail-rank {cfg.faults.fail_rank} is not a rank of this world of {attempt.world_size}")
    return attempt, started


def build(cfg: TrainConfig, inputs: Inputs, attempt: Attempt, device: torch.device, preemption,
          flight: FlightRecord, started: float) -> Run:
    """The Run of this attempt (module docstring), resumed from its newest checkpoint."""
    rank, out = attempt.rank, Path(cfg.run.output_dir)
    model = build_model(cfg.model.name, inputs.shape, inputs.classes, seed=cfg.run.seed).to(device)
    if cfg.model.sync_bn:
        if device.type != "cuda":
            raise ValueError("--sync-bn: SyncBatchNorm runs on GPUs only (torch 2.14 refuses CPU tensors); "
                             "leave it off on the CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    flops = _flops_per_sample(model, inputs.sample_shape, device) if rank == 0 else None
    dtype = autocast_dtype(cfg.optim.amp, device)
    if dtype == torch.float16 and device.type == "cpu" and rank == 0:
        print("warning: --amp fp16 on CPU runs torch's slow fp16 kernels (a ResNet-18 step about 60x slower than "
              "float32, measured with torch 2.14.1); use --amp bf16 on CPU, fp16 is for GPUs without bf16",
              file=sys.stderr, flush=True)
    strategy = make_strategy(cfg.parallel.layout, device, dtype,
                             reshard_after_forward=cfg.parallel.reshard_after_forward,
                             cpu_offload=cfg.parallel.cpu_offload)
    channels_last = cfg.model.channels_last == "on" or (cfg.model.channels_last == "auto" and device.type == "cuda")
    model = strategy.prepare(model, channels_last)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    faults = FaultInjector.from_env()
    if cfg.faults.fail_at_step is not None:
        faults = FaultInjector([*faults.faults, Fault(cfg.faults.fail_rank, cfg.faults.fail_at_step, "backward")])
    ema = make_ema(cfg, model, strategy)  # a copy of the bare model: before DDP's and FSDP's hooks
    hooked = cfg.parallel.compression != "none" or any(f.phase == "allreduce" for f in faults.faults)
    strategy.wrap(model, comm_hook=hooked)
    optimizer = build_optimizer(cfg, strategy)  # after the wrap: fully_shard makes the parameters DTensors
    steps_per_epoch = inputs.sampler.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(steps_per_epoch, cfg.optim.epochs, cfg.optim.warmup_epochs))
    total = steps_per_epoch * cfg.optim.epochs
    end = min(total, cfg.run.max_steps) if cfg.run.max_steps is not None else total
    report = RunReport(cfg.report, rank, attempt.restart, end, attempt.world_size, device, out, flops)
    run = Run(cfg, attempt, device, started, inputs, model, strategy, optimizer, scheduler, scaler, dtype,
              channels_last, faults, flight, preemption, report,
              Evaluator(model, inputs.test, device, dtype, flight, report, inputs.sampler),
              TrainingState(strategy.net, strategy.module, optimizer, scheduler, scaler), {}, total, end)
    run.parts.update(data=inputs, history=run.evaluator)
    register_ema(run, ema)
    asynchronous = cfg.checkpoint.async_checkpoint == "on" or \
        (cfg.checkpoint.async_checkpoint == "auto" and device.type == "cuda")  # a store that can (the file store)
    store = strategy.make_store(out / "checkpoints", cfg.checkpoint.keep, faults, asynchronous)
    run.checkpointer = Checkpointer(store, run.state, run.parts, cfg, strategy, flight, report,
                                    other_stores(cfg.parallel.layout, store.folder), location=device)
    progress = run.checkpointer.load_latest(read_only=cfg.read_only, modules=cfg.run.export is None)
    if progress is not None:
        run.start, run.source = int(progress["step"]), store.path_for(int(progress["step"]))
    elif cfg.model.init_from and cfg.run.export is None:  # --export exports a checkpoint only
        load_weights(strategy, cfg.model.init_from, device)
        for start_from in run.on_init_from if not cfg.read_only else ():
            start_from()
    return run


def make_ema(cfg: TrainConfig, model: nn.Module, strategy: Strategy) -> WeightsEMA | None:
    """--model-ema's average (ema.py) of the bare model, held as the strategy will hold the
    model (fsdp: sharded like it), or None."""
    if not cfg.model.model_ema:
        return None
    ema = WeightsEMA(model, ema_decay(cfg.model.model_ema_decay, cfg.data.global_batch, cfg.model.model_ema_steps,
                                      cfg.optim.epochs), cfg.model.model_ema_steps, cfg.optim.warmup_epochs)
    strategy.hold_like_the_model(ema.module)
    return ema


def register_ema(run: Run, ema: WeightsEMA | None) -> None:
    """--model-ema's registration: a part of every checkpoint (its count) with its weights as
    the module "ema"; evaluated beside the model at every epoch end; updated after every
    step; started from --init-from's weights."""
    run.evaluator.register("ema", ema.module if ema is not None else None, "EMA", "--model-ema")
    if ema is None:
        return
    run.parts["ema"] = ema
    run.state.modules["ema"] = ema.module
    steps_per_epoch = run.inputs.sampler.steps_per_epoch
    run.after_steps.append(("the EMA's buffer broadcast",
                            lambda step: ema.update(step, (step - 1) // steps_per_epoch, run.strategy.module)))
    run.on_init_from.append(lambda: ema.start_from(run.strategy.module))


def _flops_per_sample(model: nn.Module, shape: tuple[int, ...], device: torch.device) -> float | None:
    """Training FLOP of one sample (for MFU), where the GPU's peak is known; None elsewhere.
    Counted on two samples in eval mode: no normalisation statistic moves."""
    if device.type != "cuda" or peak_flops(torch.cuda.get_device_name(device)) is None:
        return None
    model.eval()
    try:
        return training_flops(model, torch.zeros(2, *shape, device=device)) / 2
    finally:
        model.train()
