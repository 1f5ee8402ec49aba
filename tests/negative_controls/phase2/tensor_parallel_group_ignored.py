"""f and g all-reduce without `group=`: on the whole world, whatever group the layer was built with.

Right as long as the tensor-parallel group is the world (2.7's other tests), wrong as soon as it is
a sub-group (2.8's mesh): the partial sums of two model replicas get added together."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_layers_built_on_a_group_communicate_only_within_it"]
EDITS = {
    "CopyToTensorParallelRegion.backward": [
        ("        dist.all_reduce(total, group=ctx.group)\n",
         "        dist.all_reduce(total)\n"),
    ],
    "ReduceFromTensorParallelRegion.forward": [
        ("        dist.all_reduce(total, group=group)\n",
         "        dist.all_reduce(total)\n"),
    ],
}
