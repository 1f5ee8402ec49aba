"""The GPU RNG state saved and restored is the CURRENT device's (torch.cuda.get_rng_state() with no
device), not that of the device x is on: with x on cuda:1 while cuda:0 is current, the masks differ."""
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
        ctx.cuda_rng_state = torch.cuda.get_rng_state() if x.is_cuda else None  # "cuda": the current device
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
        devices = [torch.cuda.current_device()] if ctx.cuda_rng_state is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng_state)
            if ctx.cuda_rng_state is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng_state)
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
