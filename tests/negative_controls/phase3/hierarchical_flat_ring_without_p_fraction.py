"""Cost model: the flat ring's bytes across nodes forget the (p-1)/p of a ring all-reduce (2 S/k instead of 2(p-1)/p S/k)."""
from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_cross_node_bytes_formula"]


def cross_node_bytes(nbytes, num_nodes, ranks_per_node):
    n, k = num_nodes, ranks_per_node
    return {"flat_ring": 2 * nbytes / k if n > 1 else 0.0, "hierarchical": 2 * (n - 1) / n * nbytes / k}
