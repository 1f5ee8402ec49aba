"""The trainer's checkpoints: one interface, built once with every stateful part of the run.

    checkpointer = Checkpointer(store, state, parts, cfg, strategy, flight, report, others)
    progress = checkpointer.load_latest()    # collective: the newest checkpoint that verifies, into
                                             # every part; its progress, or None (a fresh start)
    checkpointer.save(step)                  # collective: every part's state at this step boundary
    checkpointer.verify(step)                # what is wrong with the checkpoint of `step` ([]: nothing)
    checkpointer.keep                        # retention: the store keeps the newest `keep`
    checkpointer.wait(step)                  # the write in flight is on disk (at a stop, at the end)
    checkpointer.finish(step)                # after a stop's save: on disk, and every rank knows it
    with checkpointer: ...                   # on the way out, also after an error: no write left behind

What a checkpoint holds:

    state     TrainingState (stores.py): the model, optimizer, LR scheduler, loss scaler, and more
              models by name (the --model-ema average), in the store's format
    progress  "step"; each part's entries: the data position ("data", data.Inputs), the
              evaluations' history ("history", evaluator.Evaluator), the EMA's count
              ("ema_updates", ema.WeightsEMA); the run's identity and its config (flat,
              config.TrainConfig.flat); every rank's RNG (4.1's training_state)

A part is anything with progress() -> dict (its entries) and restore(progress); a new stateful
feature registers one (build.py) and nothing here changes. The store is the parallel
strategy's (FileStore for replicas, DCPStore for shards: stores.py); nothing here depends on
which. On load, before any state is read: a folder holding only another layout's checkpoints
is refused in one line; where the store can read the newest config without the state (DCP),
its identity and hyperparameters are checked first; then the state is loaded, and the same
checks run on what was loaded: another run's checkpoints are refused, changed hyperparameters
refused or applied (--apply-changes), and the file store sets aside what failed (stores.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist

from phase4_production.trainer.config import TrainConfig, changed_hyperparameters
from phase4_production.trainer.flight import FlightRecord
from phase4_production.trainer.lifecycle import orphaned
from phase4_production.trainer.resume import (apply_changes, check_changes, explain_load_error, identity,
                                                        refuse_identity)
from phase4_production.trainer.run_folder import why_unwritable
from phase4_production.trainer.step import NonFiniteLoss
from phase4_production.trainer.stores import TrainingState


class OutputNotWritable(ValueError):
    """The output folder cannot take a checkpoint (full, read-only, ...): no restart fixes it."""


class Checkpointer:
    """The run's checkpoints (module docstring). `parts`: {name: part} in the order their
    entries go into the progress; `others`: {layout: store} of the layouts whose checkpoints
    this store cannot read (parallel.other_stores); `report`: told of every checkpoint written."""

    SAVING = "the checkpoint's RNG gather"

    def __init__(self, store, state: TrainingState, parts: dict[str, Any], cfg: TrainConfig, strategy,
                 flight: FlightRecord, report, others: dict[str, Any], location: Any = None):
        self.store, self.state, self.parts, self.cfg = store, state, parts, cfg
        self.strategy, self.flight, self.others, self.location = strategy, flight, others, location
        self.folder: Path = store.folder
        self.identity, self.config = identity(cfg), cfg.flat()
        store.on_saved = report.checkpoint

    @property
    def keep(self) -> int:
        return self.store.keep

    def steps(self) -> list[int]:
        return self.store.steps()

    def path_for(self, step: int) -> Path:
        return self.store.path_for(step)

    def verify(self, step: int) -> list[str]:
        return self.store.verify(step)

    # ------------------------------------------------------------ save

    def save(self, step: int) -> None:
        """Collective: the state after `step` steps. Never a state with weights that are not
        finite (NonFiniteLoss: the newest checkpoint stays the last good one); nothing written
        once the launcher is gone (its SIGKILL is on the way); a write that fails for want of
        space or permission is one line (OutputNotWritable)."""
        with self.flight.waiting(self.SAVING):
            if not self.strategy.weights_finite():  # the same answer on every rank
                raise NonFiniteLoss(f"the weights became NaN or infinite at step {step} (another rank's loss did); "
                                    f"not saved: the newest checkpoint in {self.folder} is the last good state")
            if orphaned():  # the launcher died a moment ago: its SIGKILL is on the way, write nothing
                os.kill(os.getpid(), signal.SIGKILL)
            began = time.perf_counter()
            progress = {"step": step}
            for part in self.parts.values():
                progress.update(part.progress())
            progress.update(identity=self.identity, config=self.config)
            self.strategy.sync_buffers()  # one value per replicated buffer, whichever rank a sharded store takes
            self.store.save(step, self.state, progress, began, lambda: self._write_errors(step))

    @contextlib.contextmanager
    def _write_errors(self, step: int) -> Iterator[None]:
        """An OSError or RuntimeError of a write that the folder explains (full, read-only):
        one line naming the step and the folder."""
        try:
            yield
        except (OSError, RuntimeError) as exc:
            rank = dist.get_rank() if dist.is_initialized() else 0
            why = why_unwritable(self.folder, exc) if rank == 0 else None
            if why is None:
                raise
            failed = self.store.failed_step if self.store.failed_step is not None else step
            raise OutputNotWritable(f"cannot write the checkpoint of step {failed} in {self.folder}: {why}; "
                                    "free space or use another --output-dir (the newest complete checkpoint is "
                                    "kept)") from None

    def wait(self, step: int) -> None:
        """The write in flight, if any, is on disk (its error raised, in one line if it is one)."""
        with self._write_errors(step):
            self.store.wait()

    def finish(self, step: int) -> None:
        """After a stop's save: on disk, and every rank past the point where it is (the
        checkpoint is complete before anyone says so)."""
        self.wait(step)
        if dist.is_initialized() and dist.get_world_size() > 1:
            with self.flight.waiting("the barrier after the stop's checkpoint"):
                self.flight.issue(dist.barrier)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.store.close()

    # ------------------------------------------------------------ load

    def load_latest(self, read_only: bool = False, modules: bool = True) -> dict | None:
        """Collective: the newest checkpoint that verifies, loaded into the state and every part
        (module docstring); its progress, or None when there is none (nothing changed).
        read_only: nothing is set aside (--evaluate, --export); modules=False leaves the extra
        models (--export needs the model's weights only)."""
        self._refuse_other_layouts()
        self.store.before_load(read_only)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                saved = self.store.config_before_load()  # checked before any state is read into the model
                if saved is not None and saved[2] != self.identity:
                    refuse_identity(self.folder, saved[2], self.cfg)
                if saved is not None:
                    check_changes(changed_hyperparameters(saved[1], self.cfg), self.cfg, self.folder, saved[0])
                progress = self.store.load_latest(self.state, self.location, read_only, modules)
        except (RuntimeError, KeyError, ValueError) as exc:
            explain_load_error(exc, self.folder, self.cfg, self.store.newest_config)
        if progress is not None and progress.get("identity") != self.identity:
            refuse_identity(self.folder, progress.get("identity"), self.cfg)
        self.store.after_load(int(progress["step"]) if progress else None, read_only)
        changes = changed_hyperparameters(progress["config"], self.cfg) if progress and "config" in progress else {}
        if changes:
            check_changes(changes, self.cfg, self.folder, progress["step"])
            apply_changes(self.cfg, self.strategy, self.state.optimizer, self.state.scheduler, changes)
        if progress is not None:
            for part in self.parts.values():
                part.restore(progress)
        return progress

    def _refuse_other_layouts(self) -> None:
        """ValueError (one line) when the folder holds only checkpoints of another --parallel
        (ddp writes one file per step, step_N.pt; fsdp a folder of shards, step_N/)."""
        if self.store.steps():
            return
        for was, store in self.others.items():
            if store.steps():
                now = self.cfg.parallel.layout
                raise ValueError(f"the checkpoints in {self.folder} were written with --parallel {was}, this run "
                                 f"uses --parallel {now}: resume with --parallel {was}, or write the weights with "
                                 f"--parallel {was} --export FILE and start a new run (another --output-dir) with "
                                 "--init-from FILE")
