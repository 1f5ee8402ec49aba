"""The dK/dV accumulators are passed on only between steps: after the last step each rank keeps the accumulator of its NEXT rank's block and returns it as its own."""

EXERCISE = "2.9"
CAUGHT_BY = [
    "test_2_9_ring_attention_matches_full_attention",
    "test_2_9_ring_attention_on_a_group_communicates_only_within_it",
]
EDITS = {
    "RingAttention.backward": [
        ("            dkv = _ring_exchange(dkv, nxt, prv, group)()  # on with their block; the last hop takes them home\n",
         "            dkv = _ring_exchange(dkv, nxt, prv, group)() if step < cp - 1 else dkv\n"),
    ],
}
