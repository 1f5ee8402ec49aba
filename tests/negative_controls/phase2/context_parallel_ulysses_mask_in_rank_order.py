"""Ulysses applies the causal mask to the gathered sequence as it arrives (the ranks' chunks in rank order), not in position order."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ulysses_attention_matches_full_attention"]
EDITS = {
    "ulysses_attention": [
        ("    y = F.scaled_dot_product_attention(q[..., natural, :], k[..., natural, :], v[..., natural, :], is_causal=causal)\n"
         "    return _HeadsToSequence.apply(y[..., order, :], group)\n",
         "    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"
         "    return _HeadsToSequence.apply(y, group)\n"),
    ],
}
