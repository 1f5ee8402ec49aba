"""Exercise 3.2: a DDP from scratch, with gradient buckets all-reduced DURING backward.

Phase 1 all-reduced every gradient after backward: one call per parameter (each pays
the latency alpha) and the network idles while backward computes. Here, as in torch's
DistributedDataParallel, gradients are packed into a few flat buckets; a bucket is
all-reduced (asynchronously) as soon as its last gradient is ready, while autograd keeps
computing the gradients of earlier layers:

    backward   | layer 4 | layer 3 | layer 2 | layer 1 |finish|  step
    buckets    [ bucket 0: 4, 3 ]  [ bucket 1: 2, 1 ]
    network              | all-reduce 0 |     | all-reduce 1 |
                         ^ launched by layer 3's gradient hook; only the last bucket's
                           all-reduce is left to wait for at the end of backward

Buckets hold parameters in REVERSE registration order (roughly the order backward
produces their gradients) and are launched strictly in bucket order, so every rank
issues the same collectives in the same order. Gradients end as views into the buckets
(torch's `gradient_as_bucket_view=True`): no copy back, no allocation per step.

    model = BucketedDDP(net, bucket_cap_mb=25)     # broadcasts rank 0's params and buffers
    loss_fn(model(x), y).backward()                # returns with averaged .grad everywhere
    optimizer.step()
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group the parameters that require grad into buckets: lists of indices into `params`.

    The rule (torch's `_compute_bucket_assignment_by_size`, walked in reverse):
      * walk `params` from the LAST to the first, skipping those with requires_grad False;
      * each (dtype, device) pair has at most one open bucket; a parameter is appended to
        the open bucket of its pair (opened if there is none);
      * right after appending, if that bucket holds >= cap_bytes (sum of numel *
        element_size), it closes: it is the next bucket of the result. So a bucket always
        ends with the parameter that reached the cap, and a parameter larger than the cap
        closes the bucket it joins (alone only if that bucket was empty);
      * after the walk, the buckets still open follow, in the order they were opened.
    Inside a bucket, indices keep the walk's order (descending). cap_bytes >= 1.

    assign_buckets([a(40 B), b(40 B), c(120 B), d(20 B)], 80) == [[3, 2], [1, 0]]
    """
    # EXERCISE 3.2: the docstring's rule exactly (reverse order, one open bucket per (dtype, device), close at >= cap_bytes, then leftovers)
    if cap_bytes < 1:
        raise ValueError(f"cap_bytes must be >= 1, got {cap_bytes}")
    closed: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], list[int]]] = {}  # (dtype, device) -> (indices, [bytes])
    for index in reversed(range(len(params))):
        param = params[index]
        if not param.requires_grad:
            continue
        indices, size = open_buckets.setdefault((param.dtype, param.device), ([], [0]))
        indices.append(index)
        size[0] += param.numel() * param.element_size()
        if size[0] >= cap_bytes:
            closed.append(indices)
            del open_buckets[(param.dtype, param.device)]
    return closed + [indices for indices, _ in open_buckets.values()]  # dicts keep insertion order
    # END EXERCISE


