"""The stages' ranks are indices in the pp group (0..pp-1), not the global ranks point-to-point messages need."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_stages_hold_this_ranks_chunks_tensor_parallel"]
EDITS = {
    "build_stages": [
        ("[pp_ranks[q % pp] for q in range(num_stages)]", "[q % pp for q in range(num_stages)]"),
    ],
}
