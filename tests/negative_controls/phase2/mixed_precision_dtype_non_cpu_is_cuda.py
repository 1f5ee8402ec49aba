"""autocast_dtype takes every device that is not the CPU for a CUDA GPU and asks torch.cuda about it: any other device fails."""
import torch

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_autocast_dtype_per_device"]


def autocast_dtype(device):
    device = torch.device(device)
    if device.type == "cpu":
        return torch.bfloat16
    return torch.float16 if torch.cuda.get_device_capability(device)[0] < 8 else torch.bfloat16
