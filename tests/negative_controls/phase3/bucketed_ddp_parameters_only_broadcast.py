"""Construction broadcasts the parameters but not the buffers: BatchNorm's running statistics stay different on every rank."""
import torch
import torch.distributed as dist

from solutions.phase3_multi_node import bucketed_ddp as _reference
from solutions.phase3_multi_node.bucketed_ddp import *  # noqa: F401,F403

EXERCISE = "3.2"
CAUGHT_BY = ["test_3_2_broadcast_parameters_and_buffers_at_construction"]


class BucketedDDP(_reference.BucketedDDP):
    def _broadcast_from_rank0(self):
        with torch.no_grad():
            for tensor in self.module.parameters():  # the bug: buffers forgotten
                dist.broadcast(tensor.detach(), group_src=0, group=self.group)
