"""Each micro-batch's mean loss is backpropagated as is, not divided by the number of micro-batches: the accumulated gradient is m times too large."""
import time

import torch

from solutions.phase2_advanced.model_split import Mailbox
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_actions

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_gpipe_matches_one_process", "test_2_6_1f1b_matches_one_process"]


def run_pipeline(actions, stage, microbatch_inputs, microbatch_targets, loss_fn, trace=None):
    num_microbatches = _check_actions(actions)  # noqa: F841 - counted, then never used to scale the loss
    box, device = Mailbox(), stage.device
    inputs, outputs, losses = {}, {}, {}
    for kind, j in actions:
        if kind == "F":
            if stage.is_first:
                x = microbatch_inputs[j].to(device)
            else:
                x = box.recv_activation(stage.prev_rank, device).requires_grad_()
        else:
            x, out = inputs.pop(j), outputs.pop(j)  # dropped after this backward: memory freed
            grad = None if stage.is_last else box.recv(torch.empty_like(out), stage.next_rank)
        box.post()  # sends queued by the previous action leave now if this one received nothing
        start = time.perf_counter()
        if kind == "F":
            out = stage(x)
            if stage.is_last:
                losses[j] = loss_fn(out, microbatch_targets[j].to(device))
            inputs[j], outputs[j] = x, out
        elif stage.is_last:
            losses[j].backward()
        else:
            out.backward(grad)
        end = time.perf_counter()
        if kind == "F" and not stage.is_last:
            box.send_activation(out.detach(), stage.next_rank)
        if kind == "B" and not stage.is_first:
            box.send(x.grad, stage.prev_rank)
        if trace is not None:
            trace.append((kind, j, start, end))
    box.flush()
    return torch.stack(list(losses.values())).mean().detach() if stage.is_last else None
