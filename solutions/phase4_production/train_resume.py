"""What a start of the trainer resumes, and what it refuses to.

    resume_run(...)    the newest checkpoint that verifies (4.2's resume), on every rank; one
                       line for checkpoints of another run; entries that are not readable
                       checkpoints and newer corrupt ones set aside; hyperparameters that
                       differ from the checkpoint's refused, or applied with --apply-changes
    load_weights(...)  --init-from: a fresh run's weights from a checkpoint or a state_dict
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from solutions.phase4_production.checkpoint import CheckpointManager, CorruptCheckpoint, load_verified, unwrap
from solutions.phase4_production.config import (FIXED, IDENTITY, TrainConfig, changed_hyperparameters,
                                                describe_changes)
from solutions.phase4_production.recovery import current_attempt, resume, set_aside_newer
from solutions.phase4_production.train_step import make_optimizer


def identity(cfg: TrainConfig) -> dict:
    """What a checkpoint must match to be resumed by this config (else it is another run)."""
    return {name: getattr(cfg, name) for name in IDENTITY}


def resume_run(checkpoints, cfg, ddp, optimizer, scheduler, scaler, device) -> dict | None:
    """recovery.resume, with a one-line error when the checkpoints belong to another run."""
    if not cfg.evaluate:  # an evaluation writes nothing
        _set_aside(checkpoints.unusable(), ".unusable", "is not a readable checkpoint file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            progress = resume(checkpoints, ddp, optimizer, scheduler, scaler, map_location=device)
    except (RuntimeError, KeyError, ValueError) as exc:
        if "state_dict" not in str(exc) and not isinstance(exc, KeyError):
            raise
        newest = checkpoints.load_latest()  # why the state did not fit: a setting that cannot change?
        if newest is not None and "config" in newest[1]["progress"]:
            _check_changes(changed_hyperparameters(newest[1]["progress"]["config"], cfg), cfg, checkpoints, newest[0])
        raise ValueError(f"the checkpoints in {checkpoints.folder} are not of this run "
                         f"({str(exc).splitlines()[0]}): use another --output-dir, or delete them to start over") from None
    if progress is not None and progress.get("identity") != identity(cfg):
        raise ValueError(f"the checkpoints in {checkpoints.folder} were written by a run with "
                         f"{progress.get('identity')}, this run has {identity(cfg)}: use another --output-dir, "
                         "or delete them to start over")
    if not cfg.evaluate:
        set_aside_newer(checkpoints, int(progress["step"]) if progress else None)  # failed verification
    changes = changed_hyperparameters(progress["config"], cfg) if progress and "config" in progress else {}
    if changes:
        _check_changes(changes, cfg, checkpoints, progress["step"])
        _apply_changes(cfg, unwrap(ddp), optimizer, scheduler, changes)
    return progress


def load_weights(model: nn.Module, path: str, device: torch.device) -> None:
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
        model.load_state_dict(state)
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
