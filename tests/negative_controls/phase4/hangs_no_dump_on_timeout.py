"""A timed-out collective raises CollectiveTimeout but writes no dump: the one moment the record is needed, it stays in the memory of a process about to exit."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_timeout_writes_the_record_first", "test_4_6_collective_errors_propagate_unchanged"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def write_dump(self):
        pass  # the bug: __call__ raises without ever writing dump_path
