"""Buckets are all-reduced with SUM and never divided by the world size: gradients are world_size times too large."""
import torch.distributed as dist

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_gradients_equal_torch_ddp", "test_3_2_no_sync_decided_at_forward_like_ddp",
             "test_3_2_unused_parameter_neither_hangs_nor_breaks_the_average"]


class BucketedDDP(_reference.BucketedDDP):
    def _launch_complete_buckets(self):
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            flat = self.flats[self.next_bucket]
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.next_bucket += 1
