"""_post_forward hooks the unit's output only when it is a tensor: a unit returning a tuple is never gathered again before its backward, which then finds its weights freed."""

EXERCISE = "2.4"
CAUGHT_BY = ["test_2_4_unit_returning_a_tuple_stage3"]
EDITS = {
    "ZeroStage3._post_forward": [
        ("        outputs = output if isinstance(output, (tuple, list)) else (output,)\n",
         "        outputs = (output,)\n"),
    ],
}
