"""_pre_backward all-gathers the unit every time it is called, not only when its parameters are freed: a unit whose two outputs both get gradients (a tuple, or two forwards before one backward) is gathered twice before its backward. Training is right (the same shards gathered again), only the all-gathers are counted."""

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_unit_returning_a_tuple_stage3", "test_2_4_two_forwards_then_one_backward_stage3"]
EDITS = {
    "ZeroStage3._pre_backward": [
        ("        if not self.is_unsharded(unit):\n"
         "            self.unshard(unit)\n",
         "        self.unshard(unit)\n"),
    ],
}
