"""The balancing loss is a plain mean over the tokens: a rank with no tokens (T = 0) gets aux = NaN
instead of 0, and its loss carries the NaN through the sync into every rank's router gradient."""

EXERCISE = "2.10"
CAUGHT_BY = [
    "test_2_10_route_of_no_tokens_and_of_one_token",
    "test_2_10_layer_with_a_rank_that_has_no_tokens",
]
EDITS = {
    "route": [
        ("    aux_loss = num_experts * (first * probs.mean(dim=0)).sum() if tokens else probs.sum()  # T = 0: 0, not NaN\n",
         "    aux_loss = num_experts * (first * probs.mean(dim=0)).sum()\n"),
    ],
}
