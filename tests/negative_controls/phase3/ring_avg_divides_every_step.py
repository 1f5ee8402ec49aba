"""op="avg" divides by p after every addition instead of once at the end: right for 2 ranks (one step),
wrong from 3 on, where the first ranks' contributions are divided more than once."""
import torch

from solutions.phase3_multi_node import ring as _reference
from solutions.phase3_multi_node.ring import *  # noqa: F401,F403
from solutions.phase3_multi_node.ring import ring_all_gather, ring_neighbours, send_recv

EXERCISE = "3.1"
CAUGHT_BY = ["test_3_1_ring_all_reduce_equals_dist_all_reduce", "test_3_1_reduce_scatter_and_all_gather_alone"]


def ring_reduce_scatter(tensor, op="sum", group=None):
    _reference._check(tensor, op)
    rank, size, previous, following = ring_neighbours(group)
    chunks = torch.tensor_split(tensor.view(-1), size)
    incoming = torch.empty_like(chunks[0])
    for step in range(size - 1):
        target = chunks[(rank - step - 2) % size]
        received = incoming[: target.numel()]
        send_recv(chunks[(rank - step - 1) % size], following, received, previous, group)
        target.add_(received)
        if op == "avg":
            target.div_(size)
    return tensor


def ring_all_reduce(tensor, op="sum", group=None):
    _reference._check(tensor, op)
    ring_reduce_scatter(tensor, op, group)
    ring_all_gather(tensor, group)
    return tensor
