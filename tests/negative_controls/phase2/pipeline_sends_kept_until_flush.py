"""The Deliveries of the sends are never waited for: the mailbox holds every activation sent until the final flush, so 1F1B's memory on stage 0 grows with m like GPipe's."""
import torch

from solutions.phase2_advanced.model_split import Mailbox
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_actions

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_1f1b_memory_does_not_grow_with_m"]


def run_pipeline(actions, stage, microbatch_inputs, microbatch_targets, loss_fn):
    num_microbatches = _check_actions(actions, f"stage {stage.stage_id}")
    box, device = Mailbox(), stage.device
    held = {}  # j -> (input, output) of F(j), kept until B(j)
    losses, total = {}, []  # last stage: j -> loss(j) / m until B(j); the detached losses
    sent = {}  # j -> Delivery of F(j)'s activation: it surely arrived once dL/d(activation) came back
    grad_sent = None  # Delivery of the last input gradient sent back (one in flight, as torch's Schedule1F1B)

    def forward(j: int) -> None:  # a function: its locals die with it, so no micro-batch outlives its B
        if stage.is_first:
            x = microbatch_inputs[j].to(device)
        else:
            x = box.recv_activation(stage.prev_rank, device).requires_grad_()
        box.post()  # sends queued by the previous action leave now if this one received nothing
        out = stage(x)
        if stage.is_last:
            losses[j] = loss_fn(out, microbatch_targets[j].to(device)) / num_microbatches
        else:
            sent[j] = box.send_activation(out.detach(), stage.next_rank)
        held[j] = (x, out)

    def backward(j: int) -> None:
        nonlocal grad_sent
        x, out = held.pop(j)
        if stage.is_last:
            box.post()
            loss = losses.pop(j)
            loss.backward()
            total.append(loss.detach())
        else:
            grad = box.recv(torch.empty_like(out), stage.next_rank)  # posts the queued sends too
            out.backward(grad)
        if not stage.is_first:
            grad_sent = box.send(x.grad, stage.prev_rank)

    for kind, j in actions:
        if kind == "F":
            forward(j)
        else:
            backward(j)
    box.flush()
    return torch.stack(total).sum() if stage.is_last else None
