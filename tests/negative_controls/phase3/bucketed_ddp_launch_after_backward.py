"""The gradient hooks only copy into the buckets; every all-reduce is launched by the end-of-backward callback, so communication never overlaps backward."""
from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403
from torch.autograd import Variable

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_all_reduce_launched_during_backward"]


class BucketedDDP(_reference.BucketedDDP):
    def _grad_ready(self, i):
        if not self.sync_prepared or self.ready[i]:
            return
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._mark_ready(i)  # the bug: no launch here; _finish_backward launches them all
