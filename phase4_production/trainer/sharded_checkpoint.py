"""Sharded checkpoints (--parallel fsdp): every rank writes its own shards, through
torch.distributed.checkpoint (DCP), with the promises of 4.1: complete, atomic, verified.

    store = ShardedCheckpoints(folder, keep=3)
    store.save(step, model, optimizer, scheduler, scaler, progress)   # collective
    progress = store.load_latest(model, optimizer, scheduler, scaler) # collective; None: none

One checkpoint is one folder, `<folder>/step_<step:09d>/`:

    __<rank>_<i>.distcp   the shards each rank wrote (DCP's FileSystemWriter): its slices of the
                          model's and the optimizer's DTensors; a replicated tensor (a BatchNorm
                          buffer, a step count) is written once, by one rank
    .metadata             DCP's index: which slice of which tensor lies in which file, where
    extra.pt              rank 0 (4.1's atomic_save): LR scheduler, loss scaler, progress (step,
                          data position, history, config) and EVERY rank's RNG (training_state)
    COMMITTED             written last: each file's size and sha256, as JSON

Saving (collective):

    rank 0: a fresh .step_<step>.tmp/     every rank: dcp.save into it, each its own shards
    (dcp.save returns everywhere once .metadata is written, after every rank's files, each fsynced)
    rank 0: extra.pt     every rank: sha256 of its share of the files (files[rank::world])
    rank 0: COMMITTED (temp + fsync + rename), fsync the folder, rename .step_<step>.tmp ->
            step_<step> (atomic on POSIX), fsync the parent; prune to the newest `keep`

A folder under a final name was renamed there only after every byte of it was written and
hashed, so it is complete; a kill at any moment leaves a .tmp folder that nobody loads (the
next save removes it). Why a fresh folder per step rather than saving into one folder:
DCP's .metadata marks a save as finished only in a folder that did not hold an older save
(a re-save overwrites file by file); torchtitan, too, writes one folder per step.

Loading (collective): rank 0 lists the committed steps (one listing for all ranks: a shared
file system may show the ranks different listings) and broadcasts them; newest first, every
rank checks its share of the files against COMMITTED, and a folder that fails anywhere is
set aside (renamed `.corrupt`, one warning) and the next older one tried. DCP then loads each
rank's slices into the model's and optimizer's current DTensors, at whatever world size the
run has now: a checkpoint of 2 ranks resumes on 1 or 3, resharded (4.3).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phase4_production.checkpoint import (_fsync, _fsync_folder, _make_folder, atomic_save,
                                                    load_verified, restore_training_state, training_state)
from phase4_production.recovery import CORRUPT_SUFFIX, FaultInjector

COMMIT = "COMMITTED"
EXTRA = "extra.pt"
_NAME = re.compile(r"^step_(\d{9})$")


class _NoState:
    """Stands for the model and the optimizer in 4.1's training_state: their state is in the
    DCP files, so the extra file holds everything else."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _module_states(modules: dict[str, torch.nn.Module] | None) -> dict[str, dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {name: get_model_state_dict(module) for name, module in (modules or {}).items()}


