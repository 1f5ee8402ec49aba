"""Only the CPU's RNG state is saved and restored: on a GPU, dropout draws from the GPU's generator,
so the recomputation draws other masks (and the GPU's stream is not forked either)."""
import torch
import torch.nn as nn

from solutions.phase2_advanced.checkpointing import *  # noqa: F401,F403

EXERCISE = "2.3"
CAUGHT_BY = ["test_2_3_rng_of_the_gpu_the_input_is_on_is_replayed"]


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, x, *params):
        ctx.run_function, ctx.params = run_function, params
        ctx.cpu_rng_state = torch.get_rng_state()
        kind = x.device.type
        ctx.autocast = {"device_type": kind, "enabled": torch.is_autocast_enabled(kind),
                        "dtype": torch.get_autocast_dtype(kind), "cache_enabled": torch.is_autocast_cache_enabled()}
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        x = saved.detach().requires_grad_(ctx.needs_input_grad[1])
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.cpu_rng_state)
            with torch.enable_grad(), torch.autocast(**ctx.autocast):
                out = ctx.run_function(x)
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
