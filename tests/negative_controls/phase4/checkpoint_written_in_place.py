"""CheckpointManager.save writes straight into the final file name (no temporary file, no rename): a save that fails halfway leaves a broken file under a checkpoint's name."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_failed_save_keeps_previous_checkpoint"]


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        with open(path, "wb") as f:  # the bug: in place
            writer = _reference._HashingWriter(f)
            torch.save(state, writer)
            f.write(MAGIC + writer.sha.digest())
            f.flush()
            os.fsync(f.fileno())
        _reference._fsync_folder(self.folder)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        return path
