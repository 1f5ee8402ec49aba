"""Every block is computed whole under the mask (no skipping of the half the mask hides): twice the work, and rows that see no key of a block divide 0 by 0."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_causal_work_is_balanced_and_halved",
]
EDITS = {
    "_needed": [
        ("    if not causal or src == rank:\n",
         "    if True:\n"),
    ],
}
