"""mixed_precision_step casts the model to bf16 (model.to(dtype)) instead of autocasting: no fp32 master weights."""
import torch
import torch.nn.functional as F

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_bf16_step_keeps_fp32_master_weights"]


def mixed_precision_step(model, optimizer, scaler, inputs, targets, device):
    dtype = autocast_dtype(device)
    model.to(dtype)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs.to(dtype)).float(), targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()
