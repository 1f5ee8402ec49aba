"""With several chunks per rank, rank s holds the consecutive virtual stages s*v .. s*v+v-1 instead of s, s+pp, ... (round-robin)."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_stages_hold_this_ranks_chunks_tensor_parallel"]
EDITS = {
    "build_stages": [
        ("    for k in range(s, num_stages, pp):\n", "    for k in range(s * num_chunks, (s + 1) * num_chunks):\n"),
    ],
}
