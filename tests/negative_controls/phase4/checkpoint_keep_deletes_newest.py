"""CheckpointManager.save prunes with steps()[keep:] instead of steps()[:-keep]: it keeps the oldest k and deletes the one it just wrote."""
from solutions.phase4_production import checkpoint as _reference
from solutions.phase4_production.checkpoint import *  # noqa: F401,F403

EXERCISE = "4.1"
CAUGHT_BY = ["test_4_1_keeps_the_last_k"]


class CheckpointManager(_reference.CheckpointManager):
    def save(self, step, state):
        if _reference._rank_and_world()[0] != 0:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_for(step)
        atomic_save(state, path)
        for old in self.steps()[self.keep:]:  # the bug
            self.path_for(old).unlink(missing_ok=True)
        return path
