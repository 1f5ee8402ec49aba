"""The gradient hooks read require_sync (set by no_sync()) at backward time instead of the decision the forward took, unlike torch DDP."""
from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_no_sync_decided_at_forward_like_ddp"]


class BucketedDDP(_reference.BucketedDDP):
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _grad_ready(self, i):
        self.sync_prepared = self.require_sync  # the bug: decided now, in backward
        super()._grad_ready(i)
