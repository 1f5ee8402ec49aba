"""Sequence numbers come from one counter for every group, as if a rank had one stream of collectives: ranks of a subgroup number its collectives after whatever else each of them issued, so the same collective has different numbers on different ranks."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_records_every_collective", "test_4_6_diagnose_the_recorded_hangs"]


class _OneCounter(dict):
    """The recorder's per-group counts, but every group reads and bumps the same number."""

    def get(self, key, default=None):
        return sum(self.values())

    def __setitem__(self, key, value):
        super().__setitem__(key, super().get(key, 0) + 1)


class CollectiveRecorder(_reference.CollectiveRecorder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._issued = _OneCounter()  # the bug: seq = collectives issued on ANY group so far
