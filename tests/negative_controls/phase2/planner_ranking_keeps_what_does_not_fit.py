"""rank_layouts ranks every candidate, also those that need more memory than a GPU has."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_rank_layouts_sorted_and_only_what_fits"]
EDITS = {
    "rank_layouts": [
        ("        if held.total <= cluster.memory_bytes:\n", "        if held.total >= 0:\n"),
    ],
}
