"""memory_stats reports ru_maxrss as bytes, but on Linux ru_maxrss is in KiB: the peak RSS is 1024 times too small."""
import resource

import torch

from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_memory_stats"]


def memory_stats(device=None):
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
