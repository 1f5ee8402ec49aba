"""What a start of the trainer resumes, and what it refuses to (the checkpointer's policy).

    identity(cfg)                       what a checkpoint must match to be this run's
    refuse_identity(...)                one line for checkpoints of another run
    check_changes(...)                  hyperparameters that differ from the checkpoint's: refused,
                                        or allowed with --apply-changes; FIXED ones never
    apply_changes(...)                  the allowed ones put into the resumed optimizer and schedule
    explain_load_error(...)             why a checkpoint's state did not fit this run, in one line
    load_weights(strategy, path, ...)   --init-from: a fresh run's weights from a checkpoint or a state_dict

checkpointer.Checkpointer.load_latest calls them around its store's load.
"""

from __future__ import annotations

import torch

from phase4_production.checkpoint import CorruptCheckpoint, load_verified
from phase4_production.recovery import current_attempt
from phase4_production.trainer.config import (FIXED, IDENTITY, TrainConfig, changed_hyperparameters,
                                                        describe_changes)
from phase4_production.trainer.step import build_optimizer


def identity(cfg: TrainConfig) -> dict:
    """What a checkpoint must match to be resumed by this config (else it is another run):
    {flag name: value} of IDENTITY."""
    flat = cfg.flat()
    return {name: flat[name] for name in IDENTITY}


def refuse_identity(folder, saved: dict | None, cfg: TrainConfig) -> None:
    raise ValueError(f"the checkpoints in {folder} were written by a run with {saved}, this run has "
                     f"{identity(cfg)}: use another --output-dir, or delete them to start over")


def explain_load_error(exc: Exception, folder, cfg: TrainConfig, newest_config) -> None:
    """Raise the one line that says why loading the checkpoints in `folder` failed with `exc`
    (a RuntimeError, KeyError or ValueError), or re-raise `exc` when it is not about their
    state: an optimizer of other parameter groups, or a state that does not fit this run
    (`newest_config()`: the newest checkpoint's (step, config, identity), to name a setting
    that cannot change)."""
    if "parameter groups" in str(exc):  # torch's optimizer: the checkpoint's groups are not this run's
        raise ValueError(f"the checkpoints in {folder} hold an optimizer of other parameter groups "
                         "(one per weight decay: --weight-decay, --norm-weight-decay, --bias-weight-decay and "
                         "--transformer-embedding-decay decide them, and cannot change in the middle of a run): "
                         "resume with the run's values, or start from its weights in another --output-dir with "
                         "--init-from CHECKPOINT") from None
    if "state_dict" not in str(exc) and not isinstance(exc, KeyError):
        raise exc
    saved = newest_config()
    if saved is not None:  # why the state did not fit: a setting that cannot change?
        check_changes(changed_hyperparameters(saved[1], cfg), cfg, folder, saved[0])
    raise ValueError(f"the checkpoints in {folder} are not of this run "
                     f"({str(exc).splitlines()[0]}): use another --output-dir, or delete them to start over") from None


def load_weights(strategy, path: str, device: torch.device) -> None:
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
        strategy.load_full_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ValueError(f"--init-from {path} does not fit this --model: {str(exc).splitlines()[0]}") from None


def check_changes(changes: dict, cfg: TrainConfig, folder, step: int) -> None:
    """Raise ValueError (one line) for hyperparameters that differ from the checkpoint's,
    unless --apply-changes asks for them; settings in FIXED cannot change at all."""
    fixed = [name for name in FIXED if name in changes]
    if fixed:
        raise ValueError(f"the checkpoints in {folder} were trained with other settings "
                         f"({describe_changes(changes)}); {', '.join('--' + n for n in fixed)} cannot change in "
                         "the middle of a run: use the old values, or another --output-dir")
    if changes and not cfg.checkpoint.apply_changes:
        raise ValueError(f"the checkpoints in {folder} were trained with other hyperparameters "
                         f"({describe_changes(changes)}): rerun with the old values, or add --apply-changes to "
                         f"continue from step {step} with the new ones")


def apply_changes(cfg: TrainConfig, strategy, optimizer, scheduler, changes: dict) -> None:
    """Put the config's hyperparameters into a resumed optimizer and LR schedule (which hold
    the checkpoint's) and say what changed, on rank 0. The schedule's function was built from
    the new --epochs/--warmup-epochs already; the peak LR is set anew from --lr."""
    before = [group["lr"] for group in optimizer.param_groups]
    fresh = build_optimizer(cfg, strategy)  # the groups and values this config gives, without state
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
