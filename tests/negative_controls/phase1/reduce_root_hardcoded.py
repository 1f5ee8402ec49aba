"""reduce_broadcast always reduces to rank 0 and broadcasts from it, whatever `root` says (right sum, wrong traffic)."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel import allreduce as _reference
from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403

EXERCISE = "1.2"
CAUGHT_BY = ["test_1_2_reduce_broadcast_honours_the_root"]


def allreduce_reduce_broadcast(tensor, op="sum", root=0):
    _reference._check(tensor, op)
    if dist.get_rank() == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, dist.get_world_size()):
            dist.recv(incoming, src)
            tensor.add_(incoming)
    else:
        dist.send(tensor, 0)
    dist.broadcast(tensor, src=0)
    return _reference._finish(tensor, op)


STRATEGIES = dict(_reference.STRATEGIES, reduce_broadcast=allreduce_reduce_broadcast)
