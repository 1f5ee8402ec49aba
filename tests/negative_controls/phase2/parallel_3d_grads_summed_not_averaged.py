"""The gradients are all-reduced over dp but not divided by dp: the step is dp times too large."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("        p.grad /= dp\n", ""),
    ],
}
