"""The phase-4 trainer: fault-tolerant data-parallel training of torchvision models.

    python -m solutions.phase4_production.train                       # 2 CPU ranks, digits
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m solutions.phase4_production.train
    torchrun ... -m solutions.phase4_production.train --config imagenet_resnet50_8gpu.toml

One attempt on one rank (torchrun starts a fresh attempt after a failure):

    config ─► data (ElasticSampler 4.3 ─► DataLoader workers: uint8 crops, train_augment.py ─►
              device stage: normalise, erase, mix, train_loader.py) ─► model (+ its EMA,
              train_ema.py) ─► DDP (+ 4.4 comm hook) or FSDP2's fully_shard (train_parallel.py)
    output folder: every node sees it, one writer (run_folder.py)
    resume (4.2): newest checkpoint that verifies (4.1; fsdp: sharded_checkpoint.py), the
                  same step on every rank, the same hyperparameters (train_resume.py)
    for each step:   data │ forward │ backward (+ all-reduce) │ optimizer      train_step.py, StepTimer (4.5)
      step boundary: ranks agree on SIGTERM/SIGINT ─► save, exit 0   PreemptionHandler (4.2)
                     every N steps / epoch end ─► atomic checkpoint            (4.1)
                     epoch end ─► evaluate (all ranks' counts summed), and the EMA
                     every K steps ─► metrics.jsonl, straggler report           (4.5)
    Nothing is read back from the device on a step that is not logged, saved or
    evaluated: loss, step times and the stop flag wait (train_sync.py).

What makes a resumed run bit-identical to one never stopped (CPU, same world size): the
checkpoint holds model, optimizer, LR schedule, loss scaler, data position and every
rank's RNG (and the EMA); the data order depends on (seed, epoch) only; each sample's
augmentation on (seed, epoch, index, copy) only (train_data.SeededSamples); batch mixing on
(seed, step) only (train_loader.BatchMixing). With --compression a run resumes
correctly but not bit-identically (see train_comm.register_comm_hook). The command line is
in train_cli.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from common.distributed import current_device
from common.models import build_model
from solutions.phase4_production.checkpoint import CheckpointManager, training_state, unwrap
from solutions.phase4_production.checkpoint_writer import BackgroundWriter, SaveResult
from solutions.phase4_production.config import TrainConfig
from solutions.phase4_production.elastic import ElasticSampler, plan_batches
from solutions.phase4_production.lifecycle import orphaned, stop_signals
from solutions.phase4_production.monitoring import (MetricsWriter, StragglerDetector, peak_flops, training_flops,
                                                    training_profiler)
from solutions.phase4_production.recovery import Fault, FaultInjector, PreemptionHandler, current_attempt
from solutions.phase4_production.run_folder import claim_output_dir, why_unwritable
from solutions.phase4_production.sharded_checkpoint import ShardedCheckpoints
from solutions.phase4_production.train_comm import register_comm_hook, set_sparsity
from solutions.phase4_production.train_data import (RankBatches, build_datasets, crop_sizes, eval_loader,
                                                    input_stats, train_loader)
from solutions.phase4_production.train_ema import WeightsEMA
from solutions.phase4_production.train_loader import BatchMixing, DeviceBatches, InputStage, measure_loader
from solutions.phase4_production.train_parallel import Parallel, wrap_model
from solutions.phase4_production.train_report import RunReport
from solutions.phase4_production.train_resume import export_weights, identity, load_weights, resume_run
from solutions.phase4_production.train_step import (NonFiniteLoss, SyncPoints, StepParts, autocast_dtype,
                                                    lr_schedule, make_optimizer, train_step)
from solutions.phase4_production.train_sync import DeferredTimer, LossWatch, StopAgreement

# ---------------------------------------------------------------- building blocks


def fingerprint(model: nn.Module | dict) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes, in name order): equal
    fingerprints mean bit-identical weights and buffers. `model`: a module, or a state_dict."""
    digest = hashlib.sha256()
    state = model if isinstance(model, dict) else unwrap(model).state_dict()
    for name, tensor in sorted(state.items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device,
             dtype: torch.dtype | None) -> tuple[float, float, float | None]:
    """(top-1 accuracy, mean loss, top-5 accuracy) over the whole test set: every rank's sums
    all-reduced. Top-5 is None with fewer than 6 classes (it would be trivially high)."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # top-1 correct, loss sum, count, top-5 correct
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        sums[2] += len(y)
        sums[3] += (logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]).any(1).sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    top5 = (sums[3] / sums[2]).item() if logits.shape[1] > 5 else None
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), top5


def evaluate_ema(ema: nn.Module, loader, device: torch.device, dtype: torch.dtype | None) -> dict:
    """evaluate() of the --model-ema average, as the summary, the metrics and the report carry
    it: {"accuracy", "test_loss", "top5"}."""
    return dict(zip(("accuracy", "test_loss", "top5"), evaluate(ema.module, loader, device, dtype)))


# ---------------------------------------------------------------- one attempt on one rank


def train(cfg: TrainConfig) -> dict:
    """Train (or resume, or find finished) the run in cfg.output_dir on this rank; returns
    the summary (on every rank). Collective: every rank of the process group calls it.
    A stop signal (SIGTERM, SIGINT) is recorded from the first line on: the run stops and
    saves at the next step boundary, however early it came."""
    device = current_device()
    if dist.is_initialized():  # building data, model and the first step (compile, autotuning) may be slow
        dist.set_timeout(datetime.timedelta(seconds=cfg.pg_init_timeout))
    read_only = cfg.evaluate or cfg.export is not None or cfg.benchmark_loader is not None
    folder = contextlib.nullcontext() if read_only else claim_output_dir(cfg.output_dir, device)
    place = {"step": 0, "first": 0, "what": "a collective", "at": "before the first step"}  # see _named_timeouts
    with PreemptionHandler(stop_signals(), device=device) as preemption, folder, _named_timeouts(cfg, place):
        return _train(cfg, preemption, place)


class OutputNotWritable(ValueError):
    """The output folder cannot take a checkpoint (full, read-only, ...): no restart fixes it."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than --pg-timeout, or the loop longer than --loader-timeout
    for a batch: a rank or a loader worker is stuck or dead. Not the user's doing, so torchrun
    restarts the attempt (from the newest checkpoint)."""


@contextlib.contextmanager
def _named_timeouts(cfg: TrainConfig, place: dict) -> Iterator[None]:
    """Turn a collective's timeout (gloo raises it; NCCL's watchdog aborts the process and
    its flight recorder says where), or the loader's, into one line naming the step (or
    place["at"], outside the training loop) and what waited."""
    try:
        yield
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        at = place["at"] or f"step {place['step'] + 1}"
        if str(exc).startswith("DataLoader timed out"):  # torch.utils.data's message, workers > 0
            raise CollectiveTimeout(f"{at}: no batch from the {cfg.workers} loader worker(s) "
                                    f"in {cfg.loader_timeout:g} s (--loader-timeout): a worker is stuck (a file "
                                    "system that stopped answering, a sample that never returns); this attempt "
                                    "ends, and torchrun restarts it from the newest checkpoint") from None
        limit = cfg.pg_timeout if place["step"] > place["first"] else cfg.pg_init_timeout
        raise CollectiveTimeout(f"{at}: {place['what']} waited more than {limit:g} s "
                                f"(--pg-timeout/--pg-init-timeout) for another rank, which is stuck or dead; this "
                                "attempt ends, and torchrun restarts it from the newest checkpoint") from None


def _train(cfg: TrainConfig, preemption: PreemptionHandler, place: dict) -> dict:
    started = time.perf_counter()
    attempt = current_attempt()
    rank, world = attempt.rank, attempt.world_size
    device = current_device()
    out = Path(cfg.output_dir)
    _seed_everything(cfg.seed * 1_000_003 + rank)
    if cfg.deterministic:  # cuBLAS is deterministic only with a fixed workspace, read when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg.deterministic  # autotune convolutions: image sizes are fixed

    if cfg.fail_at_step is not None and cfg.fail_rank >= world:
        raise ValueError(f"--fail-rank {cfg.fail_rank} is not a rank of this world of {world}")
    if cfg.decode == "cuda" and device.type != "cuda":
        raise ValueError("--decode cuda decodes on the GPU (nvjpeg); this run trains on the CPU: use --decode tensor")
    train_set, test_set, shape, classes = build_datasets(
        cfg.dataset, cfg.data_root, cfg.image_size, cfg.synthetic_size, cfg.train_crop_size, cfg.val_resize_size,
        cfg.val_crop_size, cfg.decode, cfg.auto_augment, cfg.random_erase)
    plan = plan_batches(cfg.global_batch, world, cfg.micro_batch or cfg.global_batch)
    sampler = ElasticSampler(len(train_set), cfg.global_batch, seed=cfg.seed)
    pin = device.type == "cuda"
    mixing = cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0
    loader = train_loader(train_set, RankBatches(sampler, rank, world, cfg.ra_reps, neighbour=mixing), cfg.seed,
                          cfg.workers, pin, cfg.loader_timeout)
    crop, resize, test_crop = crop_sizes(cfg.dataset, cfg.image_size, cfg.train_crop_size, cfg.val_resize_size,
                                         cfg.val_crop_size)
    stats = input_stats(cfg.dataset, cfg.image_size)
    batches_of = DeviceBatches(loader, InputStage(device, stats, cfg.decode, True, crop, resize, cfg.auto_augment),
                               device)
    tests = DeviceBatches(eval_loader(test_set, rank, world, max(plan.micro_batches(0)), cfg.workers, pin,
                                      cfg.loader_timeout),
                          InputStage(device, stats, cfg.decode, False, test_crop, resize), device)  # rank 0: a largest share
    if cfg.benchmark_loader is not None:  # the input pipeline alone: nothing trained or written
        place.update(at="--benchmark-loader", what="the loader benchmark's all-reduce")
        return {"benchmark_loader": measure_loader(batches_of, cfg.benchmark_loader, device), "world_size": world}
    total_steps = sampler.steps_per_epoch * cfg.epochs  # the schedule's length
    end = min(total_steps, cfg.max_steps) if cfg.max_steps is not None else total_steps  # where this run stops

    model = build_model(cfg.model, shape, classes, seed=cfg.seed).to(device)
    if cfg.sync_bn:
        if device.type != "cuda":
            raise ValueError("--sync-bn: SyncBatchNorm runs on GPUs only (torch 2.14 refuses CPU tensors); "
                             "leave it off on the CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    flops_per_sample = _flops_per_sample(model, (shape[0], crop, crop) if cfg.dataset == "imagenet" else shape,
                                         device) if rank == 0 else None
    channels_last = cfg.channels_last == "on" or (cfg.channels_last == "auto" and device.type == "cuda")
    if channels_last and cfg.parallel != "fsdp":  # fully_shard refuses non-contiguous parameters (torch 2.14):
        model = model.to(memory_format=torch.channels_last)  # under fsdp the inputs alone go channels_last
    dtype = autocast_dtype(cfg.amp, device)
    if dtype == torch.float16 and device.type == "cpu" and rank == 0:
        print("warning: --amp fp16 on CPU runs torch's slow fp16 kernels (a ResNet-18 step about 60x slower than "
              "float32, measured with torch 2.14.1); use --amp bf16 on CPU, fp16 is for GPUs without bf16",
              file=sys.stderr, flush=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = WeightsEMA.create(model, cfg, device, dtype) if cfg.model_ema else None  # before DDP's and FSDP's hooks
    faults = FaultInjector.from_env()
    if cfg.fail_at_step is not None:
        faults = FaultInjector([*faults.faults, Fault(cfg.fail_rank, cfg.fail_at_step, "backward")])
    hooked = cfg.compression != "none" or any(f.phase == "allreduce" for f in faults.faults)  # DDP's hooks
    parallel = wrap_model(model, cfg.parallel, device, dtype, cfg.reshard_after_forward, cfg.cpu_offload, hooked)
    optimizer = make_optimizer(cfg, model)  # after fully_shard, which makes the parameters DTensors
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(sampler.steps_per_epoch, cfg.epochs, cfg.warmup_epochs))

    checkpoints = CheckpointManager(out / "checkpoints", keep=cfg.keep)
    sharded = ShardedCheckpoints(out / "checkpoints", keep=cfg.keep) if cfg.parallel == "fsdp" else None
    modules = {"ema": ema.module} if ema is not None and sharded is not None else None  # saved through DCP
    progress = resume_run(checkpoints, sharded, cfg, parallel, optimizer, scheduler, scaler, device, modules)
    step = int(progress["step"]) if progress else 0
    source = (sharded or checkpoints).path_for(step) if progress else None
    if cfg.export is not None:  # read only, like --evaluate
        return {"exported": export_weights(parallel, cfg.export, source), "step": step, "world_size": world,
                "fingerprint": _fingerprint(parallel)}
    if progress is None and cfg.init_from:
        load_weights(parallel, cfg.init_from, device)
    if cfg.evaluate:  # read only: no lease, no config file, no metrics
        place.update(at="--evaluate", what="the evaluation's all-reduce")
        accuracy, test_loss, top5 = evaluate(model, tests, device, dtype)
        ema_result = None
        if ema is not None and progress:  # the run's average, as its epoch ends evaluate it
            ema.restore(progress)
            ema_result = evaluate_ema(ema, tests, device, dtype)
        return {"evaluated": True, "step": step, "total_steps": total_steps, "world_size": world,
                "accuracy": accuracy, "top5": top5, "test_loss": test_loss, "ema": ema_result,
                "fingerprint": _fingerprint(parallel),
                "source": f"{source}" if progress else cfg.init_from or "the initial weights"}
    if ema is not None and progress:
        ema.restore(progress)
    elif ema is not None and cfg.init_from:  # the average starts from the weights the run starts from
        ema.update_parameters(parallel.module)
        ema.restart()
    compression = register_comm_hook(parallel.net, cfg, faults, step) if parallel.kind == "ddp" else None
    net = torch.compile(parallel.net) if cfg.compile else parallel.net
    if progress:
        sampler.load_state_dict(progress["data"])
    history: list[dict] = list(progress.get("history", [])) if progress else []

    installed = importlib.util.find_spec("tensorboard") is not None
    if cfg.tensorboard and not installed and rank == 0:
        print("warning: --tensorboard: the tensorboard package is not installed (pip install -e \".[tensorboard]\"); "
              "metrics go to metrics.jsonl only", file=sys.stderr, flush=True)
    board = out / "tensorboard" if cfg.tensorboard is not False and installed else None
    metrics = MetricsWriter(out / "metrics.jsonl", rank, board) if rank == 0 else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        resolved = json.dumps(dataclasses.asdict(cfg), indent=2) + "\n"
        (out / "config.json").write_text(resolved)  # the latest start's; configs/ keeps every attempt's
        (out / "configs").mkdir(exist_ok=True)
        (out / "configs" / f"{time.strftime('%Y%m%d-%H%M%S')}-attempt{attempt.restart}-pid{os.getpid()}.json").write_text(resolved)
        print(f"rank 0 of {world} on {device}, attempt {attempt.restart}: "
              f"{'resuming' if step else 'starting'} at step {step} of {total_steps} "
              f"({_shares(plan)} per step, {plan.accumulation} accumulation pass(es)); "
              f"checkpoints in {checkpoints.folder}", flush=True)
        if any(f.attempt == attempt.restart - 1 for f in faults.faults):
            print(f"attempt {attempt.restart} is a planned restart: the fault injector "
                  f"({'--fail-at-step ' + str(cfg.fail_at_step) if cfg.fail_at_step is not None else 'COURSE_FAULTS'}) "
                  "killed a rank of an earlier attempt, and torchrun restarted the group; the errors printed "
                  "above by torchrun and the surviving rank are that kill, expected", flush=True)
    timer, losses = DeferredTimer(device), LossWatch(device)
    agreement = StopAgreement(preemption, cfg.pg_init_timeout)
    stragglers = StragglerDetector(every=cfg.straggler_every, threshold=cfg.straggler_threshold,
                                   min_excess_s=0.005, device=device) if world > 1 else None
    parts = StepParts(net, parallel, plan, rank, nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing), optimizer,
                      scaler, dtype, device, channels_last, cfg.grad_clip, compression,
                      SyncPoints(parallel.net, timer, faults)
                      if world > 1 and not cfg.compile and parallel.kind == "ddp" else None,
                      BatchMixing(cfg.mixup_alpha, cfg.cutmix_alpha, classes, cfg.seed) if mixing else None)
    show = RunReport(cfg, rank, attempt.restart, end, step, world, metrics, device, flops_per_sample)
    profiler = training_profiler(out / "traces", rank, wait=5, warmup=2, active=cfg.profile_steps) \
        if cfg.profile_steps else contextlib.nullcontext()
    samples_trained, train_seconds, preempted = 0, 0.0, False

    def saved(result: SaveResult) -> None:  # what checkpointing costs: compare with step_s x --checkpoint-every
        if result.path is not None:
            show.checkpoint(result.step, result.stall_s, result.path.stat().st_size, result.write_s)

    background = cfg.async_checkpoint == "on" or \
        (cfg.async_checkpoint == "auto" and device.type == "cuda" and sharded is None)
    writer = BackgroundWriter(checkpoints, faults, asynchronous=background, on_done=saved)

    @contextlib.contextmanager
    def one_line_write_errors() -> Iterator[None]:
        try:
            yield
        except (OSError, RuntimeError) as exc:
            why = why_unwritable(checkpoints.folder, exc) if rank == 0 else None
            if why is None:
                raise
            failed = writer.failed_step if writer.failed_step is not None else step
            raise OutputNotWritable(f"cannot write the checkpoint of step {failed} in {checkpoints.folder}: {why}; "
                                    "free space or use another --output-dir (the newest complete checkpoint is "
                                    "kept)") from None

    def save() -> None:
        if not parallel.weights_finite():  # the same answer on every rank
            raise NonFiniteLoss(f"the weights became NaN or infinite at step {step} (another rank's loss did); "
                                f"not saved: the newest checkpoint in {checkpoints.folder} is the last good state")
        if orphaned():  # the launcher died a moment ago: its SIGKILL is on the way, write nothing
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.perf_counter()
        progress = {"step": step, "data": sampler.state_dict(), "history": history, "identity": identity(cfg),
                    "config": dataclasses.asdict(cfg)}
        if ema is not None:
            progress.update(ema.progress() if sharded is None else {"ema_updates": ema.updates})
        if sharded is not None:  # every rank writes its shards (collective), synchronously
            parallel.sync_buffers()  # one value per replicated buffer: whichever rank DCP takes it from
            with one_line_write_errors():
                path = sharded.save(step, parallel.module, optimizer, scheduler, scaler, progress, faults, modules)
            if path is not None:
                seconds = time.perf_counter() - began
                show.checkpoint(step, seconds, sum(sharded.bytes_of(step).values()), seconds)
            return
        state = training_state(parallel.net, optimizer, scheduler, scaler, progress)
        with one_line_write_errors():
            writer.submit(step, state, began)

    def evaluate_epoch() -> None:  # the plain module: DDP's forward would broadcast buffers, per batch
        accuracy, test_loss, top5 = evaluate(model, tests, device, dtype)
        record = {"epoch": sampler.epoch - 1, "step": step, "accuracy": accuracy, "top5": top5, "test_loss": test_loss}
        if ema is not None:
            record["ema"] = evaluate_ema(ema, tests, device, dtype)
        history.append(record)
        show.epoch(history[-1])

    def check_loss() -> float:  # one read of the device: the loss and whether any was NaN or infinite
        value, bad_step, bad_value = losses.read()
        if bad_step is not None:
            raise NonFiniteLoss(f"the loss became {bad_value} at step {bad_step} (rank {rank}): lower --lr or use "
                                f"--grad-clip; not saved, the newest checkpoint in {checkpoints.folder} is the "
                                "last good state")
        return value

    place.update(step=step, first=step)
    if step and sampler.consumed == 0 and (not history or history[-1]["step"] != step):
        place.update(at="the evaluation a preemption skipped", what="the evaluation's all-reduce")
        evaluate_epoch()  # a preemption at the epoch's end skipped it

    place.update(at=None, what="the first step")  # where a collective or the loader may time out
    with profiler as prof, writer:
        while step < end:
            batches = iter(batches_of)
            while step < end:
                faults.begin_step(step)
                timer.start()
                with timer.phase("data"):
                    faults.point("data")
                    batch = next(batches, None)
                if batch is None:
                    break
                place.update(step=step, what="DDP's gradient all-reduce (in backward)")
                set_sparsity(compression, cfg, step)
                losses.add(train_step(parts, batch, timer, faults, step), step + 1)
                if step == place["first"] and dist.is_initialized():  # every rank is in step: from now on, short
                    dist.set_timeout(datetime.timedelta(seconds=cfg.pg_timeout))
                    agreement.set_timeout(cfg.pg_timeout)
                scheduler.step()
                sampler.advance()
                step += 1
                timer.stop(samples=plan.shares[rank])
                samples_trained += cfg.global_batch  # by all ranks
                if ema is not None:
                    place["what"] = "the EMA's buffer broadcast"
                    ema.update(step, (step - 1) // sampler.steps_per_epoch, parallel.module)
                epoch_done = sampler.consumed == 0
                place["what"] = "the stop-flag all-reduce (StopAgreement, on a gloo group)"
                # before the evaluation: the grace period is ticking. A host collective, no device sync
                check = step % cfg.stop_check_every == 0 or epoch_done or step == end
                stop = agreement.should_stop() if check else False
                saving = stop or epoch_done or step % cfg.checkpoint_every == 0 or step == end
                logged = step % cfg.log_every == 0
                loss = check_loss() if logged or saving else None
                if epoch_done and not stop:
                    place["what"] = "the evaluation's all-reduce"
                    evaluate_epoch()
                place["what"] = "the straggler report's all-gather"
                due = stragglers is not None and (step - place["first"]) % cfg.straggler_every == 0
                times, report = None, None
                if logged or due or stop or step == end or len(timer.pending) >= 1000:  # alike on every rank
                    for times in timer.collect():
                        train_seconds += times["step"]
                        report = (stragglers.update(times) if stragglers else None) or report
                show.step(step, loss, scheduler.get_last_lr()[0], times if logged else None, report)
                if prof is not None:
                    prof.step()
                if saving:
                    place["what"] = "the checkpoint's RNG gather"
                    save()
                if stop:
                    preempted = True
                    with one_line_write_errors():
                        writer.wait()
                    if world > 1:
                        dist.barrier()  # the checkpoint is complete before anyone says so
                    break
            if preempted:
                break
        with one_line_write_errors():
            writer.wait()  # the last checkpoint is on disk before the run says it is done
    ema_result = None
    if preempted:  # the grace period is ticking: leave now
        accuracy = test_loss = top5 = None
    elif not history or history[-1]["step"] != step:  # stopped mid-epoch (--max-steps)
        place.update(at="the final evaluation", what="the evaluation's all-reduce")
        accuracy, test_loss, top5 = evaluate(model, tests, device, dtype)
        if ema is not None:
            ema_result = evaluate_ema(ema, tests, device, dtype)
    else:
        accuracy, test_loss, top5 = history[-1]["accuracy"], history[-1]["test_loss"], history[-1].get("top5")
        ema_result = history[-1].get("ema")
    place.update(at=f"after step {step}", what="the final weights' gather")
    summary = {"step": step, "total_steps": total_steps, "preempted": preempted, "world_size": world,
               "epochs_done": sampler.epoch, "accuracy": accuracy, "top5": top5, "test_loss": test_loss,
               "ema": ema_result, "history": history, "seconds": time.perf_counter() - started,
               "images_per_s": samples_trained / train_seconds if train_seconds else 0.0,
               "fingerprint": _fingerprint(parallel), "output_dir": str(out)}
    show.close(step, summary)
    return summary


def _fingerprint(parallel: Parallel) -> str:
    """fingerprint() of the whole model, on every rank (collective under fsdp)."""
    state = parallel.full_state_dict()  # under fsdp: gathered on rank 0, {} elsewhere
    value = fingerprint(state) if parallel.kind == "ddp" or dist.get_rank() == 0 else None
    if parallel.kind == "fsdp" and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def _shares(plan) -> str:
    """'32 samples per rank', or '22 or 21 samples per rank' where the world does not divide the batch."""
    big, small = max(plan.shares), min(plan.shares)
    return f"{big}{'' if big == small else f' or {small}'} samples per rank"


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


# the command line lives in train_cli.py; these names stay importable from here
from solutions.phase4_production.train_cli import choose_training_device, default_nproc, main  # noqa: E402,F401

if __name__ == "__main__":
    main()
