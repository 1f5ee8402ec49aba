"""grad_norm sums every square over the tp group: the LayerNorms and row-parallel biases, whole on each rank, count tp times."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_grad_norm_counts_every_parameter_once"]
EDITS = {
    "grad_norm": [
        ("    dist.all_reduce(shards, group=mesh[\"tp\"].get_group())\n    total = shards + whole\n",
         "    total = shards + whole\n    dist.all_reduce(total, group=mesh[\"tp\"].get_group())\n"),
    ],
}