def _load_module_states(modules: dict[str, torch.nn.Module] | None, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    for name, module in (modules or {}).items():
        set_model_state_dict(module, state[name])


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            sha.update(chunk)
    return sha.hexdigest()


class ShardedCheckpoints:
    """Committed checkpoint folders of one run; keep the newest `keep`."""

    def __init__(self, folder: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint")
        self.folder, self.keep = Path(folder), keep

    def path_for(self, step: int) -> Path:
        return self.folder / f"step_{step:09d}"

    def steps(self) -> list[int]:
        """Steps of the committed folders present, oldest first (this process's listing)."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir()
                      if (m := _NAME.match(p.name)) and (p / COMMIT).is_file())

    def bytes_of(self, step: int) -> dict[str, int]:
        """Each file's size in the checkpoint of `step`, as COMMITTED lists it."""
        manifest = json.loads((self.path_for(step) / COMMIT).read_text())
        return {name: size for name, (size, _) in manifest["files"].items()}

    # ------------------------------------------------------------ save

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None,
             scaler=None, progress: dict | None = None, faults: FaultInjector | None = None,
             modules: dict[str, torch.nn.Module] | None = None) -> Path | None:
        """Write the checkpoint of `step` (see the module docstring). Collective: every rank
        calls it at the same step. Returns the committed folder on rank 0, None elsewhere.
        `modules`: more sharded models saved beside the model, each under its name (the
        trainer's --model-ema average: "ema").
        A "save" fault of the injector fires on its rank as the writing begins: the other ranks'
        collectives then fail, and nothing is committed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rank, world = _rank_world()
        final = self.path_for(step)
        tmp = self.folder / f".{final.name}.tmp"
        if rank == 0:
            _make_folder(self.folder)
            for stale in self.folder.glob(".step_*.tmp"):  # left by a run killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        extra = training_state(_NoState(), _NoState(), scheduler, scaler, progress)  # every rank's RNG
        model_state, optim_state = get_state_dict(model, optimizer)
        if faults is not None:
            faults.point("save")  # a kill here: the others fail in dcp.save's collectives, nothing is committed
        state = {"model": model_state, "optimizer": optim_state, **_module_states(modules)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
        if rank == 0:
            atomic_save({k: v for k, v in extra.items() if k not in ("model", "optimizer")}, tmp / EXTRA)
        _barrier()
        # the files that .metadata on disk names (what a load reads), not dcp.save's return value:
        # torch 2.11's FileSystemWriter.finish records them on a copy, and returns none
        metadata = dcp.FileSystemReader(str(tmp)).read_metadata()
        names = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata", EXTRA})
        mine = {name: (os.path.getsize(tmp / name), _sha256(tmp / name)) for name in names[rank::world]}
        files = {name: entry for share in _gather(mine) for name, entry in share.items()}
        if rank != 0:
            return None
        self._commit(tmp, final, {"step": step, "world_size": world, "files": files})
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.path_for(old), ignore_errors=True)
        return final

    def _commit(self, tmp: Path, final: Path, manifest: dict) -> None:
        marker = tmp / f".{COMMIT}.tmp"
        with open(marker, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            _fsync(f.fileno())
        os.replace(marker, tmp / COMMIT)
        _fsync_folder(tmp)
        replaced = None
        if final.exists():  # the same step saved again (e.g. after --apply-changes): the new one wins
            replaced = final.with_name(f".{final.name}.replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync_folder(self.folder)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    # ------------------------------------------------------------ load

    def verify(self, step: int) -> list[str]:
        """Collective: what is wrong with the checkpoint of `step` (empty: nothing), every rank
        checking its share of the files against COMMITTED."""
        folder = self.path_for(step)
        rank, world = _rank_world()
        try:
            manifest = json.loads((folder / COMMIT).read_text()) if rank == 0 else None
        except (OSError, ValueError) as exc:
            manifest = {"error": f"{COMMIT} unreadable ({exc})"}
        manifest = _broadcast(manifest)
        if "error" in manifest:
            return [manifest["error"]]
        problems = []
        for name in sorted(manifest["files"])[rank::world]:
            size, digest = manifest["files"][name]
            path = folder / name
            if not path.is_file():
                problems.append(f"{name} is missing")
            elif os.path.getsize(path) != size:
                problems.append(f"{name} has {os.path.getsize(path)} bytes, {size} were written")
            elif _sha256(path) != digest:
                problems.append(f"{name} does not match its checksum (altered or partly written)")
        return [p for share in _gather(problems) for p in share]

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, scaler=None,
                    map_location: Any = "cpu", set_aside: bool = True,
                    modules: dict[str, torch.nn.Module] | None = None) -> dict | None:
        """Load the newest checkpoint that verifies into model, optimizer, scheduler, scaler and
        this rank's RNG, resharded to this world; return its progress (None: no checkpoint,
        nothing changed). Collective. A folder that fails verification is set aside (renamed
        on rank 0, one warning), or with set_aside=False only reported (read-only uses).
        `modules`: the models save() wrote beside the model, loaded too."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        for step in _broadcast(list(reversed(self.steps()))):
            problems = self.verify(step)
            if problems:
                self._set_aside(step, "; ".join(problems[:3]), rename=set_aside)
                continue
            folder = self.path_for(step)
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state, **_module_states(modules)}
            dcp.load(state, checkpoint_id=str(folder))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            _load_module_states(modules, state)
            extra = load_verified(folder / EXTRA, map_location=map_location)
            return restore_training_state({**extra, "model": {}, "optimizer": {}}, _NoState(), _NoState(),
                                          scheduler, scaler)
        return None

    def _set_aside(self, step: int, why: str, rename: bool = True) -> None:
        if _rank_world()[0] != 0:
            return
        path = self.path_for(step)
        if not rename:
            print(f"warning: checkpoint {path} failed verification ({why}): trying an older one", file=sys.stderr,
                  flush=True)
            return
        target, n = path.with_name(path.name + CORRUPT_SUFFIX), 1
        while target.exists():  # an earlier run set aside a folder of the same step
            target, n = path.with_name(f"{path.name}{CORRUPT_SUFFIX}.{n}"), n + 1
        os.replace(path, target)
        print(f"warning: checkpoint {path} failed verification ({why}): set aside as {target.name} "
              "(delete it when done); trying an older one", file=sys.stderr, flush=True)
