"""The ring runs cp - 1 steps: the block that arrives last is never used (forward and backward)."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_on_a_group_communicates_only_within_it",
]
EDITS = {
    "RingAttention.forward": [
        ("        for step in range(cp):\n",
         "        for step in range(cp - 1):\n"),
    ],
    "RingAttention.backward": [
        ("        for step in range(cp):\n",
         "        for step in range(cp - 1):\n"),
    ],
}
