"""dump() returns the recorder's own entry dicts (a new list, the same entries): a caller that edits the dump, or the next collective completing, changes a record already handed out."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_ring_buffer_keeps_the_newest"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def dump(self):
        return {"rank": self.rank, "world_size": self.world_size, "capacity": self.capacity,
                "groups": [{"ranks": list(ranks), "issued": n} for ranks, n in sorted(self._issued.items())],
                "entries": list(self._entries)}  # the bug: the entries themselves, not copies
