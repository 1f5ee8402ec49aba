"""mixed_precision_step never zeroes the gradients: every step adds the previous steps' gradients in."""
import torch
import torch.nn.functional as F

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_each_step_uses_only_its_own_gradients"]


def mixed_precision_step(model, optimizer, scaler, inputs, targets, device):
    device = torch.device(device)
    with torch.autocast(device_type=device.type, dtype=autocast_dtype(device)):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float(), targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()
