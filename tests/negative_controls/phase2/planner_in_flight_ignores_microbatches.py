"""in_flight ignores the micro-batch count: 1F1B and ZB-H1 hold p (not min(p, m): with m < p only m exist), and GPipe p instead of all m."""

EXERCISE = "2.12"
CAUGHT_BY = ["test_2_12_in_flight_matches_the_pipeline_schedules", "test_2_12_hand_derived_schedule_cases"]
EDITS = {
    "in_flight": [
        ("        return m\n", "        return p\n"),
        ("    return min(p, m)\n", "    return p\n"),
    ],
}
