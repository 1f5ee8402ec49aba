"""StragglerDetector names a rank when EITHER threshold passes (ratio to the median or absolute excess): on millisecond steps scheduler noise of 2x names ranks, on long steps a 1% wobble of a few hundred ms does."""
import statistics

from solutions.phase4_production.monitoring import *  # noqa: F401,F403
from solutions.phase4_production.monitoring import StragglerDetector as _ReferenceDetector

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_straggler_needs_both_thresholds"]


class StragglerDetector(_ReferenceDetector):
    def _report(self, per_rank: list[list[float]]) -> dict[str, Any]:
        col = {f: [row[i] for row in per_rank] for i, f in enumerate(self.fields)}
        comm = col.get("comm", [0.0] * len(per_rank))
        busy = [(s - c) / self.every for s, c in zip(col["step"], comm)]
        phases = {f: [v / self.every for v in col[f]] for f in self.fields if f not in ("step", "samples")}
        median = statistics.median(busy)
        scores = [b / median if median > 0 else 1.0 for b in busy]
        stragglers = []
        for rank, b in enumerate(busy):
            if b > median * (1 + self.threshold) or b - median > self.min_excess_s:  # the bug: or, not and
                worst = max((f for f in phases if f != "comm"),
                            key=lambda f: phases[f][rank] - statistics.median(phases[f]))
                stragglers.append({"rank": rank, "host": self.hosts[rank], "score": scores[rank],
                                   "busy_s": b, "excess_s": b - median, "phase": worst})
        slowest = max(col["step"])  # the window's wall time: every rank waits for the slowest
        global_rate = sum(col["samples"]) / slowest if slowest > 0 else 0.0
        rank_rates = [n / s if s > 0 else 0.0 for n, s in zip(col["samples"], col["step"])]
        return {"step": self._calls, "busy_s": busy, "scores": scores, "median_s": median,
                "samples_per_s": global_rate, "rank_samples_per_s": rank_rates,
                "phases": phases, "stragglers": stragglers}
