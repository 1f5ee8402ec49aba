"""Checkpoints carry no checksum: the newest file that torch.load can read is trusted, so a flipped byte in a tensor is loaded as if it were the saved value."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_corrupt_or_truncated_newest_falls_back"]


def atomic_save(obj, path):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)  # the bug: nothing that lets a reader verify the bytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _reference._fsync_folder(path.parent)


def load_verified(path, map_location="cpu"):
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a file torch.load cannot parse is reported as corrupt, one it can is trusted
        raise CorruptCheckpoint(f"{path}: {type(e).__name__}: {e}") from None


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        if _reference._rank_and_world()[0] != 0:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        return path

    def load_latest(self, map_location="cpu"):
        for step in reversed(self.steps()):
            try:
                return step, load_verified(self.path_for(step), map_location)
            except (CorruptCheckpoint, FileNotFoundError) as e:
                warnings.warn(f"skipping checkpoint {e}", CheckpointWarning, stacklevel=2)
        return None
