"""The experts are ranked by the logits instead of the float32 probabilities: where two logits differ
by less than float32 resolves after the softmax (0 and 1e-8), their probabilities are equal and the contract
gives the LOWER index, the logits the higher."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_route_ties_decided_on_the_float32_probabilities"]
EDITS = {
    "route": [
        ("    top, experts = probs.sort(dim=-1, descending=True, stable=True)  # stable: equal p keep index order\n",
         "    experts = logits.sort(dim=-1, descending=True, stable=True).indices  # by the logits\n"
         "    top = probs.gather(-1, experts)\n"),
    ],
}
