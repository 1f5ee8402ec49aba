"""Exercise 3.3: topology-aware (hierarchical) all-reduce.

A cluster is N nodes of k ranks each (world p = N * k), numbered node-major, as torchrun
numbers them when every node runs the same --nproc-per-node:

    rank = node_rank * k + local_rank

Links inside a node (NVLink, shared memory) are 10-100x faster than links between nodes
(a network). A hierarchical all-reduce of a tensor of S bytes sends as little as it can
over the slow links, and sends it from every rank at once (each GPU has its own NIC):

    node 0: ranks 0 1 2 3        1. reduce-scatter inside each node: local rank l ends
    node 1: ranks 4 5 6 7           with shard l of its node's sum (S/k bytes)
                                 2. all-reduce shard l across nodes, among the ranks
             intra groups:          with local rank l: {0, 4}, {1, 5}, {2, 6}, {3, 7}
             {0,1,2,3} {4,5,6,7} 3. all-gather the shards inside each node

Each rank sends 2(N-1)/N * S/k bytes across nodes; a flat ring over all p ranks sends,
per rank on average, 2(p-1)/p * S/k (only 1 hop in k crosses a node), but all of it
through one link per node and with 2(p-1) network latencies (guidelines 3.3).

Run the demo: `torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo -m solutions.phase3_multi_node.hierarchical`
on each of two terminals, or `python -m solutions.phase3_multi_node.hierarchical`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: world = num_nodes * ranks_per_node ranks, node-major
    (rank = node_rank * ranks_per_node + local_rank)."""

    rank: int
    node_rank: int  # which node, 0 .. num_nodes - 1 (torchrun: GROUP_RANK)
    local_rank: int  # which rank inside its node, 0 .. ranks_per_node - 1 (torchrun: LOCAL_RANK)
    num_nodes: int
    ranks_per_node: int  # torchrun: LOCAL_WORLD_SIZE

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node


@dataclass(frozen=True)
class NodeGroups:
    """This rank's two process groups."""

    topology: Topology
    intra: dist.ProcessGroup  # the ranks of this rank's node, in rank order
    inter: dist.ProcessGroup  # one rank per node: those with this rank's local rank, in rank order


@dataclass(frozen=True)
class Link:
    """One rank's link of a kind: a message of b bytes takes alpha + b / bandwidth seconds."""

    alpha: float  # seconds per message (latency)
    bandwidth: float  # bytes per second (for inter-node links: one NIC's)


def topology_from_env(ranks_per_node: int | None = None) -> Topology:
    """This rank's Topology, from the launch environment.

    RANK and WORLD_SIZE give the rank and the world (torchrun and common.launch.run_world
    both set them). With `ranks_per_node` (run_world, which starts one "node"), nodes are
    consecutive blocks of that many ranks; without it, the node comes from torchrun's
    GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE. Raises ValueError when the world does
    not split into equal nodes, or the variables contradict the node-major numbering.
    Not collective: reads the environment only.
    """
    raise NotImplementedError("TODO 3.3: this rank's Topology from the launch environment, as the docstring says")


def build_groups(topology: Topology) -> NodeGroups:
    """Create the intra-node group of every node and the inter-node group of every local
    rank; return this rank's two. Collective: every rank of the world calls it, with the
    same topology shape."""
    raise NotImplementedError('TODO 3.3: every rank creates every group, in the same order, even those it is not in (guidelines 3.3)')


