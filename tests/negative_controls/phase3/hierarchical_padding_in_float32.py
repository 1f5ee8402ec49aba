"""The padded buffer and the shard are allocated with torch.zeros/empty's default dtype (float32), whatever the tensor's: int64 values beyond 2**24 and float64 values come back rounded, complex ones lose their imaginary part."""
import math

import torch
import torch.distributed as dist

from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_hierarchical_all_reduce_equals_dist_all_reduce"]


def hierarchical_all_reduce(tensor, groups, op="sum"):
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    k, numel = groups.topology.ranks_per_node, tensor.numel()
    shard = math.ceil(numel / k)
    padded = torch.zeros(shard * k, device=tensor.device)  # the bug: no dtype=tensor.dtype
    padded[:numel] = tensor.reshape(-1)
    mine = torch.empty(shard, device=tensor.device)
    dist.reduce_scatter_single(mine, padded, group=groups.intra)
    dist.all_reduce(mine, group=groups.inter)
    if op == "avg":
        mine /= groups.topology.world_size
    dist.all_gather_single(padded, mine, group=groups.intra)
    tensor.copy_(padded[:numel].view(tensor.shape))
    return tensor
