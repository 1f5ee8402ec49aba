"""The gradients are not zeroed before the pipeline: the second step adds to the first step's gradients."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("    for p in params:\n        p.grad = None\n", ""),
    ],
}
