"""The balancing loss is computed from detached probabilities: its value is right, but it never
reaches the router's gradient (the loss then balances nothing)."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_top_k_capacity_and_balancing_loss",
    "test_2_10_expert_parallel_layer_equals_one_process",
]
EDITS = {
    "route": [
        ("    aux_loss = num_experts * (first * probs.mean(dim=0)).sum() if tokens else probs.sum()  # T = 0: 0, not NaN\n",
         "    aux_loss = num_experts * (first * probs.detach().mean(dim=0)).sum() if tokens else probs.sum()  # T = 0: 0, not NaN\n"),
    ],
}
