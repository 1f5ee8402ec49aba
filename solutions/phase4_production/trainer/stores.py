"""Where the trainer's checkpoints live: two stores with one interface (checkpointer.py drives them).

    FileStore   one verified file per step (4.1's CheckpointManager) holding the whole state,
                written by rank 0, in a background thread from a CPU copy or not
                (checkpoint_writer.BackgroundWriter), loaded by 4.2's resume (the step rank 0
                found, on every rank): the store of replicas (--parallel ddp)
    DCPStore    one committed folder per step, every rank writing its own shards through
                torch.distributed.checkpoint (sharded_checkpoint.ShardedCheckpoints),
                synchronously, resharded to the world size on load: the store of a sharded
                model (--parallel fsdp)

Which store a run uses is its parallel strategy's choice (parallel.py: Strategy.store); the
checkpointer never asks which one it has:

    store.save(step, state, progress, began, guard)     collective; the write runs inside guard()
    store.load_latest(state, location, read_only, modules=True) -> progress | None   collective
    store.steps(), store.path_for(step), store.keep      the committed checkpoints, the retention
    store.verify(step) -> [problems]                     what is wrong with one of them (collective
                                                         for the DCP store: each rank its files)
    store.config_before_load() -> (step, config, identity) | None
                                                         the newest checkpoint's config, if the store
                                                         can read it without loading any state
    store.newest_config() -> the same, loading what it must
    store.before_load(read_only), store.after_load(step, read_only)
                                                         what the file store sets aside (entries that
                                                         are no checkpoint; newer ones that failed)
    store.wait(), store.close()                          the write in flight, if any
    store.on_saved(step, stall_s, bytes, write_s)        called for every checkpoint written

`state` is a TrainingState: the model as the step calls it (net) and as it is (module), the
optimizer, LR scheduler and loss scaler, and `modules`: more models checkpointed beside the
model, each under its name (the --model-ema average: "ema"). The file store keeps a module's
weights in the checkpoint's progress under its name (one file holds everything, as earlier
versions wrote it); the DCP store writes them through DCP beside the model's shards.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from solutions.phase4_production.checkpoint import CheckpointManager, CorruptCheckpoint, load_verified, training_state
from solutions.phase4_production.recovery import FaultInjector, current_attempt, resume, set_aside_newer
from solutions.phase4_production.trainer.checkpoint_writer import BackgroundWriter, SaveResult
from solutions.phase4_production.trainer.sharded_checkpoint import ShardedCheckpoints

Saved = Callable[[int, float, int, float], None]  # (step, seconds the loop waited, bytes, seconds the write took)


@dataclass
class TrainingState:
    """What a checkpoint holds besides the progress: the model (as the step calls it, `net`, and
    as it is, `module`), optimizer, LR scheduler, loss scaler, and more models by name."""

    net: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    modules: dict[str, nn.Module] = field(default_factory=dict)


class FileStore:
    """One verified file per step, written by rank 0 (module docstring). `asynchronous`: in a
    background thread from a CPU copy of the state (--async-checkpoint)."""

    def __init__(self, folder: str | Path, keep: int = 3, faults: FaultInjector | None = None,
                 asynchronous: bool = False):
        self.manager = CheckpointManager(folder, keep=keep)
        self.folder, self.keep = self.manager.folder, keep
        self.on_saved: Saved | None = None
        self.writer = BackgroundWriter(self.manager, faults, asynchronous=asynchronous, on_done=self._written)

    def _written(self, result: SaveResult) -> None:
        if result.path is not None and self.on_saved is not None:
            self.on_saved(result.step, result.stall_s, result.path.stat().st_size, result.write_s)

    def steps(self) -> list[int]:
        return self.manager.steps()

    def path_for(self, step: int) -> Path:
        return self.manager.path_for(step)

    @property
    def failed_step(self) -> int | None:
        """The step whose background write failed, once wait() raised its error."""
        return self.writer.failed_step

    def verify(self, step: int) -> list[str]:
        try:
            load_verified(self.path_for(step))
        except (CorruptCheckpoint, OSError) as exc:
            return [str(exc)]
        return []

    def save(self, step: int, state: TrainingState, progress: dict, began: float, guard: Callable) -> None:
        """Rank 0 writes the whole state (every rank's RNG gathered first: collective); the
        modules' weights go into the progress under their names."""
        progress = {**progress, **{name: module.state_dict() for name, module in state.modules.items()}}
        snapshot = training_state(state.net, state.optimizer, state.scheduler, state.scaler, progress)
        with guard():
            self.writer.submit(step, snapshot, began)

    def load_latest(self, state: TrainingState, location: Any, read_only: bool, modules: bool = True) -> dict | None:
        """4.2's resume into the state; the modules' weights out of the progress."""
        progress = resume(self.manager, state.net, state.optimizer, state.scheduler, state.scaler,
                          map_location=location)
        for name, module in state.modules.items():
            weights = progress.pop(name, None) if progress is not None else None
            if weights is not None and modules:
                module.load_state_dict(weights)
        return progress

    def config_before_load(self) -> None:
        """None: a file's config is read by loading the file (see newest_config)."""
        return None

    def newest_config(self) -> tuple[int, dict, dict | None] | None:
        newest = self.manager.load_latest()
        if newest is not None and "config" in newest[1]["progress"]:
            return newest[0], newest[1]["progress"]["config"], newest[1]["progress"].get("identity")
        return None

    def before_load(self, read_only: bool) -> None:
        """Entries named like a checkpoint that are none (folders, unreadable files) set aside."""
        if not read_only:
            _set_aside(self.manager.unusable(), ".unusable", "is not a readable checkpoint file")

    def after_load(self, step: int | None, read_only: bool) -> None:
        """Newer files than the one loaded failed verification: 4.2's set_aside_newer."""
        if not read_only:
            set_aside_newer(self.manager, step)

    def wait(self) -> None:
        self.writer.wait()

    def close(self) -> None:
        self.writer.close()


class DCPStore:
    """One committed folder of shards per step, written by every rank (module docstring)."""

    def __init__(self, folder: str | Path, keep: int = 3, faults: FaultInjector | None = None,
                 asynchronous: bool = False):
        self.sharded = ShardedCheckpoints(folder, keep=keep)  # asynchronous: DCP's shards are written in the step
        self.folder, self.keep, self.faults = self.sharded.folder, keep, faults
        self.on_saved: Saved | None = None
        self.failed_step: int | None = None

    def steps(self) -> list[int]:
        return self.sharded.steps()

    def path_for(self, step: int) -> Path:
        return self.sharded.path_for(step)

    def verify(self, step: int) -> list[str]:
        return self.sharded.verify(step)

    def save(self, step: int, state: TrainingState, progress: dict, began: float, guard: Callable) -> None:
        with guard():
            path = self.sharded.save(step, state.module, state.optimizer, state.scheduler, state.scaler, progress,
                                     self.faults, state.modules)
        if path is not None and self.on_saved is not None:
            seconds = time.perf_counter() - began
            self.on_saved(step, seconds, sum(self.sharded.bytes_of(step).values()), seconds)

    def load_latest(self, state: TrainingState, location: Any, read_only: bool, modules: bool = True) -> dict | None:
        return self.sharded.load_latest(state.module, state.optimizer, state.scheduler, state.scaler,
                                        map_location=location, set_aside=not read_only,
                                        modules=state.modules if modules else None)

    def config_before_load(self) -> tuple[int, dict, dict | None] | None:
        """The newest committed folder's config (its extra file, read without its shards)."""
        for step in reversed(self.sharded.steps()):
            try:
                progress = load_verified(self.path_for(step) / "extra.pt")["progress"]
            except (CorruptCheckpoint, OSError):
                continue  # load_latest sets it aside and reports it
            return (step, progress["config"], progress.get("identity")) if "config" in progress else None
        return None

    newest_config = config_before_load

    def before_load(self, read_only: bool) -> None:
        """Nothing: the sharded store sets aside what fails as it tries it."""

    def after_load(self, step: int | None, read_only: bool) -> None:
        """Nothing (as before_load)."""

    def wait(self) -> None:
        """Nothing in flight: every save is complete when it returns."""

    def close(self) -> None:
        """Nothing in flight (as wait)."""


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
