"""Exercise 2.1: gradient accumulation, with one gradient all-reduce per optimizer step.

A rank whose local batch of n samples does not fit in memory runs it as k micro-batches
of m samples (the last one may be smaller: n = (k-1)*m + n_k) and steps once:

    micro-batch i:  loss_i = mean loss over its n_i samples
                    backward(loss_i * n_i / n)       grads ADD UP in .grad
    after all k:    .grad = sum_i (n_i / n) * grad(loss_i)  = grad of the mean loss over n

                 micro 1         micro 2     ...     micro k (last)
    rank 0   fwd/bwd        fwd/bwd             fwd/bwd --+
             [ no_sync(): .grad accumulates locally ]      |  all-reduce
    rank 1   fwd/bwd        fwd/bwd             fwd/bwd --+  sum n_r*g_r / sum n_r
                                                           |
                                                   optimizer.step()  (once)

Cost per optimizer step (Psi parameters, fp32 gradients): ONE all-reduce of 4*Psi bytes
instead of k if every micro-step synced; compute and activation memory are those of a
micro-batch of m samples.

Production: `with ddp_model.no_sync(): ...` for all but the last micro-batch
(torch.nn.parallel.DistributedDataParallel); FSDP has the same `no_sync()`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class GradSync:
    """Hand-made data parallelism for `model`: the phase-1 gradient all-reduce, plus `no_sync()`.

    `backward(loss, local_samples)` is what a DDP model's backward does: compute the
    gradients, then (unless inside `no_sync()`) replace every rank's `.grad` by the
    gradient of the mean loss over all ranks' samples. Without an initialised process
    group (one process) there is nobody to sync with and `sync` does nothing.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.require_sync = True  # DDP calls it require_backward_grad_sync

    def sync(self, local_samples: int) -> None:
        """Phase 1's weighted all-reduce: .grad <- sum_r n_r * g_r / sum_r n_r on every rank.

        Costs 1 + (number of parameters) all-reduce calls, 4*Psi bytes of gradient in all.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        total = torch.tensor([float(local_samples)], dtype=torch.float64, device=params[0].device)
        dist.all_reduce(total)
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad.mul_(local_samples)
            dist.all_reduce(param.grad)
            param.grad.div_(total.item())

    def backward(self, loss: torch.Tensor, local_samples: int) -> None:
        """loss.backward(), then sync the gradients unless inside `no_sync()`.

        `local_samples`: this rank's samples in the whole optimizer step (all micro-batches),
        since that is what the accumulated .grad is the mean over.
        """
        loss.backward()
        if self.require_sync:
            self.sync(local_samples)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block `backward` only accumulates into .grad, it does not all-reduce.

        On exit (also by an exception) the previous setting comes back, so nested
        `no_sync()` blocks behave like DDP's.
        """
        raise NotImplementedError('TODO 2.1: remember self.require_sync, set it to False, yield, and restore the remembered value in a finally')


def micro_batches(n: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of at most `micro_batch_size` covering range(n); the last may be smaller.

    micro_batches(7, 3) -> [slice(0, 3), slice(3, 6), slice(6, 7)]
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [slice(start, min(start + micro_batch_size, n)) for start in range(0, n, micro_batch_size)]


def global_mean(local_sum: float, local_count: int, device: torch.device) -> float:
    """sum over ranks of local_sum / sum over ranks of local_count (one all-reduce; none alone)."""
    stats = torch.tensor([local_sum, float(local_count)], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def accumulation_step(model: nn.Module, sync: GradSync, optimizer: torch.optim.Optimizer,
                      inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int) -> float:
    """One optimizer step on this rank's local batch, run as micro-batches of `micro_batch_size`.

    inputs (n, ...), targets (n,) class indices; the loss is cross-entropy. Afterwards the
    parameters equal those of ONE step on the concatenation of every rank's whole local
    batch (up to float rounding), and exactly one `sync` (gradient all-reduce) happened.
    Returns the mean loss over all ranks' samples (before the step).
    """
    if len(inputs) != len(targets) or len(inputs) == 0:
        raise ValueError(f"need as many targets as inputs, at least one: got {len(inputs)} inputs, {len(targets)} targets")
    slices = micro_batches(len(inputs), micro_batch_size)
    raise NotImplementedError('TODO 2.1: zero_grad; for each slice: forward, scale the mean loss by n_i / n, sync.backward(...) inside sync.no_sync() except for the last slice; optimizer.step(); return global_mean(sum of loss_i * n_i, n, device)')
