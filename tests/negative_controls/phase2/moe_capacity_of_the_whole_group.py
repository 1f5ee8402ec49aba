"""The capacity is computed from the tokens of the whole ep group (T * ep) instead of this rank's T:
each expert takes ep times more rows from every rank, so fewer tokens are dropped than in the MoE,
whose groups are the ranks' batches (and a rank's all-to-all grows by as much)."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_expert_parallel_layer_equals_one_process",
    "test_2_10_tokens_per_expert_give_the_load_imbalance",
]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        r = route(self.router(x), self.k, expert_capacity(tokens, self.num_experts, self.k, self.capacity_factor))\n",
         "        r = route(self.router(x), self.k, expert_capacity(tokens * ep, self.num_experts, self.k, self.capacity_factor))\n"),
    ],
}