def hierarchical_all_reduce(tensor: torch.Tensor, groups: NodeGroups, op: str = "sum") -> torch.Tensor:
    """All-reduce `tensor` in place over the world and return it: equal to
    dist.all_reduce (op "sum"), or to it divided by the world size (op "avg", floating
    dtypes). Any shape, numel (it need not divide by the node size) and dtype the backend
    reduces (gloo in torch 2.14.1 refuses int16 and the float8 types, in dist.all_reduce
    too), on the tensor's device. Only collectives on groups.intra and groups.inter; across nodes, only
    the shard of S/ranks_per_node elements this rank owns after the intra-node step.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating dtype, got {tensor.dtype} (use op='sum')")  # as 3.1's ring
    raise NotImplementedError('TODO 3.3: reduce-scatter in the node, all-reduce your shard across nodes, all-gather in the node (pad to a multiple of node size)')


def cross_node_bytes(nbytes: float, num_nodes: int, ranks_per_node: int) -> dict[str, float]:
    """Bytes one rank sends across node boundaries to all-reduce a tensor of `nbytes` bytes
    with ring algorithms: {"flat_ring": averaged over the ranks of a ring over all ranks in
    rank order, "hierarchical": every rank's (exactly divisible sizes)}."""
    raise NotImplementedError("TODO 3.3: derive both (what fraction of a flat ring's hops leaves a node?); guidelines 3.3")


def predict_seconds(nbytes: float, num_nodes: int, ranks_per_node: int, intra: Link, inter: Link,
                    nics_per_node: int | None = None) -> dict[str, float]:
    """Predicted all-reduce time of `nbytes` bytes on num_nodes x ranks_per_node ranks,
    {"flat_ring", "hierarchical"}, with ring algorithms and the alpha-beta model:

      * a ring step lasts as long as its slowest hop; a flat ring in rank order has
        2(p-1) steps of nbytes/p, and when num_nodes > 1 some hop of every step crosses
        nodes, through one rank's NIC. Its other hops stay inside a node (intra links;
        none when ranks_per_node == 1), and whichever kind is slower sets the step: a
        node's own links may be the slow ones;
      * hierarchical: reduce-scatter and all-gather inside nodes (k-1 steps of nbytes/k
        each, intra links), then a ring all-reduce of nbytes/k across nodes (2(N-1)
        steps of nbytes/(k N)) run by all k ranks of a node at once: they share
        `nics_per_node` NICs (None: one per rank), each rank getting
        inter.bandwidth * min(1, nics_per_node / k).
    """
    raise NotImplementedError('TODO 3.3: the alpha-beta time of both algorithms, as the docstring describes (guidelines 3.3)')


# ------------------------------------------------------------------ demo


def _demo(ranks_per_node: int | None, numel: int) -> dict:
    """One rank's view: its topology and groups, and the largest difference between
    hierarchical_all_reduce and dist.all_reduce on a tensor of `numel` elements."""
    from common.distributed import current_device

    topology = topology_from_env(ranks_per_node)
    groups = build_groups(topology)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(topology.rank)).to(current_device())
    expected = x.clone()
    dist.all_reduce(expected)
    hierarchical_all_reduce(x, groups)
    diff = (x - expected).abs().max().item() if numel else 0.0
    mine = {"rank": topology.rank, "node": topology.node_rank, "local": topology.local_rank,
            "intra": dist.get_process_group_ranks(groups.intra), "inter": dist.get_process_group_ranks(groups.inter),
            "max_diff": diff, "host": os.uname().nodename if hasattr(os, "uname") else "?"}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return {"ranks": everyone, "shape": (topology.num_nodes, topology.ranks_per_node), "numel": numel, "store": store}


def main(argv: list[str] | None = None) -> None:
    from common.launch import exit_on_user_error, run_or_join

    parser = argparse.ArgumentParser(description="Hierarchical all-reduce demo (exercise 3.3); runs under torchrun "
                                     "(nodes from GROUP_RANK/LOCAL_RANK) or alone (a simulated cluster)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes, without torchrun")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per simulated node, without torchrun")
    parser.add_argument("--numel", type=int, default=1001, help="elements of the all-reduced tensor")
    args = parser.parse_args(argv)
    under_torchrun = "RANK" in os.environ
    with exit_on_user_error():
        result = run_or_join(_demo, args.nodes * args.ranks_per_node,
                             args=(None if under_torchrun else args.ranks_per_node, args.numel))
    if result is None:  # not rank 0
        return
    n, k = result["shape"]
    how = f"torchrun, workers' store at {result['store']}" if under_torchrun else "simulated with common.launch"
    print(f"{n} nodes x {k} ranks ({how}):")
    for r in result["ranks"]:
        print(f"  rank {r['rank']} on {r['host']}: node {r['node']}, local rank {r['local']}, "
              f"intra group {r['intra']}, inter group {r['inter']}, max |hierarchical - dist.all_reduce| "
              f"= {r['max_diff']:.2g}")
    nbytes = 4 * result["numel"]
    sent = cross_node_bytes(nbytes, n, k)
    print(f"bytes across nodes per rank for {nbytes} bytes: flat ring {sent['flat_ring']:.0f} (average), "
          f"hierarchical {sent['hierarchical']:.0f}")


if __name__ == "__main__":
    main()
