"""Activations of tp without sequence parallelism (sp=False) counted as with it, sbh(34 + 5as/h)/t: the norms' and dropouts' 10 sbh stay whole on every tp rank."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_memory_terms_match_the_formulas", "test_2_12_memory_properties",
             "test_2_12_memory_hand_derived"]
EDITS = {
    "activation_bytes": [
        ("        full, kept = s * b * h * (10 + (24 + scores) / t), 2 * s * b * h\n",
         "        full, kept = s * b * h * (34 + scores) / t, 2 * s * b * h\n"),
    ],
}
