"""The record stops growing once it holds `capacity` entries: after a long run it holds the first collectives of the job, never the one a rank hangs in."""
from collections import deque

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_ring_buffer_keeps_the_newest", "test_4_6_timeout_writes_the_record_first"]


class _Full(deque):
    def append(self, item):
        if len(self) < self.maxlen:  # the bug: a full buffer drops the NEW entry
            super().append(item)


class CollectiveRecorder(_reference.CollectiveRecorder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._entries = _Full(maxlen=self.capacity)
