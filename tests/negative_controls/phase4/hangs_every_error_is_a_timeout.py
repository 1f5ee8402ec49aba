"""Every exception of the collective is reported as CollectiveTimeout: gloo's "invalid root rank" (a bug in the caller, no hang) sends the reader looking for a stuck rank that does not exist."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_collective_errors_propagate_unchanged"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def __call__(self, collective, *args, group=None, **kwargs):
        try:
            super().__call__(collective, *args, group=group, **kwargs)
        except CollectiveTimeout:  # noqa: F405
            raise
        except Exception as exc:  # the bug: whatever failed, call it a timeout
            raise CollectiveTimeout(f"collective {collective.__name__} timed out: {exc}") from exc  # noqa: F405
