"""accumulation_step zeroes the gradients after optimizer.step() instead of before the first micro-batch: gradients already in .grad when it is called are added into the step."""
import contextlib

import torch.nn.functional as F

from solutions.phase2_advanced.accumulation import *  # noqa: F401,F403
from solutions.phase2_advanced.accumulation import global_mean, micro_batches

EXERCISE = "2.1"
CAUGHT_BY = ["test_2_1_any_batch_and_micro_batch_size_take_one_step"]


def accumulation_step(sync, optimizer, inputs, targets, micro_batch_size):
    n = len(inputs)
    slices = micro_batches(n, micro_batch_size)
    loss_sum = 0.0
    for i, part in enumerate(slices):
        count = part.stop - part.start
        with contextlib.nullcontext() if i == len(slices) - 1 else sync.no_sync():
            loss = F.cross_entropy(sync(inputs[part]), targets[part])
            sync.backward(loss * (count / n), local_samples=n)
        loss_sum += loss.item() * count
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # "ready for the next step", but the first step took in whatever was there
    return global_mean(loss_sum, n, inputs.device)
