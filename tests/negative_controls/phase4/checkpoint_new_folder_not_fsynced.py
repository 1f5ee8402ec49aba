"""save() creates its folder with a plain mkdir -p and never fsyncs the parent: a power cut can lose the new folder and the checkpoint inside it."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_new_folder_fsynced_in_its_parent"]


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        rank, _ = _reference._rank_and_world()
        if rank != 0:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)  # the bug: the new folders' entries are not fsynced
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        return path
