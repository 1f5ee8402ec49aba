"""Activation checkpointing's recomputed forward counted without its two all-reduces: tp sends 4 per layer and micro-batch instead of 6."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_bytes_per_dimension_match_the_formulas"]
EDITS = {
    "tp_collectives": [
        ("    per_layer = 6 if layout.checkpointing else 4\n", "    per_layer = 4\n"),
    ],
}
