"""Q and K/V laid out differently: the keys of the block from rank src are taken to be the contiguous positions src*n..(src+1)*n, while the queries use the load-balanced layout."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_on_a_group_communicates_only_within_it",
]
EDITS = {
    "RingAttention.forward": [
        ("            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)\n",
         "            k_pos = torch.arange(src * n, (src + 1) * n, device=q.device)\n"),
    ],
    "RingAttention.backward": [
        ("            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)\n",
         "            k_pos = torch.arange(src * n, (src + 1) * n, device=q.device)\n"),
    ],
}
