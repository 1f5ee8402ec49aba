"""Capacity slots are claimed token by token (token 0's choices, then token 1's, ...) instead of all
first choices before any second choice: a token's second choice can take the slot another token
needed for its first (GShard gives first choices priority)."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_top_k_capacity_and_balancing_loss",
    "test_2_10_expert_parallel_layer_equals_one_process",
]
EDITS = {
    "route": [
        ("    queue = F.one_hot(experts.t().reshape(-1), num_experts)  # (k*T, E): assignments in (choice, token) order\n"
         "    position = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1  # how many earlier ones went to the same expert\n"
         "    kept = (position < capacity).view(k, tokens).t()\n",
         "    queue = F.one_hot(experts.reshape(-1), num_experts)  # (T*k, E): token-major\n"
         "    position = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1\n"
         "    kept = (position < capacity).view(tokens, k)\n"),
    ],
}
