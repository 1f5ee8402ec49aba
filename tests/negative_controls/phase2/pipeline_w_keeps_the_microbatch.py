"""W reads the micro-batch's input and output (held[(k, j)]) but never drops them: every micro-batch of a split backward stays alive to the end of the step, so ZB-H1's memory grows with m."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_memory_held_until_w_zero_bubble"]
EDITS = {
    "run_pipeline": [
        ("        x, out = held.pop((k, j))\n",
         "        x, out = held[(k, j)]\n"),
    ],
}
