"""save() prunes by file name (every step_*.pt in the folder, sorted), not by steps(): a folder or a dangling link named like a newer checkpoint takes a slot of keep-last-k, and the pruning tries to remove it."""

EXERCISE = "4.1"
CAUGHT_BY = ['test_4_1_pruning_never_touches_what_is_not_a_checkpoint']
EDITS = {
    "CheckpointManager.save": [
        ("        for old in self.steps()[:-self.keep]:\n"
         "            self.path_for(old).unlink(missing_ok=True)\n",
         '        for old in sorted(self.folder.glob("step_*.pt"))[:-self.keep]:\n'
         "            old.unlink(missing_ok=True)\n"),
    ],
}
