"""The dump's per-group "issued" counts the entries still in the ring buffer, not every collective issued: once the buffer wraps, a rank whose entries of a group have all been overwritten looks as if it never started that group's collectives."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_ring_buffer_keeps_the_newest", "test_4_6_diagnose_the_recorded_hangs"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def dump(self):
        d = super().dump()
        for g in d["groups"]:  # the bug: only what the buffer still holds is counted
            g["issued"] = sum(1 for e in d["entries"] if e["group"] == g["ranks"])
        return d
