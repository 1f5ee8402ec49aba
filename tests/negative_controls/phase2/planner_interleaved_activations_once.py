"""in_flight counts interleaved 1F1B's micro-batches in flight as 1F1B does, min(p, m), not its (chunk, micro-batch) pairs: the activations of the warm-up's extra chunks are missing."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_in_flight_matches_the_pipeline_schedules", "test_2_12_hand_derived_schedule_cases",
             "test_2_12_memory_terms_match_the_formulas"]
EDITS = {
    "in_flight": [
        ("    if schedule == \"interleaved\" and v > 1:\n        return min(2 * (p - 1) + (v - 1) * p + 1, v * m)\n", ""),
    ],
}
