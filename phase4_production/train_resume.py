"""What a start of the trainer resumes, and what it refuses to.

    resume_run(...)    the newest checkpoint that verifies (4.2's resume; under fsdp the sharded
                       store's), on every rank; one line for checkpoints of another run or of
                       the other --parallel; entries that are not readable checkpoints and
                       newer corrupt ones set aside; hyperparameters that differ from the
                       checkpoint's refused, or applied with --apply-changes
    load_weights(...)  --init-from: a fresh run's weights from a checkpoint or a state_dict
    export_weights()   --export: the model's full state_dict in one plain torch.save file
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from phase4_production.checkpoint import CheckpointManager, CorruptCheckpoint, load_verified
from phase4_production.config import (FIXED, IDENTITY, TrainConfig, changed_hyperparameters,
                                                describe_changes)
from phase4_production.recovery import current_attempt, resume, set_aside_newer
from phase4_production.sharded_checkpoint import ShardedCheckpoints
from phase4_production.train_parallel import Parallel
from phase4_production.train_step import make_optimizer


def identity(cfg: TrainConfig) -> dict:
    """What a checkpoint must match to be resumed by this config (else it is another run)."""
    return {name: getattr(cfg, name) for name in IDENTITY}


def resume_run(checkpoints: CheckpointManager, sharded: ShardedCheckpoints | None, cfg: TrainConfig,
               parallel: Parallel, optimizer, scheduler, scaler, device, modules: dict | None = None) -> dict | None:
    """recovery.resume (ddp) or the sharded store's load_latest (fsdp: `sharded`, loading
    `modules` too: the --model-ema average), with a one-line error when the checkpoints belong
    to another run or to the other --parallel."""
    read_only = cfg.evaluate or cfg.export is not None
    _refuse_the_other_kind(checkpoints, sharded, cfg)
    if not read_only and sharded is None:
        _set_aside(checkpoints.unusable(), ".unusable", "is not a readable checkpoint file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            if sharded is not None:
                saved = _newest_config(checkpoints, sharded)  # checked before DCP reads any shard into the model
                if saved is not None and saved[2] != identity(cfg):
                    _refuse_identity(checkpoints, saved[2], cfg)
                if saved is not None:
                    _check_changes(changed_hyperparameters(saved[1], cfg), cfg, checkpoints, saved[0])
                progress = sharded.load_latest(parallel.module, optimizer, scheduler, scaler, map_location=device,
                                               set_aside=not read_only,
                                               modules=None if cfg.export is not None else modules)
            else:
                progress = resume(checkpoints, parallel.net, optimizer, scheduler, scaler, map_location=device)
    except (RuntimeError, KeyError, ValueError) as exc:
        if "parameter groups" in str(exc):  # torch's optimizer: the checkpoint's groups are not this run's
            raise ValueError(f"the checkpoints in {checkpoints.folder} hold an optimizer of other parameter groups "
                             "(one per weight decay: --weight-decay, --norm-weight-decay, --bias-weight-decay and "
                             "--transformer-embedding-decay decide them, and cannot change in the middle of a run): "
                             "resume with the run's values, or start from its weights in another --output-dir with "
                             "--init-from CHECKPOINT") from None
        if "state_dict" not in str(exc) and not isinstance(exc, KeyError):
            raise
        saved = _newest_config(checkpoints, sharded)  # why the state did not fit: a setting that cannot change?
        if saved is not None:
            _check_changes(changed_hyperparameters(saved[1], cfg), cfg, checkpoints, saved[0])
        raise ValueError(f"the checkpoints in {checkpoints.folder} are not of this run "
                         f"({str(exc).splitlines()[0]}): use another --output-dir, or delete them to start over") from None
    if progress is not None and progress.get("identity") != identity(cfg):
        _refuse_identity(checkpoints, progress.get("identity"), cfg)
    if not read_only and sharded is None:  # (the sharded store sets aside what fails as it tries it)
        set_aside_newer(checkpoints, int(progress["step"]) if progress else None)  # failed verification
    changes = changed_hyperparameters(progress["config"], cfg) if progress and "config" in progress else {}
    if changes:
        _check_changes(changes, cfg, checkpoints, progress["step"])
        _apply_changes(cfg, parallel.module, optimizer, scheduler, changes)
    return progress


def _refuse_the_other_kind(checkpoints: CheckpointManager, sharded: ShardedCheckpoints | None,
                           cfg: TrainConfig) -> None:
    """ValueError (one line) when the folder holds only checkpoints of the other --parallel:
    ddp writes one file per step (step_N.pt), fsdp a folder of shards (step_N/)."""
    files, folders = checkpoints.steps(), ShardedCheckpoints(checkpoints.folder).steps()
    mine, other = (folders, files) if sharded is not None else (files, folders)
    if other and not mine:
        was, now = ("ddp", "fsdp") if sharded is not None else ("fsdp", "ddp")
        raise ValueError(f"the checkpoints in {checkpoints.folder} were written with --parallel {was}, this run "
                         f"uses --parallel {now}: resume with --parallel {was}, or write the weights with "
                         f"--parallel {was} --export FILE and start a new run (another --output-dir) with "
                         "--init-from FILE")


def _refuse_identity(checkpoints: CheckpointManager, saved: dict | None, cfg: TrainConfig) -> None:
    raise ValueError(f"the checkpoints in {checkpoints.folder} were written by a run with {saved}, this run has "
                     f"{identity(cfg)}: use another --output-dir, or delete them to start over")


def _newest_config(checkpoints: CheckpointManager,
                   sharded: ShardedCheckpoints | None) -> tuple[int, dict, dict | None] | None:
    """(step, config, identity) saved with the newest checkpoint of this kind that holds a
    config (the sharded store's extra file, read without its shards)."""
    if sharded is not None:
        for step in reversed(sharded.steps()):
            try:
                progress = load_verified(sharded.path_for(step) / "extra.pt")["progress"]
            except (CorruptCheckpoint, OSError):
                continue  # load_latest sets it aside and reports it
            return (step, progress["config"], progress.get("identity")) if "config" in progress else None
        return None
    newest = checkpoints.load_latest()
    if newest is not None and "config" in newest[1]["progress"]:
        return newest[0], newest[1]["progress"]["config"], newest[1]["progress"].get("identity")
    return None


def export_weights(parallel: Parallel, path: str, source: Path | None) -> str:
    """--export: the model's full state_dict (gathered from the shards under fsdp) written by
    rank 0 to `path` with torch.save, atomically (a temporary file renamed). Collective.
    Returns what was exported, for the summary; ValueError (one line) with no checkpoint."""
    if source is None:
        raise ValueError("--export: no checkpoint in --output-dir to export (train first, or point --output-dir "
                         "at a run)")
    state = parallel.full_state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = Path(path).with_name(f".{Path(path).name}.tmp{os.getpid()}")
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return f"{source} -> {path}"


def load_weights(parallel: Parallel, path: str, device: torch.device) -> None:
    """--init-from: the model's weights from a checkpoint of this trainer (verified) or a
    state_dict file (loaded with weights_only=True); ValueError (one line) if they do not fit."""
    try:
        state = load_verified(path, map_location=device)
    except CorruptCheckpoint:  # not one of ours: a plain state_dict
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            raise ValueError(f"--init-from {path}: neither a checkpoint of this trainer nor a state_dict "
                             f"({type(exc).__name__})") from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    try:
        parallel.load_full_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ValueError(f"--init-from {path} does not fit this --model: {str(exc).splitlines()[0]}") from None


def _check_changes(changes: dict, cfg: TrainConfig, checkpoints: CheckpointManager, step: int) -> None:
    """Raise ValueError (one line) for hyperparameters that differ from the checkpoint's,
    unless --apply-changes asks for them; settings in FIXED cannot change at all."""
    fixed = [name for name in FIXED if name in changes]
    if fixed:
        raise ValueError(f"the checkpoints in {checkpoints.folder} were trained with other settings "
                         f"({describe_changes(changes)}); {', '.join('--' + n for n in fixed)} cannot change in "
                         "the middle of a run: use the old values, or another --output-dir")
    if changes and not cfg.apply_changes:
        raise ValueError(f"the checkpoints in {checkpoints.folder} were trained with other hyperparameters "
                         f"({describe_changes(changes)}): rerun with the old values, or add --apply-changes to "
                         f"continue from step {step} with the new ones")


def _apply_changes(cfg: TrainConfig, model: nn.Module, optimizer, scheduler, changes: dict) -> None:
    """Put the config's hyperparameters into a resumed optimizer and LR schedule (which hold
    the checkpoint's) and say what changed, on rank 0. The schedule's function was built from
    the new --epochs/--warmup-epochs already; the peak LR is set anew from --lr."""
    before = [group["lr"] for group in optimizer.param_groups]
    fresh = make_optimizer(cfg, model)  # the groups and values this config gives, without state
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group, new in zip(optimizer.param_groups, fresh.param_groups):
        for key in ("weight_decay", "momentum", "nesterov"):
            if key in new:
                group[key] = new[key]
        group["initial_lr"] = new["lr"]
        group["lr"] = new["lr"] * factor
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    if current_attempt().rank == 0:
        print(f"applying changed hyperparameters at step {scheduler.last_epoch} (--apply-changes): "
              f"{describe_changes(changes)}; the LR goes from {before[0]:.6g} to {optimizer.param_groups[0]['lr']:.6g}",
              flush=True)


def _set_aside(paths: list[Path], suffix: str, why: str) -> None:
    """On rank 0: rename each path to path + suffix, with one warning line each (a rename
    that fails is reported too: the entry then stays where it is, ignored)."""
    if current_attempt().rank != 0:
        return
    for path in paths:
        try:
            path.rename(path.with_name(path.name + suffix))
            print(f"warning: {path} {why}: set aside as {path.name}{suffix} (delete it when done)",
                  file=sys.stderr, flush=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            print(f"warning: {path} {why}, and could not be set aside ({exc.strerror}): ignored",
                  file=sys.stderr, flush=True)
