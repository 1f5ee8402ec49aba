"""forward_backward handles the stages as first OR last (if/elif): a model on one stage, first and last at once, is never given its loss and backward."""

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_split_model_matches_one_process"]
EDITS = {
    "forward_backward": [
        ("    if stage.is_last:\n",
         "    if stage.is_last and not stage.is_first:\n"),
    ],
}
