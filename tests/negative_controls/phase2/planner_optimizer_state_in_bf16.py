"""Adam's state counted in the weights' dtype (two bf16 moments, 4 bytes a parameter), not the 12 bytes of an fp32 master copy and two fp32 moments."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_memory_terms_match_the_formulas", "test_2_12_memory_hand_derived"]
EDITS = {
    "memory": [
        ("                  optimizer=psi * precision.optimizer / (n if layout.zero >= 1 else 1),\n",
         "                  optimizer=psi * 2 * precision.params / (n if layout.zero >= 1 else 1),\n"),
    ],
}
