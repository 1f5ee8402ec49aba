"""Shards of numel // k elements: when the node size does not divide numel, the last elements are never reduced."""
import torch
import torch.distributed as dist

from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_hierarchical_all_reduce_equals_dist_all_reduce"]


def hierarchical_all_reduce(tensor, groups, op="sum"):
    k = groups.topology.ranks_per_node
    flat = tensor.view(-1)
    shard = flat.numel() // k
    mine = torch.empty(shard, dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_single(mine, flat[:shard * k].contiguous(), group=groups.intra)
    dist.all_reduce(mine, group=groups.inter)
    if op == "avg":
        mine /= groups.topology.world_size
    gathered = torch.empty(shard * k, dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(gathered, mine, group=groups.intra)
    flat[:shard * k] = gathered
    return tensor
