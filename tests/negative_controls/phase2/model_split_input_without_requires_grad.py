"""The received activation is used as a plain tensor (no requires_grad_()): autograd computes no gradient for it, so there is nothing to send back."""
import torch

from solutions.phase2_advanced.model_split import *  # noqa: F401,F403
from solutions.phase2_advanced.model_split import Mailbox

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_split_model_matches_one_process"]


def forward_backward(stage, inputs, targets, loss_fn):
    box = Mailbox()
    device = stage.device
    x = inputs.to(device) if stage.is_first else box.recv_activation(stage.prev_rank, device)
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
