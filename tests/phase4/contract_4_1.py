"""Contract of exercise 4.1 (checkpoint.py's docstrings; guidelines 4.1): a complete, atomic, verified checkpoint."""

import torch

from contracts import SIGNATURE_DEFAULT, default, none, raises, when


def _wrapped(m):
    return hasattr(m, "module") and isinstance(getattr(m, "module"), torch.nn.Module)


CONTRACT = {
    "unwrap": [when("DDP", lambda c: isinstance(c.a["model"], torch.nn.parallel.DistributedDataParallel)),
               when("a bare model", lambda c: not _wrapped(c.a["model"])),
               when("another wrapper with .module", lambda c: _wrapped(c.a["model"])
                    and not isinstance(c.a["model"], torch.nn.parallel.DistributedDataParallel))],
    "capture_rng": [when("called", lambda c: True)],
    "restore_rng": [when("called", lambda c: True)],
    "training_state": [
        none("scheduler"), none("scaler"), none("progress"),
        when("a wrapped model (DDP or .module)", lambda c: _wrapped(c.a["model"])),
        when("world > 1 (RNG gathered)", lambda c: c.world > 1),
        when("a GradScaler", lambda c: c.a["scaler"] is not None),
    ],
    "restore_training_state": [
        none("scheduler"), none("scaler"),
        when("a wrapped model", lambda c: _wrapped(c.a["model"])),
        when("at the world size it was saved at", lambda c: len(c.a["state"]["rng"]) == c.world),
        when("at another world size (reseeded, one warning)", lambda c: len(c.a["state"]["rng"]) != c.world),
        when("a progress without 'step'", lambda c: "step" not in (c.a["state"].get("progress") or {})),
    ],
    "atomic_save": [
        when("a str path", lambda c: isinstance(c.a["path"], str)),
        when("a Path", lambda c: not isinstance(c.a["path"], str)),
        when("over an existing file", lambda c: True),
        raises("a write that fails (existing file untouched)", BaseException),
    ],
    "load_verified": [
        default("map_location"),
        raises("a corrupt file (truncated or altered)", Exception, lambda c: type(c.raised).__name__ == "CorruptCheckpoint"),
        when("a str path", lambda c: isinstance(c.a["path"], str)),
    ],
    "CheckpointManager.__init__": [default("keep"), when("keep = 1", lambda c: c.a["keep"] == 1),
                                   when("a folder that does not exist yet", lambda c: True),
                                   when("two managers on one folder", lambda c: c.live > 1)],
    "CheckpointManager.path_for": [when("called", lambda c: True)],
    "CheckpointManager.steps": [when("with unusable entries present", lambda c: bool(c.self.unusable()))],
    "CheckpointManager.unusable": [when("called", lambda c: True)],
    "CheckpointManager.save": [
        when("rank 0 (writes)", lambda c: c.rank == 0), when("rank > 0 (returns None)", lambda c: c.rank > 0),
        when("pruning beyond keep", lambda c: c.count > c.self.keep),
        when("a step older than the newest keep", lambda c: any(p["step"] > c.a["step"] for p in c.previous("save"))),
        when("the same step again", lambda c: any(p["step"] == c.a["step"] for p in c.previous("save"))),
        raises("a save that fails", BaseException),
    ],
    "CheckpointManager.load_latest": [
        default("map_location"),
        when("no checkpoint (None)", lambda c: c.result is None),
        when("a checkpoint found", lambda c: c.result is not None),
    ],
}

IRRELEVANT = {
    "load_verified: map_location left to its default": SIGNATURE_DEFAULT + " ('cpu')",
    "unwrap": "given code (no EXERCISE region): reached through training_state and restore_training_state (wrapped models tested there)",
    "CheckpointManager.__init__": "given code (no EXERCISE region): stores the folder and keep; save's entries cover pruning",
}
