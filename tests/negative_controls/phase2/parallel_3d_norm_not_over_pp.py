"""grad_norm sums over the tp group but not over pp: each stage clips by its own part of the norm."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_grad_norm_counts_every_parameter_once"]
EDITS = {
    "grad_norm": [
        ("    dist.all_reduce(total, group=mesh[\"pp\"].get_group())\n", ""),
    ],
}
