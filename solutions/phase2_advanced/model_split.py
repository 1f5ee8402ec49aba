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
the activation's dtype and shape (they depend on the layers and the batch: (b, h) for
an MLP, (b, c, h, w) for CNN features). So every activation is preceded by a small
fixed-size int64 header [dtype code, ndim, dim0, ..., dim7]. Gradients need none:
dL/da_s has the dtype and shape of a_s, which its receiver sent.
(Production code infers the shapes once, at start-up, instead of per message.)

Messages. `Mailbox` queues sends and posts them together with the next receive, as
one dist.batch_isend_irecv (one NCCL group on GPUs). Messages between two ranks are
matched in the order they are posted.

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

from common.split import balanced_ranges

MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS  # [dtype code, ndim, dim0, ..., dim7]
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # dtype code = index


class PipelineStage(nn.Module):
    """Stage `stage_id` of `num_stages`: the layers balanced_ranges(len(layers), num_stages)[stage_id].

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
        self.layer_range = balanced_ranges(len(layers), num_stages, "layers")[stage_id]
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


class Delivery:
    """Receipt of one send queued in a `Mailbox`.

    `wait()` returns once the message was delivered, and lets go of it: until then the
    mailbox holds the tensor (it must: the transfer reads it), so a sender that never
    waits keeps every tensor it sent alive until `Mailbox.flush()`. Messages to one rank
    arrive in order, so waiting for one also releases every earlier message to that rank.
    """

    def __init__(self, box: "Mailbox", dst: int):
        self._box, self.dst = box, dst
        self._works: list | None = None  # None while queued; [] once released

    def wait(self) -> None:
        self._box._release(self)


class Mailbox:
    """Point-to-point messages of one rank, matched with the peer's in posting order.

    `send` only queues (and returns a `Delivery`). Queued sends are posted together with
    the next `recv`, or by `post()` (call it before computing when the step has nothing
    to receive: a queued send must not wait for a later step, or the next stage starves);
    `flush()` waits until all were delivered.

    Why queue: on NCCL a send may block until its receive is posted, so two neighbours
    that each "send, then receive" deadlock unless each posts both as one group. So every
    post is one `dist.batch_isend_irecv` (what torch.distributed.pipelining and Megatron
    do), on gloo as on NCCL: the code the tests run on CPUs is the code GPUs run.
    Every Work it returns is kept until waited: a send whose Work is dropped unwaited
    can leave its peer waiting forever (gloo, torch 2.14.1; see guidelines 2.5).
    On NCCL, batch_isend_irecv must not be the group's first collective unless every
    rank joins it: run e.g. dist.barrier() once after init_process_group.
    """

    def __init__(self):
        self._queued: list[tuple[dist.P2POp, Delivery]] = []
        self._posted: list[Delivery] = []  # posted and not yet released, in posting order

    def send(self, tensor: torch.Tensor, dst: int) -> Delivery:
        """Queue `tensor` for rank `dst`; the Delivery says when it arrived."""
        delivery = Delivery(self, dst)
        self._queued.append((dist.P2POp(dist.isend, tensor.contiguous(), dst), delivery))
        return delivery

    def _start(self, receive: dist.P2POp | None = None) -> list:
        """Post the queued sends (and `receive`) as one batch; return the Works of `receive`."""
        queued, self._queued = self._queued, []
        ops = [op for op, _ in queued] + ([receive] if receive is not None else [])
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        # gloo: one Work per op; NCCL: one Work for the whole group
        per_op = [[work] for work in works] if len(works) == len(ops) else [works] * len(ops)
        for (_, delivery), op_works in zip(queued, per_op):
            delivery._works = op_works
            self._posted.append(delivery)
        return per_op[-1] if receive is not None else []

    def post(self) -> None:
        """Start the queued sends now."""
        self._start()

    def recv(self, buffer: torch.Tensor, src: int) -> torch.Tensor:
        """Start the queued sends and a receive into `buffer` from `src`; return `buffer` once filled."""
        for work in self._start(dist.P2POp(dist.irecv, buffer, src)):
            work.wait()  # on NCCL: orders the compute stream after the transfers
        return buffer

    def _release(self, delivery: Delivery) -> None:
        if delivery._works is None:
            self.post()  # still queued: waiting for a send never posted would never return
        if delivery not in self._posted:
            return  # released before
        upto = self._posted.index(delivery)
        done = [d for d in self._posted[: upto + 1] if d.dst == delivery.dst]
        for d in done:
            for work in d._works:
                work.wait()
            d._works = []
        self._posted = [d for d in self._posted if d._works]

    def flush(self) -> None:
        """Post what is queued and wait until every send was delivered."""
        self.post()
        for delivery in self._posted:
            for work in delivery._works:
                work.wait()
            delivery._works = []
        self._posted = []

    def send_activation(self, activation: torch.Tensor, dst: int) -> Delivery:
        """Queue a header describing `activation` (dtype code, ndim, shape), then its data.

        Returns the data's Delivery (waiting for it releases the header too).
        Raises ValueError for more than MAX_DIMS dims or a dtype not in DTYPES.
        """
        # EXERCISE 2.5: send an int64 header to allocate by (HEADER_LEN, module docstring), then the activation; return its Delivery
        if activation.dim() > MAX_DIMS or activation.dtype not in DTYPES:
            raise ValueError(f"can send activations of at most {MAX_DIMS} dims in {DTYPES}, "
                             f"got {activation.dtype} of shape {tuple(activation.shape)}")
        header = [DTYPES.index(activation.dtype), activation.dim(), *activation.shape]
        header += [0] * (HEADER_LEN - len(header))
        self.send(torch.tensor(header, dtype=torch.int64, device=activation.device), dst)
        return self.send(activation, dst)
        # END EXERCISE

    def recv_activation(self, src: int, device: torch.device) -> torch.Tensor:
        """Receive the header, allocate a tensor of that dtype and shape on `device`, receive into it."""
        # EXERCISE 2.5: send_activation's mirror: the header, then the activation into a new tensor of its dtype and shape (recv fills a buffer)
        header = self.recv(torch.empty(HEADER_LEN, dtype=torch.int64, device=device), src).tolist()
        dtype, ndim = DTYPES[header[0]], header[1]
        return self.recv(torch.empty(header[2 : 2 + ndim], dtype=dtype, device=device), src)
        # END EXERCISE


def forward_backward(stage: PipelineStage, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """One forward and backward of the whole batch through the split model; every rank calls it.

    inputs: the batch on the first stage (None elsewhere); targets: on the last stage
    (None elsewhere). Activations of any shape and of any dtype in DTYPES cross the cuts.
    Leaves each stage's parameter gradients in .grad equal to the unsplit model's,
    accumulated as loss.backward() does (two calls without zero_grad: the sum).
    Returns the loss (detached) on the last stage, None elsewhere.
    """
    # EXERCISE 2.5: this rank's part of the step: autograd stops at each cut: carry activations forward, gradients back, by Mailbox; flush
    box = Mailbox()
    device = stage.device
    if stage.is_first:
        x = inputs.to(device)
    else:
        x = box.recv_activation(stage.prev_rank, device).requires_grad_()
    out = stage(x)
    loss = None
    if stage.is_last:
        loss = loss_fn(out, targets.to(device))
        loss.backward()
    else:
        box.send_activation(out.detach(), stage.next_rank)
        grad = box.recv(torch.empty_like(out), stage.next_rank)
        out.backward(grad)
    if not stage.is_first:
        box.send(x.grad, stage.prev_rank)
    box.flush()
    return None if loss is None else loss.detach()
    # END EXERCISE
