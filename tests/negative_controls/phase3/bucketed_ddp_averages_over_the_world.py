"""The bucket average divides by the size of the whole world, whatever `group` the buckets are reduced in:
on a group of 2 ranks in a world of 3, every gradient comes out 2/3 of the mean."""
import torch.distributed as dist

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_subgroup_without_global_rank_0"]


class BucketedDDP(_reference.BucketedDDP):
    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__(module, bucket_cap_mb, group)
        self.world_size = dist.get_world_size()  # the bug: not dist.get_world_size(group)
