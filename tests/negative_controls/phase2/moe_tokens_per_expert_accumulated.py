"""tokens_per_expert is a running total (+=) instead of the rows of the last forward: right after one
forward, wrong after the second."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_tokens_per_expert_counted_anew_each_forward"]
EDITS = {
    "ExpertParallelMoE.forward": [
        ("        self.tokens_per_expert = received.sum(dim=0)\n",
         "        self.tokens_per_expert = self.tokens_per_expert + received.sum(dim=0)\n"),
    ],
}
