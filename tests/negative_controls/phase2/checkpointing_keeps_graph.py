"""forward runs the segment WITH grad and keeps its graph for backward instead of recomputing:
gradients are right, but every activation is saved, as without checkpointing."""
import torch
import torch.nn as nn

from solutions.phase2_advanced import checkpointing as _reference
from solutions.phase2_advanced.checkpointing import *  # noqa: F401,F403

EXERCISE = "2.3"
CAUGHT_BY = ["test_2_3_saved_bytes_fall_as_predicted",
             "test_2_3_each_segment_recomputed_once_in_backward_last_first"]


class CheckpointFunction(_reference.CheckpointFunction):
    @staticmethod
    def forward(ctx, run_function, x, *params):
        ctx.params = params
        ctx.x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            ctx.out = run_function(ctx.x)  # "why compute it twice?"
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((ctx.x, *ctx.params), needs) if need]
        grads = iter(torch.autograd.grad(ctx.out, wanted, grad_output, allow_unused=True))
        return (None, *[next(grads) if need else None for need in needs])


def checkpoint_sequential(blocks, segments, x):
    blocks = list(blocks)
    for part in balanced_ranges(len(blocks), segments, "blocks"):
        segment = nn.Sequential(*blocks[part.start:part.stop])
        x = CheckpointFunction.apply(segment, x, *segment.parameters())
    return x
