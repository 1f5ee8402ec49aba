"""The causal mask compares LOCAL indices (0..n-1 of the rank's chunks) instead of global positions, in forward and backward."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_on_a_group_communicates_only_within_it",
]
EDITS = {
    "RingAttention.forward": [
        ("        q_pos = load_balanced_positions(n * cp, rank, cp).to(q.device)\n",
         "        q_pos = torch.arange(n, device=q.device)\n"),
        ("            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)\n",
         "            k_pos = torch.arange(n, device=q.device)\n"),
    ],
    "RingAttention.backward": [
        ("        q_pos = load_balanced_positions(n * cp, rank, cp).to(q.device)\n",
         "        q_pos = torch.arange(n, device=q.device)\n"),
        ("            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)\n",
         "            k_pos = torch.arange(n, device=q.device)\n"),
    ],
}
