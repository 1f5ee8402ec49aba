"""forward_backward returns the loss still attached to its graph: the caller keeps the whole step's graph (every saved activation) alive as long as it keeps the loss."""

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_split_model_matches_one_process"]
EDITS = {
    "forward_backward": [
        ("    return None if loss is None else loss.detach()\n",
         "    return loss\n"),
    ],
}
