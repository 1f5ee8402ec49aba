"""Exercise 2.5: naive model parallelism: consecutive layers on consecutive ranks.

When a model does not fit on one device, cut its list of layers into p contiguous
parts ("stages") and put stage s on rank s. One training step on a batch:

    rank 0: layers 0..2      rank 1: layers 3..5      rank 2: layers 6..7 + loss
    x -> F0 --- a0 --------> F1 --- a1 ----------->  F2 -> loss
         B0 <-- dL/da0 ----- B1 <-- dL/da1 ---------  B2 <- loss.backward()

    time ->   rank 0:  F0 .. .. .. .. B0        only one rank is busy at a time:
              rank 1:  .. F1 .. .. B1 ..        utilisation 1/p, the same speed as one
              rank 2:  .. .. F2 B2 .. ..        device (minus the transfers), p x the memory

Autograd does not cross processes, so the two halves of every cut are glued by hand:

  * forward: rank s sends its output activation a_s to rank s+1, which receives it
    into a fresh leaf tensor with requires_grad=True (autograd must compute dL/da_s);
  * backward: rank s+1 sends a_s.grad back; rank s calls a_s_out.backward(grad),
    which continues the chain rule into its own layers.

Shapes. A receiver must allocate the buffer before `recv`, but only the sender knows
the activation's shape (it depends on the layers and the batch). So every activation
is preceded by a small fixed-size int64 header [dtype code, ndim, dim0, ..., dim7].
Gradients need no header: dL/da_s has the shape of a_s, which its receiver sent.
(Production code infers the shapes once, at start-up, instead of per message.)

Messages. `Mailbox` queues sends and posts them together with the next receive (one
NCCL group on GPUs, where a send may wait for its matching receive; plain isend/recv
with gloo). Messages between two ranks are matched in the order they are posted.

Cost per step: p compute phases in sequence, plus 2(p-1) activation/gradient
transfers of B x hidden floats each (alpha + n*beta, see 1.3). Pipelining (2.6) keeps
the stages busy at the same time by feeding micro-batches.

Production: torch.distributed.pipelining (pipeline(), PipelineStage), Megatron-LM and
DeepSpeed pipeline engines.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS  # [dtype code, ndim, dim0, ..., dim7]
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # dtype code = index


def partition(num_layers: int, num_stages: int) -> list[range]:
    """Cut layers 0..num_layers-1 into num_stages contiguous, non-empty, balanced ranges.

    Sizes differ by at most one (the first num_layers % num_stages stages get one more):
    partition(8, 3) == [range(0, 3), range(3, 6), range(6, 8)].
    Raises ValueError if num_stages < 1 or num_layers < num_stages (a stage would be empty).
    """
    raise NotImplementedError('TODO 2.5: validate (ValueError), then sizes num_layers // num_stages, +1 for the first num_layers % num_stages stages; consecutive ranges')


class PipelineStage(nn.Module):
    """Stage `stage_id` of `num_stages`: the layers partition(len(layers), num_stages)[stage_id].

    Runs on rank stage_id of the default process group; its neighbours are ranks
    stage_id - 1 (sends it activations) and stage_id + 1 (sends it gradients).
    `layers` is any indexable sequence of modules (e.g. an nn.Sequential); the stage
    holds the same module objects (no copy). Here every rank builds the whole model
    and keeps its part; a model that really does not fit is built per stage (or on the
    "meta" device and materialised per stage).
    """

    def __init__(self, layers: Sequence[nn.Module], stage_id: int, num_stages: int,
                 device: torch.device | str | None = None):
        super().__init__()
        if not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id must be in [0, {num_stages}), got {stage_id}")
        self.stage_id, self.num_stages = stage_id, num_stages
        self.layer_range = partition(len(layers), num_stages)[stage_id]
        self.layers = nn.Sequential(*(layers[i] for i in self.layer_range))
        self._device = torch.device(device) if device is not None else None
        if device is not None:
            self.to(device)

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def prev_rank(self) -> int:
        return self.stage_id - 1

    @property
    def next_rank(self) -> int:
        return self.stage_id + 1

    @property
    def device(self) -> torch.device:
        """Where its parameters live (the device given, or cpu, if it has none)."""
        first = next(self.parameters(), None)
        return first.device if first is not None else (self._device or torch.device("cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Mailbox:
    """Point-to-point messages of one rank, matched with the peer's in posting order.

    `send` only queues. Queued sends are posted together with the next `recv`, or by
    `post()` (call it before computing when the step has nothing to receive: a queued
    send must not wait for a later step, or the next stage starves), and `flush()`
    waits until all were delivered. Why queue: on NCCL a send may block until its
    receive is posted, so two neighbours that each "send, then receive" deadlock
    unless each posts both as one group (dist.batch_isend_irecv). On gloo,
    batch_isend_irecv can hang, and isend returns at once, so sends are plain isends
    whose Work is kept until `flush` (a dropped isend Work can leave its peer waiting forever).
    On NCCL, batch_isend_irecv must not be the group's first collective unless every
    rank joins it: run e.g. dist.barrier() once after init_process_group.
    """

    def __init__(self):
        self._queued: list[dist.P2POp] = []
        self._in_flight: list = []  # Works (they hold their tensors) of posted sends

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._queued.append(dist.P2POp(dist.isend, tensor.contiguous(), dst))

    def post(self) -> None:
        """Start the queued sends now."""
        queued, self._queued = self._queued, []
        if queued and dist.get_backend() == "nccl":
            self._in_flight += dist.batch_isend_irecv(queued)
        else:
            self._in_flight += [dist.isend(op.tensor, op.peer) for op in queued]

    def recv(self, buffer: torch.Tensor, src: int) -> torch.Tensor:
        """Start the queued sends and a receive into `buffer` from `src`; return `buffer` once filled."""
        if dist.get_backend() == "nccl":
            queued, self._queued = self._queued, []
            works = dist.batch_isend_irecv([*queued, dist.P2POp(dist.irecv, buffer, src)])
            for work in works:
                work.wait()  # on NCCL: orders the compute stream after the transfers
        else:
            self.post()
            dist.recv(buffer, src)
        return buffer

    def flush(self) -> None:
        """Post what is queued and wait until every send was delivered."""
        self.post()
        for work in self._in_flight:
            work.wait()
        self._in_flight = []

    def send_activation(self, activation: torch.Tensor, dst: int) -> None:
        """Queue a header describing `activation` (dtype code, ndim, shape), then its data."""
        raise NotImplementedError('TODO 2.5: an int64 header of HEADER_LEN on activation.device: [DTYPES.index(dtype), ndim, *shape, 0-padding]; self.send it, then self.send the activation')

    def recv_activation(self, src: int, device: torch.device) -> torch.Tensor:
        """Receive the header, allocate a tensor of that dtype and shape on `device`, receive into it."""
        raise NotImplementedError('TODO 2.5: self.recv an int64 header of HEADER_LEN; dtype = DTYPES[h[0]], shape = h[2:2 + h[1]]; self.recv into torch.empty(shape, dtype=dtype, device=device)')


def forward_backward(stage: PipelineStage, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """One forward and backward of the whole batch through the split model; every rank calls it.

    inputs: the batch on the first stage (None elsewhere); targets: on the last stage
    (None elsewhere). Leaves each stage's parameter gradients in .grad (accumulated, as
    loss.backward() does) equal to the unsplit model's. Returns the loss (detached) on
    the last stage, None elsewhere.
    """
    raise NotImplementedError('TODO 2.5: receive the input (recv_activation + requires_grad_) unless first; forward; last: loss.backward(), else send_activation(out.detach()), recv the grad (empty_like(out)), out.backward(grad); unless first send x.grad back; flush')
