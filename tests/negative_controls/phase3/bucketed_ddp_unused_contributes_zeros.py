"""A parameter that got no gradient in this backward puts zeros into its bucket, discarding the .grad it has accumulated (under no_sync(), or left from the previous step)."""
from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_unused_parameter_contributes_its_accumulated_grad"]


class BucketedDDP(_reference.BucketedDDP):
    def _finish_backward(self):
        for i in self.slots:
            if not self.ready[i]:  # the bug: "no gradient this step" taken as "a zero gradient"
                self.slots[i].zero_()
                self.ready[i] = True
                self.missing[self.bucket_of[i]] -= 1
        super()._finish_backward()
