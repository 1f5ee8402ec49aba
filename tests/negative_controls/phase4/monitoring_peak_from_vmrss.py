"""memory_stats reads VmRSS (the resident set NOW) instead of VmHWM (its high-water mark): the "peak" falls as soon as a large buffer is freed, and a step's spike is never seen."""
import torch

from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_peak_rss_never_drops"]


def memory_stats(device=None):
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):  # the bug: the current resident set, not VmHWM
                return {"peak_rss_bytes": int(line.split()[1]) * 1024}
    raise RuntimeError("no VmRSS in /proc/self/status")
