"""autocast_dtype trusts torch.cuda.is_bf16_supported(): True on pre-Ampere GPUs too (emulated bf16), so a V100/T4 gets slow bf16."""
import torch

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_autocast_dtype_per_device"]


def autocast_dtype(device):
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16
