"""time_grid's deadlock message names every stage's next action, finished stages included: when the stages disagree on the micro-batches, one finishes before the others stick, and the message itself raises IndexError instead of the ValueError."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_rejects_malformed_schedules"]
EDITS = {
    "time_grid": [
        ("            waiting = [f\"rank {r} on {schedule[r][position[r]]}\" for r in range(num_ranks)\n"
         "                       if position[r] < len(rows[r])]\n",
         "            waiting = [f\"rank {r} on {schedule[r][position[r]]}\" for r in range(num_ranks)]\n"),
    ],
}
