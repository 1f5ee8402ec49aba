"""accumulation_step calls optimizer.step() after every micro-batch: k small steps instead of one large one."""
from contextlib import nullcontext

import torch.nn.functional as F

from solutions.phase2_advanced.accumulation import *  # noqa: F401,F403

EXERCISE = "2.1"
CAUGHT_BY = ["test_2_1_single_process_matches_one_large_batch", "test_2_1_two_ranks_match_one_large_batch"]


def accumulation_step(sync, optimizer, inputs, targets, micro_batch_size):
    slices = micro_batches(len(inputs), micro_batch_size)
    n = len(inputs)
    loss_sum = 0.0
    for i, part in enumerate(slices):
        count = part.stop - part.start
        optimizer.zero_grad(set_to_none=True)
        with nullcontext() if i == len(slices) - 1 else sync.no_sync():
            loss = F.cross_entropy(sync(inputs[part]), targets[part])
            sync.backward(loss * (count / n), local_samples=n)
        optimizer.step()
        loss_sum += loss.item() * count
    return global_mean(loss_sum, n, inputs.device)
