"""The groups are transposed: the "node" groups are strided (one rank per node) and the inter-node groups consecutive ranks."""
import torch.distributed as dist

from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_groups_are_the_nodes_and_the_local_ranks", "test_3_3_runs_under_two_torchrun_agents"]


def build_groups(topology):
    n, k = topology.num_nodes, topology.ranks_per_node
    intra = [dist.new_group([node * k + local for node in range(n)]) for local in range(k)]
    inter = [dist.new_group([node * k + local for local in range(k)]) for node in range(n)]
    return NodeGroups(topology, intra=intra[topology.local_rank], inter=inter[topology.node_rank])  # noqa: F405
