"""ZB-H1's bubble with B + W costed as one F (t_B = t_W = t_F / 2): (p-1)/(2m+p-1) instead of (p-1)/(3m+p-1) with F, B, W one unit each."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bubble_fraction_matches_the_pipeline_time_grid", "test_2_12_hand_derived_schedule_cases"]
EDITS = {
    "bubble_fraction": [
        ("        return (p - 1) / (3 * m + p - 1)\n", "        return (p - 1) / (2 * m + p - 1)\n"),
    ],
}
