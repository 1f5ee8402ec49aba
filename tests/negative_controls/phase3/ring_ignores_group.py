"""The ring is laid out over the whole world whatever `group` says (dist.get_rank() and dist.get_world_size(),
messages on the default group): on a subgroup it reduces over every rank of the world."""
import torch
import torch.distributed as dist

from solutions.phase3_multi_node import ring as _reference
from solutions.phase3_multi_node.ring import *  # noqa: F401,F403
from solutions.phase3_multi_node.ring import send_recv

EXERCISE = "3.1"
CAUGHT_BY = ["test_3_1_subgroups"]


def ring_neighbours(group=None):
    rank, size = dist.get_rank(), dist.get_world_size()
    return rank, size, (rank - 1) % size, (rank + 1) % size


def ring_reduce_scatter(tensor, op="sum", group=None):
    _reference._check(tensor, op)
    rank, size, previous, following = ring_neighbours(group)
    chunks = torch.tensor_split(tensor.view(-1), size)
    incoming = torch.empty_like(chunks[0])
    for step in range(size - 1):
        target = chunks[(rank - step - 2) % size]
        received = incoming[: target.numel()]
        send_recv(chunks[(rank - step - 1) % size], following, received, previous)
        target.add_(received)
    if op == "avg":
        chunks[rank].div_(size)
    return tensor


def ring_all_gather(tensor, group=None):
    rank, size, previous, following = ring_neighbours(group)
    chunks = torch.tensor_split(tensor.view(-1), size)
    for step in range(size - 1):
        send_recv(chunks[(rank - step) % size], following, chunks[(rank - step - 1) % size], previous)
    return tensor


def ring_all_reduce(tensor, op="sum", group=None):
    _reference._check(tensor, op)
    ring_reduce_scatter(tensor, op, group)
    ring_all_gather(tensor, group)
    return tensor
