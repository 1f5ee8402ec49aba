"""Exercise 1.2: all-reduce built from primitives, three ways.

Every function has the contract of `dist.all_reduce(tensor)`: it runs on every rank
of the default process group, and on return `tensor` (modified in place, in its own
storage: it may be a view into a larger buffer) holds the element-wise SUM (or AVG) of
all ranks' tensors. It also returns `tensor`. ValueError for an op other than "sum" and
"avg", TypeError for "avg" of an integer tensor. Build it
from send/recv/isend/irecv, broadcast and all_gather: no collective of torch that
reduces (all_reduce, reduce, reduce_scatter*), under any name.

                         time (alpha-beta model, n bytes, p ranks; see comm_bench.cost_terms)
  reduce_broadcast       (p-1 + ceil(log2 p))(alpha + n*beta)   p-1 receives in turn at the root,
                                                                then gloo's binomial-tree broadcast
  gather_sum             (p-1)(alpha + n*beta)                  ring all-gather; memory: p copies
  recursive_doubling     log2(p)(alpha + n*beta)                best for small n (+2 steps if p is
                                                                not a power of two)

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
    raise NotImplementedError("TODO 1.2: the root (any rank, not only 0) sums all ranks' tensors via dist.send/recv (recv overwrites), then all get that sum")
    return _finish(tensor, op)


def allreduce_gather_sum(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Every rank gathers every tensor (dist.all_gather) and sums them locally."""
    _check(tensor, op)
    raise NotImplementedError("TODO 1.2: every rank gathers every rank's tensor and sums them into `tensor`, bitwise alike on all ranks; pointer: dist.all_gather")
    return _finish(tensor, op)


def allreduce_recursive_doubling(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """log2(p) rounds; in round k rank r exchanges its partial sum with rank r XOR 2^k.

    For p not a power of two, with q the largest power of two <= p and extra = p - q:
    ranks q..p-1 first fold their tensor into rank (r - q), sit out the doubling
    among ranks 0..q-1, and receive the result back at the end.

        p = 6, q = 4:   4 -> 0, 5 -> 1 | 0<->1, 2<->3 | 0<->2, 1<->3 | 0 -> 4, 1 -> 5
    """
    _check(tensor, op)
    raise NotImplementedError("TODO 1.2: the docstring's schedule (fold, log2(q) pairwise rounds, unfold); pointer: _exchange swaps with a partner safely")
    return _finish(tensor, op)


STRATEGIES = {
    "reduce_broadcast": allreduce_reduce_broadcast,
    "gather_sum": allreduce_gather_sum,
    "recursive_doubling": allreduce_recursive_doubling,
}
