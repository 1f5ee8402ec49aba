"""Cost model: a rank's share of its node's NICs is inter.bandwidth * nics_per_node / k, uncapped, so a node
with more NICs than ranks makes each rank faster than the one link it sends through."""
from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_cost_model_caps_a_rank_at_one_nic"]


def predict_seconds(nbytes, num_nodes, ranks_per_node, intra, inter, nics_per_node=None):
    n, k = num_nodes, ranks_per_node
    p = n * k
    if p == 1:
        return {"flat_ring": 0.0, "hierarchical": 0.0}
    share = inter.bandwidth * (k if nics_per_node is None else nics_per_node) / k  # the bug: no min(1, .)
    chunk = nbytes / p
    step = intra.alpha + chunk / intra.bandwidth
    if n > 1:
        step = max(step, inter.alpha + chunk / inter.bandwidth)
    in_node = 2 * (k - 1) * (intra.alpha + nbytes / k / intra.bandwidth)
    across = 2 * (n - 1) * (inter.alpha + nbytes / (k * n) / share)
    return {"flat_ring": 2 * (p - 1) * step, "hierarchical": in_node + across}
