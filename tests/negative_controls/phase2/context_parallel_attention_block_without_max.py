"""attention_block's softmax does not subtract the row max: exp(score) overflows float32 past 88, and the large-logit cases give inf/NaN."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ring_attention_matches_full_attention"]
EDITS = {
    "attention_block": [
        ("    weights = torch.exp(scores - top)\n",
         "    weights = torch.exp(scores)\n"
         "    top = torch.zeros_like(top)\n"),
    ],
}
