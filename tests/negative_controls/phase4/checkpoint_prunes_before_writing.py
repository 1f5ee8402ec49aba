"""save() makes room first (removes all but the newest keep - 1) and then writes: a save that fails in a full folder has already deleted a good checkpoint."""

EXERCISE = "4.1"
CAUGHT_BY = ['test_4_1_failed_save_keeps_previous_checkpoint']
EDITS = {
    "CheckpointManager.save": [
        ("        atomic_save(state, path)\n"
         "        for old in self.steps()[:-self.keep]:\n"
         "            self.path_for(old).unlink(missing_ok=True)\n",
         "        for old in self.steps()[:len(self.steps()) - self.keep + 1]:\n"
         "            self.path_for(old).unlink(missing_ok=True)\n"
         "        atomic_save(state, path)\n"),
    ],
}
