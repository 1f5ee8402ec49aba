"""The Function takes only the input tensor and differentiates w.r.t. it alone: the parameters of the
checkpointed blocks never get a gradient (and with an input that needs none, nothing does)."""
import torch
import torch.nn as nn

from solutions.phase2_advanced.checkpointing import *  # noqa: F401,F403

EXERCISE = "2.3"
CAUGHT_BY = ["test_2_3_same_loss_and_gradients_as_without_checkpointing"]


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, x):
        ctx.run_function = run_function
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        x = saved.detach().requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.cpu_rng_state)
            with torch.enable_grad():
                out = ctx.run_function(x)
        (grad_x,) = torch.autograd.grad(out, [x], grad_output)
        return None, grad_x


def checkpoint_sequential(blocks, segments, x):
    blocks = list(blocks)
    for part in balanced_ranges(len(blocks), segments, "blocks"):
        x = CheckpointFunction.apply(nn.Sequential(*blocks[part.start:part.stop]), x)
    return x
