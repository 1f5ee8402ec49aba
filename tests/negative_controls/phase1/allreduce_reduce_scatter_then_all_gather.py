"""gather_sum is torch's reduce_scatter_tensor + all_gather_into_tensor: a ring all-reduce made of torch's reducing collective."""
import torch
import torch.distributed as dist

from solutions.phase1_data_parallel import allreduce as _reference
from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403

EXERCISE = "1.2"
CAUGHT_BY = ["test_1_2_strategies_equal_dist_all_reduce"]


def allreduce_gather_sum(tensor, op="sum"):
    _reference._check(tensor, op)
    world = dist.get_world_size()
    flat = tensor.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % world)])
    part = padded.new_empty(padded.numel() // world)
    dist.reduce_scatter_tensor(part, padded)
    dist.all_gather_into_tensor(padded, part)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return _reference._finish(tensor, op)


STRATEGIES = dict(_reference.STRATEGIES, gather_sum=allreduce_gather_sum)
