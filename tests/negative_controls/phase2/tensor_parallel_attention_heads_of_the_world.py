"""ParallelSelfAttention.copy_from_full_ picks its heads by the rank and size of the WORLD (dist.get_rank(), dist.get_world_size()), not of its tensor-parallel group: right while the group is the world, the wrong heads on a sub-group."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_layers_built_on_a_group_communicate_only_within_it"]
EDITS = {
    "ParallelSelfAttention.copy_from_full_": [
        ("        rank, world = _tp(self.qkv.group)\n",
         "        rank, world = dist.get_rank(), dist.get_world_size()\n"),
    ],
}
