"""The entry (and its sequence number) is recorded once the collective has completed: the collective a rank hangs in is never in its record, so every rank's dump ends at the last collective that worked and nobody is seen waiting."""
import datetime

import torch
import torch.distributed as dist

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_timeout_writes_the_record_first", "test_4_6_diagnose_the_recorded_hangs"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def __call__(self, collective, *args, group=None, **kwargs):
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        try:
            collective(*args, group=group, async_op=True, **kwargs).wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as exc:
            self.write_dump()
            if "timed out" in str(exc).lower():
                raise CollectiveTimeout(f"collective {collective.__name__} timed out") from exc
            raise
        seq = self._issued.get(ranks, 0)  # the bug: recorded only after it worked
        self._issued[ranks] = seq + 1
        self._entries.append({"seq": seq, "op": collective.__name__, "group": list(ranks),
                              "shape": None if tensor is None else list(tensor.shape),
                              "dtype": None if tensor is None else str(tensor.dtype).removeprefix("torch."),
                              "state": "completed"})
