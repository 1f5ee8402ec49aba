"""StragglerDetector never resets its sums after a report: every later report mixes in all earlier windows, so a straggler stays named (and a new one shows late) long after the fact."""
from typing import Any

import torch
import torch.distributed as dist

from solutions.phase4_production.monitoring import *  # noqa: F401,F403
from solutions.phase4_production.monitoring import StragglerDetector as _ReferenceDetector

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_straggler_report_covers_its_window_only"]


class StragglerDetector(_ReferenceDetector):
    def update(self, times: dict[str, float]) -> dict[str, Any] | None:
        """Add one step's times; every `every` calls, gather and return the report."""
        self._sums += torch.tensor([float(times.get(f, 0.0)) for f in self.fields], dtype=torch.float64)
        self._calls += 1
        if self._calls % self.every:
            return None
        window = self._sums.to(self.device)  # the bug: the sums are never reset
        gathered = [torch.empty_like(window) for _ in range(self.world_size)]
        dist.all_gather(gathered, window, group=self.group)
        per_rank = torch.stack(gathered).cpu().tolist()  # [world][field], sums over the window
        return self._report(per_rank)
