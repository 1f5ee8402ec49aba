"""The loss is returned where it is computed: the last stage has its replica's loss, every other rank 0."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("    dist.all_reduce(total, group=pp_group)  # only the last stage holds its replica's loss\n"
         "    dist.all_reduce(total, group=dp_group)\n    return total.item() / dp\n",
         "    return total.item()\n"),
    ],
}
