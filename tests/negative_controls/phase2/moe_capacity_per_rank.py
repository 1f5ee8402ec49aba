"""The capacity limits the rows each destination RANK gets (E/ep experts' worth of slots, shared)
instead of each expert's: a popular expert overflows into its neighbour's unused slots, so the
kept tokens differ from the MoE's."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_expert_parallel_layer_equals_one_process",
    "test_2_10_all_to_all_bytes_match_the_cost_model",
]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        r = route(self.router(x), self.k, expert_capacity(tokens, self.num_experts, self.k, self.capacity_factor))\n"
         "        token, choice = r.kept.nonzero(as_tuple=True)\n",
         "        r = route(self.router(x), self.k, tokens)  # no dropping per expert: per rank below\n"
         "        per_rank = expert_capacity(tokens, ep, self.k, self.capacity_factor)\n"
         "        rank_of = (r.experts // local).t().reshape(-1)  # (choice, token) order, as the slots go\n"
         "        queue = F.one_hot(rank_of, ep)\n"
         "        kept = ((queue.cumsum(dim=0) * queue).sum(dim=-1) - 1 < per_rank).view(self.k, tokens).t()\n"
         "        token, choice = kept.nonzero(as_tuple=True)\n"),
    ],
}
