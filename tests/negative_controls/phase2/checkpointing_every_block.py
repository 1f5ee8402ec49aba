"""checkpoint_sequential ignores `segments` and checkpoints every block on its own: n checkpoints,
no memory saved (k = n is as bad as k = 1)."""
import torch.nn as nn

from solutions.phase2_advanced.checkpointing import *  # noqa: F401,F403

EXERCISE = "2.3"
CAUGHT_BY = ["test_2_3_saved_bytes_fall_as_predicted",
             "test_2_3_each_segment_recomputed_once_in_backward_last_first"]


def checkpoint_sequential(blocks, segments, x):
    balanced_ranges(len(list(blocks)), segments, "blocks")  # still validates
    for block in blocks:
        x = CheckpointFunction.apply(block, x, *block.parameters())
    return x