class BucketedDDP(nn.Module):
    """Data parallelism like torch's DDP: wrap a module; after `loss.backward()` every rank
    of `group` holds, in each parameter's .grad, the mean over ranks of its local gradient.

    Construction broadcasts rank 0's (of `group`) parameters and buffers to every rank and
    lays out the buckets: `self.buckets = assign_buckets(list(module.parameters()),
    bucket_cap_mb * 2**20)` (every bucket capped alike: no small first bucket).

    Backward (of a forward that prepared a sync): a gradient hook per parameter copies its
    gradient into its bucket's flat buffer; the moment a bucket is complete (and all
    buckets before it have been launched), it is divided by the world size and all-reduced
    with async_op=True. One all_reduce per bucket per step. A final callback queued on the
    autograd engine (as torch's reducer does) runs when backward ends: it launches the
    buckets still incomplete, waits for every all-reduce, and points each .grad at its
    slice of the bucket. So `loss.backward()` returns with averaged gradients and the
    training loop is unchanged; an explicit `finish()` would be one more call to forget.

    A parameter that got no gradient in this backward (unused on this rank) contributes
    its .grad as it stands, zeros if it has none (torch DDP with find_unused_parameters=True
    does the same), and never blocks its bucket for long: the final callback launches it.
    Afterwards its .grad is the average like any other (zeros if unused on every rank,
    where torch leaves .grad None). Every rank must produce at least one gradient in the
    backward, or it queues no callback and the others wait for it.

    `no_sync()`: a forward inside it prepares no sync, so its backward only accumulates
    into .grad (decided at forward, as torch DDP and phase 2's GradSync do). Uneven batches
    per rank: the mean over ranks of each rank's gradient (torch DDP's rule too), not
    phase 1's sample-weighted mean.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.require_sync = True  # no_sync() clears it
        self.sync_prepared = False  # the decision of the last forward, for its backward
        self.world_size = dist.get_world_size(group)
        self._broadcast_from_rank0()
        self._build_buckets(int(bucket_cap_mb * 2**20))
        self._reset()

    def _broadcast_from_rank0(self) -> None:
        """Every parameter and buffer of the module becomes rank 0's (rank 0 of self.group)."""
        # EXERCISE 3.2: one broadcast per tensor, in the same order on every rank; buffers too (BatchNorm's running statistics)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.detach(), group_src=0, group=self.group)
        # END EXERCISE

    def _build_buckets(self, cap_bytes: int) -> None:
        """self.buckets = assign_buckets(parameters, cap_bytes); a flat buffer per bucket, allocated
        once; a gradient hook on every parameter in a bucket (register_post_accumulate_grad_hook)."""
        # EXERCISE 3.2: each parameter's slot: a view of its bucket's flat buffer shaped like it; its hook calls self._grad_ready(its index)
        self.params = list(self.module.parameters())
        self.buckets = assign_buckets(self.params, cap_bytes)
        self.flats: list[torch.Tensor] = []
        self.slots: dict[int, torch.Tensor] = {}  # parameter index -> its view into a flat buffer
        self.bucket_of: dict[int, int] = {}
        for b, indices in enumerate(self.buckets):
            first = self.params[indices[0]]
            flat = torch.zeros(sum(self.params[i].numel() for i in indices), dtype=first.dtype, device=first.device)
            offset = 0
            for i in indices:
                numel = self.params[i].numel()
                self.slots[i] = flat[offset:offset + numel].view_as(self.params[i])
                self.bucket_of[i] = b
                offset += numel
            self.flats.append(flat)
        for i in self.slots:
            self.params[i].register_post_accumulate_grad_hook(lambda param, i=i: self._grad_ready(i))
        # END EXERCISE

    def _reset(self) -> None:
        """State of one backward: nothing ready, nothing launched."""
        # EXERCISE 3.2: whatever per-backward state your hooks keep, back to "nothing ready, nothing launched, no callback queued"
        self.ready = [False] * len(self.params)
        self.missing = [len(indices) for indices in self.buckets]
        self.next_bucket = 0
        self.works: list = []
        self.callback_queued = False
        # END EXERCISE

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward; records whether the backward of its output syncs."""
        # EXERCISE 3.2: the module's output; decide here (not in backward) whether its backward syncs
        if torch.is_grad_enabled():
            self.sync_prepared = self.require_sync
        return self.module(*inputs, **kwargs)
        # END EXERCISE

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside this block prepare no sync; the previous setting comes back on exit."""
        # EXERCISE 3.2: as phase 2's GradSync.no_sync
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous
        # END EXERCISE

    def _grad_ready(self, i: int) -> None:
        """Parameter i's gradient is accumulated (its hook): into its bucket; launch what is complete."""
        # EXERCISE 3.2: only if forward prepared a sync: queue the final callback once, copy into the slot, launch complete buckets in order
        if not self.sync_prepared or self.ready[i]:
            return
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._mark_ready(i)
        self._launch_complete_buckets()
        # END EXERCISE

    def _mark_ready(self, i: int) -> None:
        """Parameter i's contribution goes into its slot (zeros if it has no .grad); its bucket lacks one less."""
        # EXERCISE 3.2: copy (unless .grad already is the slot), count it ready
        grad, slot = self.params[i].grad, self.slots[i]
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() != slot.data_ptr():  # after the first step .grad IS the slot
            slot.copy_(grad)
        self.ready[i] = True
        self.missing[self.bucket_of[i]] -= 1
        # END EXERCISE

    def _launch_complete_buckets(self) -> None:
        """Launch, in bucket order, every complete bucket not launched yet: one async all_reduce each."""
        # EXERCISE 3.2: stop at the first incomplete bucket (every rank must launch in the same order); average = divide, then SUM
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            flat = self.flats[self.next_bucket]
            flat.div_(self.world_size)  # before the sum, as torch's allreduce_hook: no fp16 overflow
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.next_bucket += 1
        # END EXERCISE

    def _finish_backward(self) -> None:
        """End of backward (the queued callback): launch the rest, wait, .grad = the bucket views."""
        # EXERCISE 3.2: launch incomplete buckets too, wait for every all-reduce; each .grad becomes its averaged slot; reset for the next pass
        for i in self.slots:
            if not self.ready[i]:
                self._mark_ready(i)
        self._launch_complete_buckets()
        for work in self.works:
            work.wait()
        for i, slot in self.slots.items():
            param = self.params[i]
            if param.grad is None or param.grad.data_ptr() != slot.data_ptr():
                param.grad = slot
        self.sync_prepared = False
        self._reset()
        # END EXERCISE
