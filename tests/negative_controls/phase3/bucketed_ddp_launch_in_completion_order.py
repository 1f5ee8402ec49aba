"""Each bucket is launched the moment it is complete, in whatever order the buckets complete, instead of
strictly in bucket order: where ranks complete them in different orders (a layer unused on one rank), their
all_reduce calls pair buckets of different sizes, and gloo aborts the rank that receives too much."""
import torch.distributed as dist

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_unused_parameter_neither_hangs_nor_breaks_the_average"]


class BucketedDDP(_reference.BucketedDDP):
    def _reset(self):
        super()._reset()
        self.sent = set()

    def _launch_complete_buckets(self):
        for b, missing in enumerate(self.missing):  # the bug: no stop at the first incomplete bucket
            if missing == 0 and b not in self.sent:
                self.sent.add(b)
                self.flats[b].div_(self.world_size)
                self.works.append(dist.all_reduce(self.flats[b], group=self.group, async_op=True))
        self.next_bucket = len(self.sent)
