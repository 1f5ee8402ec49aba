"""The block that arrives for the last step is dropped: the last step computes with the previous block again (used twice), under the last block's positions."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_on_a_group_communicates_only_within_it",
]
EDITS = {
    "RingAttention.forward": [
        ("                kv = pending()\n",
         "                received = pending()\n"
         "                kv = received if step < cp - 2 else kv\n"),
    ],
}
