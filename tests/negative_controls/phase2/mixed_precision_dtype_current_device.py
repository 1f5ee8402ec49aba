"""autocast_dtype calls is_bf16_supported(including_emulation=False), which asks the CURRENT device, not the one given."""
import torch

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_autocast_dtype_per_device"]


def autocast_dtype(device):
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16
