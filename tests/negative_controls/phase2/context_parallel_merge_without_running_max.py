"""Partial softmaxes merged as exp(lse)-weighted averages, without subtracting the running max: exp(lse) overflows for large logits."""

EXERCISE = "2.9"
CAUGHT_BY = ["test_2_9_ring_attention_matches_full_attention"]
EDITS = {
    "merge_partials": [
        ("    new = torch.logaddexp(lse, block_lse)\n"
         "    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(block_lse - new).unsqueeze(-1) * block_out), new\n",
         "    a, b = torch.exp(lse).unsqueeze(-1), torch.exp(block_lse).unsqueeze(-1)\n"
         "    return (a * out + b * block_out) / (a + b), torch.log(a + b).squeeze(-1)\n"),
    ],
}
