"""backward re-runs the segment without restoring the RNG state: dropout draws new masks, gradients differ."""
import torch
import torch.nn as nn

from solutions.phase2_advanced import checkpointing as _reference
from solutions.phase2_advanced.checkpointing import *  # noqa: F401,F403

EXERCISE = "2.3"
CAUGHT_BY = ["test_2_3_same_loss_and_gradients_as_without_checkpointing"]


class CheckpointFunction(_reference.CheckpointFunction):
    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        x = saved.detach().requires_grad_(ctx.needs_input_grad[1])
        with torch.enable_grad():
            out = ctx.run_function(x)  # the RNG has moved on since forward: other dropout masks
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x, *ctx.params), needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True))
        return (None, *[next(grads) if need else None for need in needs])


def checkpoint_sequential(blocks, segments, x):
    blocks = list(blocks)
    for part in balanced_ranges(len(blocks), segments, "blocks"):
        segment = nn.Sequential(*blocks[part.start:part.stop])
        x = CheckpointFunction.apply(segment, x, *segment.parameters())
    return x
