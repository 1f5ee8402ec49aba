"""autocast_dtype asks the capability of GPU 0 whatever the device: wrong for cuda:1 on a node with mixed GPUs."""
import torch

from solutions.phase2_advanced.mixed_precision import *  # noqa: F401,F403

EXERCISE = "2.2"
CAUGHT_BY = ["test_2_2_autocast_dtype_per_device"]


def autocast_dtype(device):
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(0)[0] < 8:
        return torch.float16
    return torch.bfloat16
