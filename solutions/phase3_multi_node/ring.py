"""Exercise 3.1: ring all-reduce from point-to-point messages.

The p ranks of a group stand in a ring; each talks only to its two neighbours. The
tensor, seen flat, is cut into p chunks, `torch.tensor_split(flat, p)`: the first
numel % p chunks are one element longer, and numel < p leaves some chunks empty.

  ring_reduce_scatter   p-1 steps; in each, a rank sends one chunk to its neighbour and
                        adds the chunk it receives into its own copy. Afterwards group
                        rank r holds chunk r reduced over all ranks (torch's reduce_scatter
                        semantics; the other chunks hold partial sums: unspecified).
  ring_all_gather       p-1 steps; in each, a rank passes on the chunk it got last.
                        Takes chunk r from group rank r; afterwards every rank holds all.
  ring_all_reduce       the two in a row: 2(p-1) steps, each rank sends 2(p-1)/p of the
                        tensor in all, the least any all-reduce can send.

All three work in place on `tensor` and return it; every rank of `group` (default: the
world) calls them with a tensor of the same shape and dtype. Only point-to-point
messages (isend/irecv, send/recv, batch_isend_irecv): no collective of torch.

                  time (alpha-beta model, n bytes, p ranks)
  ring_all_reduce 2(p-1) alpha + 2(p-1)/p n beta     bandwidth-optimal; latency grows with p

Production: `dist.all_reduce(tensor)`; gloo's and NCCL's large-message algorithm is this
ring (NCCL pipelines each chunk in slices over several rings at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = ("sum", "avg")
SEGMENT_BYTES = 16 << 20  # the reference moves a chunk in pieces of at most this (see ring_reduce_scatter)


def _check(tensor: torch.Tensor, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype} (use op='sum')")


def send_recv(to_send: torch.Tensor, dst: int, to_recv: torch.Tensor, src: int, group=None) -> None:
    """Send `to_send` to global rank `dst` while receiving into `to_recv` from global rank `src`.

    Both are posted before either is waited on, so every rank of a ring can call this at
    the same moment without deadlock (a blocking send first would wait for a receive
    that its neighbour has not posted yet). Returns once both have completed.
    """
    ops = [dist.P2POp(dist.isend, to_send, dst, group), dist.P2POp(dist.irecv, to_recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(r, p, previous, next): this rank's rank r in `group`, the group's size p, and the
    GLOBAL ranks of group ranks (r - 1) % p and (r + 1) % p (what send/recv take as peers)."""
    # EXERCISE 3.1: the neighbours: group ranks (r - 1) % p and (r + 1) % p, as global ranks for send/recv; pointer: dist.get_global_rank
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of `group`")
    return rank, size, dist.get_global_rank(group, (rank - 1) % size), dist.get_global_rank(group, (rank + 1) % size)
    # END EXERCISE


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place: afterwards chunk r of `tensor` (flat, tensor_split into p) on group rank r holds
    the SUM (or AVG) over the group of everybody's chunk r. Returns `tensor`."""
    _check(tensor, op)
    if not tensor.is_contiguous():  # the ring works on a flat view; dist.all_reduce accepts these too
        return tensor.copy_(ring_reduce_scatter(tensor.contiguous(), op, group))
    # EXERCISE 3.1: p - 1 steps, each sending a chunk on and adding the one received: group rank r ends with chunk r complete; see send_recv
    rank, size, previous, following = ring_neighbours(group)
    chunks = torch.tensor_split(tensor.view(-1), size)
    # Each chunk travels in the same number of pieces (sender and receiver agree on them),
    # through one buffer of at most SEGMENT_BYTES: bounded memory, and no huge fresh
    # buffer to page in at every call. pieces = 1 is the plain ring.
    pieces = max(1, -(-chunks[0].numel() * tensor.element_size() // SEGMENT_BYTES))
    incoming = torch.empty_like(torch.tensor_split(chunks[0], pieces)[0])  # chunk 0 is the longest
    for step in range(size - 1):
        # rank r sends the chunk whose partial sum it has just completed: at step s, chunk
        # (r - s - 1); it receives chunk (r - s - 2), the one it sends at step s + 1.
        outgoing = torch.tensor_split(chunks[(rank - step - 1) % size], pieces)
        target = torch.tensor_split(chunks[(rank - step - 2) % size], pieces)
        for piece, into in zip(outgoing, target):
            received = incoming[: into.numel()]
            send_recv(piece, following, received, previous, group)
            into.add_(received)
    if op == "avg":
        chunks[rank].div_(size)
    # END EXERCISE
    return tensor


def ring_all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: afterwards every chunk c of `tensor` (flat, tensor_split into p) holds chunk c
    of group rank c's tensor, on every rank. Returns `tensor`."""
    if not tensor.is_contiguous():
        return tensor.copy_(ring_all_gather(tensor.contiguous(), group))
    # EXERCISE 3.1: p - 1 steps, each passing on the chunk you got last (your own first), received right into its place; see ring_neighbours
    rank, size, previous, following = ring_neighbours(group)
    chunks = torch.tensor_split(tensor.view(-1), size)
    for step in range(size - 1):
        send_recv(chunks[(rank - step) % size], following, chunks[(rank - step - 1) % size], previous, group)
    # END EXERCISE
    return tensor


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The contract of `dist.all_reduce(tensor, op, group)` (SUM or AVG), as a ring:
    reduce-scatter, then all-gather. In place; returns `tensor`."""
    _check(tensor, op)
    # EXERCISE 3.1: bitwise the same result on every rank: each chunk is reduced once, by its owner, then copied to the others; see above
    ring_reduce_scatter(tensor, op, group)
    ring_all_gather(tensor, group)
    # END EXERCISE
    return tensor
