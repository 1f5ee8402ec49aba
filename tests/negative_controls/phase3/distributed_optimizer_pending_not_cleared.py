"""synchronize() waits and divides but never clears self._pending: a step() after an explicit synchronize() (Horovod's clipping pattern) waits on and divides the same gradients a second time."""

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_accumulation_matches_one_big_batch"]
EDITS = {
    "DistributedOptimizer.synchronize": [("        self._pending.clear()\n", "")],
}
