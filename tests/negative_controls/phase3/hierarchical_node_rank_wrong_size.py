"""Node and local rank computed with the number of nodes instead of the node size: divmod(rank, world // ranks_per_node).

Right whenever num_nodes == ranks_per_node (2 x 2), wrong otherwise: on 2 nodes x 3 ranks, rank 2
becomes node 1, local rank 0.
"""
import os

from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_topology_from_the_launch_environment"]


def topology_from_env(ranks_per_node=None):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if ranks_per_node is None:
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        node_rank, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    else:
        node_rank, local_rank = divmod(rank, world // ranks_per_node)
    if world % ranks_per_node:
        raise ValueError(f"a world of {world} ranks does not split into nodes of {ranks_per_node}")
    return Topology(rank, node_rank, local_rank, world // ranks_per_node, ranks_per_node)  # noqa: F405
