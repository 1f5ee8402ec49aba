"""torch.topk picks the experts: on equal probabilities it does not promise the lower index first (on
CPU, torch 2.14.1, topk of [0.1, 0.3, 0.3, 0.3] with k=2 returns experts 2 and 3, not 1 and 2).

Two ranks, or a rank and the single-process ground truth, then route a tied token differently. The
whole module is the reference with this one change."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_top_k_capacity_and_balancing_loss"]
EDITS = {
    "route": [
        ("    top, experts = probs.sort(dim=-1, descending=True, stable=True)  # stable: equal p keep index order\n"
         "    top, experts = top[:, :k], experts[:, :k]\n",
         "    top, experts = probs.topk(k, dim=-1)\n"),
    ],
}
