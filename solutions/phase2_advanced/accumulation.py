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

Production: `with ddp_model.no_sync(): ...` around the forward AND backward of all but
the last micro-batch (torch.nn.parallel.DistributedDataParallel decides in forward);
FSDP has the same `no_sync()`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from solutions.phase1_data_parallel.trainer import sync_gradients


class GradSync(nn.Module):
    """Hand-made DDP around `module`: phase 1's weighted gradient all-reduce, plus `no_sync()`.

        loss = F.cross_entropy(sync(x), y)       # forward: decides NOW whether to sync
        sync.backward(loss, local_samples)       # loss.backward(), then the sync if decided

    As in torch's DDP, the decision is taken by the FORWARD, from `require_sync` at that
    moment (DDP's `_pre_forward`/`_post_forward` read `require_backward_grad_sync` and
    prepare the reducer): a forward outside `no_sync()` whose backward runs inside it
    still syncs, a forward inside whose backward runs outside does not. A forward under
    torch.no_grad() builds no graph and decides nothing (DDP ignores it too), and a
    backward uses up the decision (DDP's reducer, once prepared, serves one backward): a
    second backward with no forward between them does not sync again, e.g. that of an
    earlier forward made inside no_sync(). The sync is `self.sync(local_samples)`. Without an
    initialised process group (one process) there is nobody to sync with and `sync` does
    nothing. Positional and keyword arguments of the forward go to the module unchanged.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.require_sync = True  # DDP: require_backward_grad_sync; no_sync() clears it
        self.sync_prepared = False  # DDP: reducer.prepare_for_backward(); the last forward's decision

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward; records whether the backward of its output syncs."""
        # EXERCISE 2.1: return the module's output; record here, for the coming backward, whether it must sync (DDP decides in _post_forward)
        if torch.is_grad_enabled():  # DDP ignores forwards that build no graph
            self.sync_prepared = self.require_sync
        return self.module(*inputs, **kwargs)
        # END EXERCISE

    def sync(self, local_samples: int) -> None:
        """Phase 1's weighted all-reduce: .grad <- sum_r n_r * g_r / sum_r n_r on every rank."""
        if dist.is_available() and dist.is_initialized():
            sync_gradients(self.module, local_samples)

    def backward(self, loss: torch.Tensor, local_samples: int) -> None:
        """loss.backward(), then `self.sync(local_samples)` if the forward that built `loss` decided so.

        `local_samples`: this rank's samples in the whole optimizer step (all micro-batches),
        since that is what the accumulated .grad is the mean over.
        """
        # EXERCISE 2.1: backpropagate; then sync if the forward that built `loss` decided so (its decision, not the current require_sync)
        loss.backward()
        if self.sync_prepared:
            self.sync_prepared = False
            self.sync(local_samples)
        # END EXERCISE

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """A forward inside this block prepares no sync: its backward only accumulates into .grad.

        On exit (also by an exception) the previous setting comes back, so nested
        `no_sync()` blocks behave like DDP's.
        """
        # EXERCISE 2.1: clear require_sync for the duration of the block; on every way out, give it back the value it had before
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous
        # END EXERCISE


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


def accumulation_step(sync: GradSync, optimizer: torch.optim.Optimizer,
                      inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int) -> float:
    """One optimizer step on this rank's local batch, run as micro-batches of `micro_batch_size`.

    `sync` wraps the model (its forward is the model's). inputs (n, ...), targets (n,)
    class indices; the loss is cross-entropy. Afterwards the parameters equal those of
    ONE step on the concatenation of every rank's whole local batch (up to float
    rounding; gradients left in .grad before the call do not count), exactly one `sync`
    (gradient all-reduce, with local_samples = n) happened, ceil(n / micro_batch_size)
    forwards of at most micro_batch_size samples each ran, and at no time were the
    activations of more than one micro-batch kept for backward.
    Returns the mean loss over all ranks' samples (before the step).
    """
    if len(inputs) != len(targets) or len(inputs) == 0:
        raise ValueError(f"need as many targets as inputs, at least one: got {len(inputs)} inputs, {len(targets)} targets")
    slices = micro_batches(len(inputs), micro_batch_size)
    # EXERCISE 2.1: the mean loss's gradient over all n samples, one sync per step, one micro-batch's graph alive at a time; see global_mean
    n = len(inputs)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for i, part in enumerate(slices):
        count = part.stop - part.start
        last = i == len(slices) - 1
        with nullcontext() if last else sync.no_sync():  # forward AND backward inside, as with DDP
            loss = F.cross_entropy(sync(inputs[part]), targets[part])
            sync.backward(loss * (count / n), local_samples=n)
        loss_sum += loss.item() * count
    optimizer.step()
    return global_mean(loss_sum, n, inputs.device)
    # END EXERCISE
