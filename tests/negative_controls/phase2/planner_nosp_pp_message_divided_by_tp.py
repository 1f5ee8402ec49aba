"""Without sequence parallelism (sp=False, 2.11) the pipeline message still counted as a tp-th of the activation: every tp rank sends the whole (b, s, h) to its peer."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bytes_per_dimension_match_the_formulas", "test_2_12_predictions_match_the_course_worlds"]
EDITS = {
    "pp_collectives": [
        ("            // (layout.tp if layout.sp else 1) * precision.activations)\n",
         "            // layout.tp * precision.activations)\n"),
    ],
}
