"""The dp gradient bytes counted for the whole model: not divided by tp and pp, though a rank all-reduces only the gradients of its own shard of its own stage."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bytes_per_dimension_match_the_formulas", "test_2_12_predictions_match_the_course_worlds"]
EDITS = {
    "dp_collectives": [
        ("    psi = max(stage_parameters(model, layout.pp, layout.tp))\n", "    psi = model.parameters()\n"),
    ],
}
