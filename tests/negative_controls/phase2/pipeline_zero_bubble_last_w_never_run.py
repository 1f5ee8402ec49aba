"""The executor runs each W lazily, just before the rank's next forward (to fill the time it would wait), and never drains what is left after the last forward: the weight gradients of the last micro-batches are never computed."""

EXERCISE = "2.6"
CAUGHT_BY = [
    "test_2_6_matches_one_process_zero_bubble",
    "test_2_6_executor_runs_any_valid_schedule_zero_bubble",
]
EDITS = {
    "run_pipeline": [
        ("    run = {\"F\": forward, \"B\": backward, \"W\": weight}\n",
         "    deferred = []\n"),
        ("        run[kind](k, j)\n",
         "        if kind == \"W\":\n"
         "            deferred.append((k, j))\n"
         "            continue\n"
         "        if kind == \"F\":\n"
         "            for kk, jj in deferred:\n"
         "                weight(kk, jj)\n"
         "            deferred.clear()\n"
         "        (forward if kind == \"F\" else backward)(k, j)\n"),
    ],
}
