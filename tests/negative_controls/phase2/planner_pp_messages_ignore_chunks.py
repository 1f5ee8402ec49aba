"""Interleaved 1F1B's messages counted as 1F1B's: one activation and one gradient a micro-batch, not one per chunk boundary a rank's v chunks cross."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bytes_per_dimension_match_the_formulas", "test_2_12_predictions_match_the_course_worlds"]
EDITS = {
    "pp_collectives": [
        ("    per_microbatch = 2 * v - 1 if p == 2 else 2 * v\n", "    per_microbatch = 1 if p == 2 else 2\n"),
    ],
}
