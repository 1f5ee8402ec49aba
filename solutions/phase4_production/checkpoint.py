"""4.1 A complete, atomic checkpoint: everything a run needs to continue bit-exactly.

What one checkpoint holds (`training_state`):

    model      the unwrapped module's state_dict (a DDP-saved file loads without DDP)
    optimizer  state_dict (momentum buffers, Adam moments, step counts, param groups)
    scheduler  state_dict of the LR scheduler, or None
    scaler     state_dict of the GradScaler (scale, growth tracker), or None
    progress   the caller's plain dict: step, epoch, data position (world-size free)
    rng        one entry per rank: python, numpy, torch CPU and this rank's CUDA device

On disk a checkpoint is ONE file, `<folder>/step_<step:09d>.pt`: torch.save's bytes
followed by a footer (MAGIC + sha256 of those bytes), so a truncated file or a flipped
byte is detected before torch.load sees it. It is written to a temporary file in the
same folder, flushed and fsynced, renamed over its final name (atomic on POSIX), and
the folder is fsynced so the rename itself survives a power cut; a checkpoint folder
that save() creates has its own entry fsynced in its parent. A file with the final
name is therefore always complete; newest-valid discovery (no `latest` pointer to get
out of step) finds it.

Platforms (guidelines 4.1, "Storage that is not a local POSIX disk"): on macOS fsync
leaves the data in the drive's cache, so `_fsync` asks for F_FULLFSYNC; on Windows a
folder cannot be opened for fsync, so `_fsync_folder` does nothing there (NTFS journals
the rename, but a power cut just after it may undo it). Object stores' FUSE mounts have
no atomic rename (Mountpoint refuses it, so save() raises there) and NFS caches folder
listings on other nodes: read that section before pointing a checkpoint folder at one.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

MAGIC = b"COURSECKPT1"  # footer: MAGIC + 32-byte sha256 digest of everything before it
_FOOTER = len(MAGIC) + 32
_NAME = re.compile(r"^step_(\d{9})\.pt$")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that is truncated, altered or not a checkpoint at all."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt) and an older one used, or resumed at another world size."""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (or any wrapper with `.module`), so names carry no 'module.' prefix."""
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


# ---------------------------------------------------------------- random number generators


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain data: python, numpy, torch CPU, and the current
    CUDA device's once CUDA is initialised in this process (one that never used CUDA has
    drawn nothing from it). Nothing in it is a numpy object (torch.load with weights_only=True
    accepts it)."""
    # EXERCISE 4.1: the state of each generator a step draws from (python, numpy, torch, CUDA), as tensors and plain values; see get_state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state
    # END EXERCISE


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generators `capture_rng` recorded (the inverse of capture_rng)."""
    # EXERCISE 4.1: set each generator back from capture_rng's record; torch.set_rng_state wants a CPU ByteTensor
    random.setstate(_as_python_state(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())  # a CPU ByteTensor, whatever map_location loaded it to
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), torch.cuda.current_device())
    # END EXERCISE


def _as_python_state(s):
    """random.setstate wants tuples; a loaded checkpoint may hold lists."""
    version, internal, gauss = s
    return version, tuple(internal), gauss


# ---------------------------------------------------------------- what goes in a checkpoint


def training_state(model, optimizer, scheduler=None, scaler=None, progress: dict | None = None) -> dict:
    """The complete state of a run, on every rank (collective when a process group exists:
    each rank's RNG is gathered, so call it on every rank at the same step).

    Returns {"model", "optimizer", "scheduler", "scaler", "progress", "rng"} where
    rng[r] is rank r's `capture_rng()` and len(rng) is the world size it was saved at.
    `model` may be wrapped (DDP, or any wrapper that holds the model as `.module`):
    "model" is then the state_dict of the module inside, with no "module." prefix, so
    the checkpoint loads into a bare model (`load_state_dict`, strict) at any world size.
    """
    # EXERCISE 4.1: the six entries of the docstring; rng[r] is rank r's capture_rng() (dist.all_gather_object)
    rank, world = _rank_and_world()
    rngs = [capture_rng()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, capture_rng())
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "progress": dict(progress or {}),
        "rng": rngs,
    }
    # END EXERCISE


def restore_training_state(state: dict, model, optimizer, scheduler=None, scaler=None) -> dict:
    """Load `state` (from training_state) into the given objects and this rank's RNG; returns
    the progress dict. `model` may be bare or wrapped (DDP, `.module`): the state goes into
    the module inside. At another world size than the one saved, the ranks' RNG streams
    cannot continue bit-exactly: each rank then seeds its generators (python, numpy, torch;
    torch.manual_seed seeds every CUDA device too) from (progress["step"], rank) alone (a
    progress without "step" counts as step 0), never from a saved stream handed round, and
    rank 0 warns once (CheckpointWarning)."""
    # EXERCISE 4.1: the inverse of training_state; this rank's RNG entry, never rank 0's for everyone
    rank, world = _rank_and_world()
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    progress = dict(state.get("progress") or {})
    rngs = state["rng"]
    if len(rngs) == world:
        restore_rng(rngs[rank])
    else:
        if rank == 0:
            warnings.warn(f"checkpoint saved at world size {len(rngs)}, resumed at {world}: random streams "
                          "restart from a seed derived from (step, rank)", CheckpointWarning, stacklevel=2)
        seed = 1_000_003 * int(progress.get("step", 0)) + rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    return progress
    # END EXERCISE


# ---------------------------------------------------------------- one file, atomically


class _HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save needs write)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _fsync(fd: int) -> None:
    """Make what the open file `fd` holds durable. os.fsync, except on macOS: there fsync
    only hands the data to the drive, whose volatile cache can still lose it in a power
    cut, and fcntl's F_FULLFSYNC asks the drive to write its cache out too (fsync(2) and
    fcntl(2) of macOS). A file system that refuses F_FULLFSYNC (some network and FUSE
    mounts) gets the plain fsync."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def _fsync_folder(folder: Path) -> None:
    """fsync a folder, so that the entries just added, renamed or removed in it survive a
    power cut. Nothing on Windows: os.open of a folder fails there (PermissionError;
    Python has no way to open a directory handle for FlushFileBuffers), and NTFS journals
    the change of a directory itself, so a rename is never half done, but a power cut just
    after it may bring back the old entry."""
    if sys.platform == "win32":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def _make_folder(folder: Path) -> None:
    """mkdir -p `folder`, durably: the entry of each folder it creates is fsynced in its
    parent, or a power cut can lose a new folder (and the checkpoints renamed into it)
    although every file in it was fsynced."""
    folder = Path(folder)
    if folder.is_dir():
        return
    _make_folder(folder.parent)
    try:
        folder.mkdir()
    except FileExistsError:  # made meanwhile by another process
        if not folder.is_dir():
            raise
    _fsync_folder(folder.parent)


