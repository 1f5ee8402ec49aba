"""peak_flops takes the first row whose parts occur anywhere in the name: "NVIDIA L40" matches the L4 row
(MFU 1.5x too high) and "NVIDIA GH200 480GB" the H200 row, so the GH200 row is never used."""
from solutions.phase4_production.monitoring import *  # noqa: F401,F403

EXERCISE = "4.5"
CAUGHT_BY = ["test_4_5_mfu_and_peak_lookup"]


def peak_flops(device_name):
    name = device_name.upper()
    for parts, flops in PEAK_BF16_FLOPS:
        if all(part in name for part in parts):
            return flops
    return None
