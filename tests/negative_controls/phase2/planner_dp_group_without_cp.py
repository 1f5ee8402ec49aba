"""Gradients synchronised (and ZeRO sharded) over the dp ranks only: the cp ranks hold the same parameters, so the group is dp * cp."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bytes_per_dimension_match_the_formulas", "test_2_12_each_dimension_lists_its_own_collectives"]
EDITS = {
    "dp_collectives": [
        ("    n, m = layout.dp * layout.cp, layout.microbatches\n", "    n, m = layout.dp, layout.microbatches\n"),
    ],
}