def atomic_save(obj: Any, path: str | Path) -> None:
    """Write obj (torch.save) + footer to `path` so that `path` is never half-written: a
    temporary file in the same folder, flushed and fsynced, renamed, the folder fsynced.
    On any error the temporary file is removed and an existing `path` is untouched."""
    # EXERCISE 4.1: `path` only ever names a complete file: temp in the same folder, body + footer, fsync, os.replace, fsync the folder
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.write(MAGIC + writer.sha.digest())
            f.flush()
            _fsync(f.fileno())  # os.fsync, or F_FULLFSYNC on macOS
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    # END EXERCISE


def _sha256_of(f, n: int, chunk: int = 16 << 20) -> bytes:
    """sha256 of the next n bytes of the binary file f, read in chunks (no copy of the whole file)."""
    sha, buf = hashlib.sha256(), bytearray(min(chunk, max(n, 1)))
    view = memoryview(buf)
    while n:
        got = f.readinto(view[:min(n, len(buf))])
        if not got:
            break
        sha.update(view[:got])
        n -= got
    return sha.digest()


def load_verified(path: str | Path, map_location: Any = "cpu") -> Any:
    """torch.load of a file written by atomic_save, after checking its footer; raises
    CorruptCheckpoint (one line: which file, what is wrong) on a truncated or altered file."""
    # EXERCISE 4.1: check the footer (MAGIC + sha256 of the bytes before it) before torch.load sees the bytes
    path = Path(path)
    with open(path, "rb") as f:  # one open file: what is checked is what is loaded
        size = os.fstat(f.fileno()).st_size
        if size < _FOOTER:
            raise CorruptCheckpoint(f"{path}: {size} bytes, too short for a checkpoint (truncated)")
        digest = _sha256_of(f, size - _FOOTER)
        footer = f.read()
        if not footer.startswith(MAGIC):
            raise CorruptCheckpoint(f"{path}: no checkpoint footer (truncated, or not written by atomic_save)")
        if footer[len(MAGIC):] != digest:
            raise CorruptCheckpoint(f"{path}: checksum mismatch (the file was altered or partly written)")
        f.seek(0)  # torch's zip reader finds its directory from the end and ignores the footer after it
        return torch.load(f, map_location=map_location, weights_only=True)
    # END EXERCISE


