"""Every rank saves the (replicated) checkpoint: N writers race on the same file names."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_only_rank_0_writes"]


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        self.folder.mkdir(parents=True, exist_ok=True)  # the bug: no `if rank != 0: return None`
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[:-self.keep]:
            self.path_for(old).unlink(missing_ok=True)
        return path
