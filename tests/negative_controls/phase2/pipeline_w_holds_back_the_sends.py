"""W computes without posting the queued sends first (no box.post()): the input gradient its B just queued waits in the mailbox through the weight-gradient computation, and the previous stage waits for it meanwhile: the B/W split then saves nothing."""

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_weight_gradients_computed_at_w_zero_bubble"]
EDITS = {
    "run_pipeline": [
        ("        box.post()  # the input gradient of the B before leaves before this computes\n",
         ""),
    ],
}
