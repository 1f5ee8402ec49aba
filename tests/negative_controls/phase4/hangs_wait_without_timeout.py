"""The recorder waits for the collective with no bound of its own (Work.wait() without a timeout), trusting init_process_group's timeout: a skipped collective hangs the ranks until the process group's timeout (30 minutes by default on gloo), not the recorder's few seconds."""

import torch
import torch.distributed as dist

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
WORLD_TIMEOUT = 20  # its worlds need 4-11 s when nothing hangs; the deliberate hang ends after 20 s, not 60
CAUGHT_BY = ["test_4_6_skipped_collective_times_out_instead_of_hanging"]


class CollectiveRecorder(_reference.CollectiveRecorder):
    def __call__(self, collective, *args, group=None, **kwargs):
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        seq = self._issued.get(ranks, 0)
        self._issued[ranks] = seq + 1
        entry = {"seq": seq, "op": collective.__name__, "group": list(ranks),
                 "shape": None if tensor is None else list(tensor.shape),
                 "dtype": None if tensor is None else str(tensor.dtype).removeprefix("torch."), "state": "started"}
        self._entries.append(entry)
        try:
            collective(*args, group=group, async_op=True, **kwargs).wait()  # the bug: no timeout
        except Exception:
            self.write_dump()
            raise
        entry["state"] = "completed"
