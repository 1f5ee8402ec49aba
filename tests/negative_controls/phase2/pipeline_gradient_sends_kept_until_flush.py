"""The input gradients a stage sends back are never waited for (only the activations are): the mailbox holds every gradient sent until the final flush, so the memory of every stage but the first grows with m under 1F1B."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_1f1b_memory_does_not_grow_with_m"]
EDITS = {
    "run_pipeline": [
        ("            if grad_sent is not None:\n"
         "                grad_sent.wait()\n",
         ""),
    ],
}
