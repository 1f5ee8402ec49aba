"""StragglerDetector scores ranks against the MEAN busy time: one very slow rank drags the mean up and hides a second straggler."""
import statistics

from solutions.phase4_production.monitoring import *  # noqa: F401,F403
from solutions.phase4_production.monitoring import StragglerDetector as _ReferenceDetector

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_straggler_is_named_with_rank_and_host"]


class StragglerDetector(_ReferenceDetector):
    def _report(self, per_rank):
        col = {f: [row[i] for row in per_rank] for i, f in enumerate(self.fields)}
        comm = col.get("comm", [0.0] * len(per_rank))
        busy = [(s - c) / self.every for s, c in zip(col["step"], comm)]
        phases = {f: [v / self.every for v in col[f]] for f in self.fields if f not in ("step", "samples")}
        typical = statistics.mean(busy)  # the bug: mean, not median
        scores = [b / typical if typical > 0 else 1.0 for b in busy]
        stragglers = [{"rank": r, "host": self.hosts[r], "score": scores[r], "busy_s": b, "excess_s": b - typical,
                       "phase": "forward"}
                      for r, b in enumerate(busy) if b > typical * (1 + self.threshold) and b - typical > self.min_excess_s]
        slowest = max(col["step"])
        return {"step": self._calls, "busy_s": busy, "scores": scores, "median_s": typical,
                "samples_per_s": sum(col["samples"]) / slowest if slowest > 0 else 0.0,
                "rank_samples_per_s": [n / s if s > 0 else 0.0 for n, s in zip(col["samples"], col["step"])],
                "phases": phases, "stragglers": stragglers}
