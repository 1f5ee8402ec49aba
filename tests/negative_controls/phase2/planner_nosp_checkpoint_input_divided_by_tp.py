"""Without sequence parallelism (sp=False) checkpointing's kept layer input counted as 2sbh/t: it is whole on every tp rank, 2sbh."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_memory_terms_match_the_formulas", "test_2_12_memory_hand_derived"]
EDITS = {
    "activation_bytes": [
        ("        full, kept = s * b * h * (10 + (24 + scores) / t), 2 * s * b * h\n",
         "        full, kept = s * b * h * (10 + (24 + scores) / t), 2 * s * b * h / t\n"),
    ],
}
