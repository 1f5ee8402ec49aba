"""The gradients are averaged over the pp group instead of dp: two stages' different layers mixed, replicas never synced."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("        dist.all_reduce(p.grad, group=dp_group)\n        p.grad /= dp\n",
         "        dist.all_reduce(p.grad, group=pp_group)\n        p.grad /= pp\n"),
    ],
}
