"""All-gather passes the whole tensor at every step and copies out the one chunk it needs: right values,
but each rank sends (p - 1) x the tensor in the all-gather instead of (p - 1)/p of it."""
import torch

from solutions.phase3_multi_node import ring as _reference
from solutions.phase3_multi_node.ring import *  # noqa: F401,F403
from solutions.phase3_multi_node.ring import ring_neighbours, ring_reduce_scatter, send_recv

EXERCISE = "3.1"
CAUGHT_BY = ["test_3_1_each_rank_sends_what_a_ring_must_send"]


def ring_all_gather(tensor, group=None):
    rank, size, previous, following = ring_neighbours(group)
    flat = tensor.view(-1)
    incoming = torch.empty_like(flat)
    for step in range(size - 1):
        send_recv(flat, following, incoming, previous, group)
        wanted = (rank - step - 1) % size
        torch.tensor_split(flat, size)[wanted].copy_(torch.tensor_split(incoming, size)[wanted])
    return tensor


def ring_all_reduce(tensor, op="sum", group=None):
    _reference._check(tensor, op)
    ring_reduce_scatter(tensor, op, group)
    ring_all_gather(tensor, group)
    return tensor
