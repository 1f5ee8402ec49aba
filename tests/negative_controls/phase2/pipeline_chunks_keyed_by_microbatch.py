"""The executor keeps what a forward leaves by micro-batch only (held[j], as for one stage per rank): a rank's second chunk overwrites its first chunk's activations of the same micro-batch, and the backward of one of them finds nothing."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_matches_one_process_interleaved"]
EDITS = {
    "run_pipeline": [
        ("        held[(k, j)] = (x, out)\n",
         "        held[j] = (x, out)\n"),
        ("        x, out = held[(k, j)] if (k, j) in split else held.pop((k, j))\n",
         "        x, out = held[j] if (k, j) in split else held.pop(j)\n"),
        ("        x, out = held.pop((k, j))\n",
         "        x, out = held.pop(j)\n"),
    ],
}
