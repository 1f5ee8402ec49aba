"""Each rank takes the slice of the global batch of its pp index, not its dp index: one replica's stages see different rows."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("    micro_x = split_microbatches(x.chunk(dp)[d], num_microbatches)",
         "    micro_x = split_microbatches(x.chunk(dp)[s % dp], num_microbatches)"),
    ],
}
