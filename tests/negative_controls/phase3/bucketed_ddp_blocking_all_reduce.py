"""Each bucket is all-reduced with a blocking call inside the gradient hook: backward stops until the network is done, so nothing overlaps."""
import torch.distributed as dist

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_one_async_all_reduce_per_bucket"]


class BucketedDDP(_reference.BucketedDDP):
    def _launch_complete_buckets(self):
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            flat = self.flats[self.next_bucket]
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)  # the bug: no async_op=True
            self.next_bucket += 1
