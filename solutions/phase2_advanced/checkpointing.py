"""Exercise 2.3: activation checkpointing: keep segment inputs, recompute the rest in backward.

Backward needs what forward computed: every block saves tensors (its input, its ReLU
output, a dropout mask...) until its gradient is taken. For n identical blocks that
is n blocks' worth of activations alive at the end of forward. Checkpointing cuts the
stack into k segments and, for each, keeps ONLY its input:

    forward (no_grad inside a segment)            backward, last segment first
    x0 -[seg 1]-> x1 -[seg 2]-> x2 -[seg 3]-> y   seg 3: re-run it from x2 WITH grad, backprop
    saved: x0, x1, x2   (k checkpoints)           seg 2: re-run it from x1, backprop ...

    peak saved bytes ~ k * (one checkpoint) + n/k * (one block)     minimal at k = sqrt(n)
    compute: one extra forward per step (~ +33%: forward F, backward ~2F)

The exact count for the blocks the tests use is `predicted_saved_bytes`; what autograd
really saves is measured by `saved_activation_bytes`, through saved_tensors_hooks.

Production: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) and
torch.utils.checkpoint.checkpoint_sequential(modules, segments, x, use_reentrant=False).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks


class CheckpointFunction(torch.autograd.Function):
    """y = run_function(x), saving only x (and the RNG state) for backward.

    `CheckpointFunction.apply(run_function, x, *params)`: x is one tensor, run_function
    maps it to one tensor, params are the parameters run_function uses. They are inputs
    of the Function only so that autograd knows the output depends on them (else, when x
    needs no gradient, e.g. the data, the output would need none either and the
    parameters would never get one); backward returns their gradients.
    """

    @staticmethod
    def forward(ctx, run_function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *params: torch.Tensor):
        # EXERCISE 2.3: remember run_function, params and the CPU (and CUDA, if x is on a GPU) RNG state in ctx; ctx.save_for_backward(x); return run_function(x) computed under torch.no_grad()
        ctx.run_function = run_function
        ctx.params = params
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.cuda_rng_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x)
        with torch.no_grad():  # a Function's forward already runs without grad: said explicitly
            return run_function(x)
        # END EXERCISE

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # EXERCISE 2.3: x = saved input, detached, requires_grad as needed; under torch.random.fork_rng restore the saved RNG state and re-run run_function with torch.enable_grad(); torch.autograd.grad w.r.t. (x, *params) that need it; return (None, grad_x, *grad_params)
        (saved,) = ctx.saved_tensors
        # A fresh leaf: the recomputed graph must end here, not run on into earlier segments.
        x = saved.detach().requires_grad_(ctx.needs_input_grad[1])
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices):  # restores the current RNG state on exit
            torch.set_rng_state(ctx.cpu_rng_state)
            if ctx.cuda_rng_state is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng_state, x.device)
            with torch.enable_grad():
                out = ctx.run_function(x)
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x, *ctx.params), needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True))
        return (None, *[next(grads) if need else None for need in needs])
        # END EXERCISE


def segment_bounds(num_blocks: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) of `segments` contiguous, non-empty segments of sizes differing by at most one.

    The first num_blocks % segments segments get the extra block: 8 blocks, 3 segments
    -> [(0, 3), (3, 6), (6, 8)].
    """
    if not 1 <= segments <= num_blocks:
        raise ValueError(f"segments must be between 1 and the number of blocks ({num_blocks}), got {segments}")
    size, extra = divmod(num_blocks, segments)
    bounds, start = [], 0
    for i in range(segments):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def checkpoint_sequential(blocks: Sequence[nn.Module], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Run blocks[0], blocks[1], ... on x, as `segments` checkpointed segments (see segment_bounds).

    Same output and gradients as running the blocks one after the other; only the input
    of each segment is kept for backward.
    """
    blocks = list(blocks)
    bounds = segment_bounds(len(blocks), segments)
    # EXERCISE 2.3: for each (start, end) in bounds: x = CheckpointFunction.apply(nn.Sequential(*blocks[start:end]), x, *its parameters)
    for start, end in bounds:
        segment = nn.Sequential(*blocks[start:end])
        x = CheckpointFunction.apply(segment, x, *segment.parameters())
    # END EXERCISE
    return x


# ------------------------------------------------------------- measuring memory


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Peak bytes of the tensors autograd holds for backward while `fn()` runs.

    Call it with a whole training step, e.g. `lambda: model(x).sum().backward()`. Every
    tensor autograd saves (save_for_backward, and what built-in ops save) passes through
    the pack hook; it is counted from then until the graph drops it (the unpack side's
    holder is freed), so the result is the high-water mark over forward AND backward,
    recomputation included.

    * Each storage counts once, whole: a view and its base, or the ReLU output that the
      next Linear saves again as its input, are one buffer in memory.
    * Storages of `exclude` do not count. Pass the model's parameters: Linear saves its
      weight (to compute the input gradient), but parameters live in memory whether or
      not anything is saved, so they are not activation memory.
    * Only what autograd saves is seen: temporaries that die inside forward, gradients,
      and anything a Function hides in ctx attributes instead of save_for_backward.
    """
    excluded = {_storage_key(t) for t in exclude}
    live: dict[tuple, list] = {}  # storage key -> [bytes, number of saved references]
    current = peak = 0

    class Holder:
        def __init__(self, tensor: torch.Tensor, key: tuple | None):
            self.tensor, self.key = tensor, key

        def __del__(self):
            nonlocal current
            if self.key is not None:
                entry = live[self.key]
                entry[1] -= 1
                if entry[1] == 0:
                    current -= entry[0]
                    del live[self.key]

    def pack(tensor: torch.Tensor) -> Holder:
        nonlocal current, peak
        key = _storage_key(tensor)
        if key is None or key in excluded:
            return Holder(tensor, None)
        if key not in live:
            live[key] = [tensor.untyped_storage().nbytes(), 0]
            current += live[key][0]
            peak = max(peak, current)
        live[key][1] += 1
        return Holder(tensor, key)

    def unpack(holder: Holder) -> torch.Tensor:
        return holder.tensor

    with saved_tensors_hooks(pack, unpack):
        fn()
    return peak


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None
    return (str(tensor.device), storage.data_ptr())


def predicted_saved_bytes(num_blocks: int, segments: int | None, boundary_bytes: int, block_bytes: int) -> int:
    """Peak saved bytes for num_blocks identical blocks, checkpointed in `segments` (None: not checkpointed).

    Assumes, as for Linear -> ReLU blocks, that a block saves `block_bytes` besides its
    input, its own output among them, and that its input is the tensor the previous
    block saved as its output (or the stack's input: `boundary_bytes`).

    Not checkpointed: the input plus every block:     boundary + n * block.
    k segments: segment j's backward re-runs its m_j blocks while checkpoints 1..j are
    still held (later ones were freed by their own backward):

        peak = max over j of (j * boundary + m_j * block)  =  (k + n/k) * a   when n % k == 0
                                                              and boundary = block = a
    """
    if segments is None:
        return boundary_bytes + num_blocks * block_bytes
    bounds = segment_bounds(num_blocks, segments)
    return max(j * boundary_bytes + (end - start) * block_bytes for j, (start, end) in enumerate(bounds, start=1))
