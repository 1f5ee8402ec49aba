"""A straggler's "phase" is its longest phase: where every rank spends most of its step (a slow data loader
everywhere), the report blames that phase instead of the one where the straggler lost its time."""
from solutions.phase4_production.monitoring import *  # noqa: F401,F403
from solutions.phase4_production.monitoring import StragglerDetector as _ReferenceDetector

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_straggler_phase_is_where_it_lost_time"]


class StragglerDetector(_ReferenceDetector):
    def _report(self, per_rank):
        report = super()._report(per_rank)
        for straggler in report["stragglers"]:
            rank = straggler["rank"]
            straggler["phase"] = max((f for f in report["phases"] if f != "comm"),
                                     key=lambda f: report["phases"][f][rank])  # the bug: no median subtracted
        return report
