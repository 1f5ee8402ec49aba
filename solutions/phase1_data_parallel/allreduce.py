"""Exercise 1.2: all-reduce built from primitives, three ways.

Every function has the contract of `dist.all_reduce(tensor)`: it runs on every rank
of the default process group, and on return `tensor` (modified in place) holds the
element-wise SUM (or AVG) of all ranks' tensors. It also returns `tensor`.

                         messages per rank      time (alpha-beta model, n bytes, p ranks)
  reduce_broadcast       root: 2(p-1)           2(p-1)(alpha + n*beta)     root is the bottleneck
  gather_sum             p-1 in, p-1 out        (p-1)(alpha + n*beta)      memory: p copies
  recursive_doubling     log2(p) exchanges      log2(p)(alpha + n*beta)    best for small n

Production: `dist.all_reduce(tensor, op=dist.ReduceOp.SUM)`; NCCL picks ring or tree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = ("sum", "avg")


def _check(tensor: torch.Tensor, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")


def _finish(tensor: torch.Tensor, op: str) -> torch.Tensor:
    if op == "avg":
        tensor.div_(dist.get_world_size())
    return tensor


def _exchange(tensor: torch.Tensor, peer: int) -> torch.Tensor:
    """Send `tensor` to `peer` and receive the peer's tensor, without deadlocking:
    post the send asynchronously, then block on the receive."""
    received = torch.empty_like(tensor)
    request = dist.isend(tensor, peer)
    dist.recv(received, peer)
    request.wait()
    return received


def allreduce_reduce_broadcast(tensor: torch.Tensor, op: str = "sum", root: int = 0) -> torch.Tensor:
    """Every rank sends its tensor to `root`, which sums them; root broadcasts the sum."""
    _check(tensor, op)
    # EXERCISE 1.2: reduce: root receives from every other rank (dist.recv) and adds; others dist.send to root. Then dist.broadcast from root.
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == root:
        incoming = torch.empty_like(tensor)
        for src in range(world):
            if src != root:
                dist.recv(incoming, src)
                tensor.add_(incoming)
    else:
        dist.send(tensor, root)
    dist.broadcast(tensor, src=root)
    # END EXERCISE
    return _finish(tensor, op)


def allreduce_gather_sum(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Every rank gathers every tensor (dist.all_gather) and sums them locally."""
    _check(tensor, op)
    # EXERCISE 1.2: dist.all_gather into a list of world_size empty_like buffers, then sum them in rank order into tensor (in place)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    tensor.copy_(torch.stack(gathered).sum(dim=0))
    # END EXERCISE
    return _finish(tensor, op)


def allreduce_recursive_doubling(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """log2(p) rounds; in round k rank r exchanges its partial sum with rank r XOR 2^k.

    For p not a power of two, with q the largest power of two <= p and extra = p - q:
    ranks q..p-1 first fold their tensor into rank (r - q), sit out the doubling
    among ranks 0..q-1, and receive the result back at the end.

        p = 6, q = 4:   4 -> 0, 5 -> 1 | 0<->1, 2<->3 | 0<->2, 1<->3 | 0 -> 4, 1 -> 5
    """
    _check(tensor, op)
    # EXERCISE 1.2: fold ranks >= q into rank-q, exchange with rank ^ distance for distance = 1, 2, 4, ... < q (use an isend/recv pair), then send results back to the folded ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    q = 1 << (world.bit_length() - 1)  # largest power of two <= world
    if rank >= q:
        dist.send(tensor, rank - q)
        dist.recv(tensor, rank - q)
        return _finish(tensor, op)
    if rank + q < world:
        incoming = torch.empty_like(tensor)
        dist.recv(incoming, rank + q)
        tensor.add_(incoming)
    distance = 1
    while distance < q:
        tensor.add_(_exchange(tensor, rank ^ distance))
        distance *= 2
    if rank + q < world:
        dist.send(tensor, rank + q)
    # END EXERCISE
    return _finish(tensor, op)


STRATEGIES = {
    "reduce_broadcast": allreduce_reduce_broadcast,
    "gather_sum": allreduce_gather_sum,
    "recursive_doubling": allreduce_recursive_doubling,
}
