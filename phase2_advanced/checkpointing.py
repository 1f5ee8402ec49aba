"""Exercise 2.3: activation checkpointing: keep segment inputs, recompute the rest in backward.

Backward needs what forward computed: every block saves tensors (its input, its ReLU
output, a dropout mask...) until its gradient is taken. For n identical blocks that
is n blocks' worth of activations alive at the end of forward. Checkpointing cuts the
stack into k segments and, for each, keeps ONLY its input:

    forward (no_grad inside a segment)            backward, last segment first
    x0 -[seg 1]-> x1 -[seg 2]-> x2 -[seg 3]-> y   seg 3: re-run it from x2 WITH grad, backprop
    saved: x0, x1, x2   (k checkpoints)           seg 2: re-run it from x1, backprop ...

    peak saved bytes ~ k * c + (n/k) * A      c: one checkpoint, A: what one block saves
    minimal at k* = sqrt(n * A / c), capped at n: sqrt(n) for blocks that save as much
    as their input (c = A), about n (one per layer) for a transformer layer (A >= 16 c)
    compute: one extra forward per step (~ +33%: forward F, backward ~2F)

The re-run must compute the same function as the forward did: same random numbers
(dropout) and same autocast state (bf16 under torch.autocast, though backward usually
runs outside it). common/measure.py measures what autograd really saves
(`saved_activation_bytes`) and predicts it (`predicted_saved_bytes`).

Production: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) and
torch.utils.checkpoint.checkpoint_sequential(modules, segments, x, use_reentrant=False).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from common.split import balanced_ranges


class CheckpointFunction(torch.autograd.Function):
    """y = run_function(x), keeping for backward only x and what it takes to re-run run_function as now.

    `CheckpointFunction.apply(run_function, x, *params)`: x is one tensor, run_function
    maps it to one tensor, params are the parameters run_function uses. They are inputs
    of the Function only so that autograd knows the output depends on them (else, when x
    needs no gradient, e.g. the data, the output would need none either and the
    parameters would never get one); backward returns their gradients (None for those
    that need none, e.g. frozen ones, and for those run_function does not use). A
    parameter may also be an input of several Functions (a weight shared by two
    segments): each returns its own part, and autograd adds them up.

    "As now": backward re-runs run_function with the RNG states forward started from
    (the CPU's and that of every GPU x or params live on: the same dropout masks) and
    the autocast state forward ran under, and leaves the global RNG streams as it found them.
    """

    @staticmethod
    def forward(ctx, run_function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *params: torch.Tensor):
        raise NotImplementedError('TODO 2.3: save x and what backward needs to redo run_function(x) as now; return it computed with no graph; see CheckpointFunction')

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        raise NotImplementedError("TODO 2.3: re-run run_function with grad on a detached saved x, in forward's RNG and autocast, RNG streams kept; see fork_rng")


def checkpoint_sequential(blocks: Sequence[nn.Module], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Run blocks[0], blocks[1], ... on x, as `segments` checkpointed segments of balanced sizes.

    Same output and gradients as running the blocks one after the other; only the input
    of each segment is kept for backward. (The last segment may instead run normally,
    keeping its activations, as torch's checkpoint_sequential does: backward needs them
    first, so recomputing them would save nothing.)
    """
    blocks = list(blocks)
    ranges = balanced_ranges(len(blocks), segments, "blocks")  # 8 blocks, 3 segments: 0-2, 3-5, 6-7
    raise NotImplementedError("TODO 2.3: run each range of blocks as one CheckpointFunction, each segment's output feeding the next (what else must it receive?)")
    return x
