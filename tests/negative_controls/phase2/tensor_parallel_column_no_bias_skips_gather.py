"""ColumnParallelLinear without bias returns F.linear(f(x), weight) straight away: gather_output=True is ignored when bias=False."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_column_parallel_linear_matches_nn_linear"]
EDITS = {
    "ColumnParallelLinear.forward": [
        ("        # EXERCISE 2.7: (..., in) -> this rank's columns of x W^T + b (all columns if gather_output); x enters the region through f\n",
         "        # EXERCISE 2.7: (..., in) -> this rank's columns of x W^T + b (all columns if gather_output); x enters the region through f\n"
         "        if self.bias is None:\n"
         "            return F.linear(CopyToTensorParallelRegion.apply(x, self.group), self.weight)\n"),
    ],
}
