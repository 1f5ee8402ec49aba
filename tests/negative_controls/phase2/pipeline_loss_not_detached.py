"""run_pipeline returns the sum of the micro-batches' losses still attached to their graphs, not detached: the caller keeps every micro-batch's graph alive."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_gpipe_matches_one_process", "test_2_6_1f1b_matches_one_process"]
EDITS = {
    "run_pipeline": [
        ("            total.append(out.detach())\n",
         "            total.append(out)\n"),
    ],
}
