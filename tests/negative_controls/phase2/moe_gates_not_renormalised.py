"""For k = 2 the gate weights stay the raw softmax probabilities p_j instead of p_j / (p_1 + p_2).

The output of each token is then scaled by p_1 + p_2 < 1, and the router's gradient differs. The
whole module is the reference with this one change."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_top_k_capacity_and_balancing_loss",
    "test_2_10_expert_parallel_layer_equals_one_process",
]
EDITS = {
    "route": [
        ("    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top\n",
         "    weights = top\n"),
    ],
}
