"""ZeRO stage 1 counted as sharding the gradients too (that is stage 2): a stage-1 rank holds 4 Psi of gradients, not 4 Psi / N."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_memory_terms_match_the_formulas", "test_2_12_memory_hand_derived",
             "test_2_12_predictions_match_the_course_worlds"]
EDITS = {
    "memory": [
        ("                  grads=psi * precision.grads / (n if layout.zero >= 2 else 1),\n",
         "                  grads=psi * precision.grads / (n if layout.zero >= 1 else 1),\n"),
    ],
}