# ---------------------------------------------------------------- a folder of checkpoints


def _readable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.R_OK)


class CheckpointManager:
    """Checkpoints of one run in one folder: `save` every N steps, `load_latest` on start.

    Every rank calls save() and load_latest(); only rank 0 (the writer) writes and prunes,
    since the state it writes is replicated (training_state gathers the per-rank part).
    The last `keep` checkpoints stay on disk.
    """

    def __init__(self, folder: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one checkpoint")
        self.folder = Path(folder)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.folder / f"step_{step:09d}.pt"

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present (complete by construction), oldest first.
        Only readable regular files (or links to one) count: whatever else a user, a sync
        tool or another program left under a checkpoint's name is in unusable()."""
        return sorted(step for step, path in self._named() if _readable_file(path))

    def unusable(self) -> list[Path]:
        """Entries named like a checkpoint that steps() leaves out: folders, links to
        nothing, files this process may not read. Never loaded, pruned or overwritten."""
        return [path for _, path in self._named() if not _readable_file(path)]

    def _named(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        return [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]

    def save(self, step: int, state: dict) -> Path | None:
        """Write `state` as the checkpoint of `step` (rank 0 only); prune to the last `keep`
        (checkpoint files only: steps(); a step older than the newest `keep` is written and
        pruned at once). Returns the file's path on the writer, None on the other ranks. Not
        collective: the other ranks return at once, so a reader on another rank must wait for
        the writer (a barrier) before load_latest. A save that fails raises, and leaves every
        existing checkpoint (one of the same step included) as it was. The folder (and any
        missing parent) is created when needed, each new folder's entry fsynced in its
        parent. Temporary files that killed writers left behind are removed (one writer per
        folder, one save at a time: any other temporary file is stale)."""
        # EXERCISE 4.1: rank 0 alone writes (atomic_save) into its folder, made durably when new (_make_folder), then keeps the newest `keep`
        rank, _ = _rank_and_world()
        if rank != 0:
            return None
        _make_folder(self.folder)
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        for stale in self.folder.glob(".step_*.tmp*"):  # ours is renamed already: these are a killed writer's
            stale.unlink(missing_ok=True)
        return path
        # END EXERCISE

    def load_latest(self, map_location: Any = "cpu") -> tuple[int, dict] | None:
        """(step, state) of the newest checkpoint that verifies, or None if there is none.
        A corrupt one, or one removed since the folder was listed, is skipped with one
        CheckpointWarning naming the file."""
        # EXERCISE 4.1: newest first; a file that fails load_verified gets one CheckpointWarning and the next older is tried
        for step in reversed(self.steps()):
            try:
                return step, load_verified(self.path_for(step), map_location)
            except (CorruptCheckpoint, FileNotFoundError) as e:
                warnings.warn(f"skipping checkpoint {e}", CheckpointWarning, stacklevel=2)
        return None
        # END EXERCISE
