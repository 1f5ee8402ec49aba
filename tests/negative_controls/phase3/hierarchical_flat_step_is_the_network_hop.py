"""Cost model: a flat ring's step is taken to be its node-crossing hop whenever there are several nodes ("the network is the slow part"), though the hops inside a node may be slower."""
from solutions.phase3_multi_node import hierarchical as _reference
from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_flat_ring_step_waits_for_its_slowest_hop"]


def predict_seconds(nbytes, num_nodes, ranks_per_node, intra, inter, nics_per_node=None):
    result = _reference.predict_seconds(nbytes, num_nodes, ranks_per_node, intra, inter, nics_per_node)
    n, k = num_nodes, ranks_per_node
    p = n * k
    if p > 1:
        chunk = nbytes / p
        link = inter if n > 1 else intra  # the bug: no max over the hops
        result["flat_ring"] = 2 * (p - 1) * (link.alpha + chunk / link.bandwidth)
    return result
