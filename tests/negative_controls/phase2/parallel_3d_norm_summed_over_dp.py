"""grad_norm also sums over the dp group: the replicas' identical gradients counted dp times."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_grad_norm_counts_every_parameter_once"]
EDITS = {
    "grad_norm": [
        ("    dist.all_reduce(total, group=mesh[\"pp\"].get_group())\n",
         "    dist.all_reduce(total, group=mesh[\"pp\"].get_group())\n    dist.all_reduce(total, group=mesh[\"dp\"].get_group())\n"),
    ],
}
