"""ring_bytes counts an all-reduce as (n-1)/n of the tensor: half of what a ring all-reduce (reduce-scatter, then all-gather) sends."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_ring_bytes", "test_2_12_bytes_per_dimension_match_the_formulas",
             "test_2_12_predictions_match_the_course_worlds"]
EDITS = {
    "ring_bytes": [
        ("    return {\"all_reduce\": 2 * (n - 1) / n, \"send\": 1.0}.get(kind, (n - 1) / n) * nbytes\n",
         "    return {\"all_reduce\": (n - 1) / n, \"send\": 1.0}.get(kind, (n - 1) / n) * nbytes\n"),
    ],
}
