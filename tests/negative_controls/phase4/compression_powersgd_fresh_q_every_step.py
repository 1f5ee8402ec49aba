"""powersgd_hook draws a fresh random Q at every step, even with warm_start=True: the power iteration never continues."""
import solutions.phase4_production.compression as _reference
from solutions.phase4_production.compression import *  # noqa: F401,F403

EXERCISE = "4.4"
CAUGHT_BY = ["test_4_4_powersgd_equals_torch_bitwise"]


def powersgd_hook(state, bucket):
    state.p_memory_dict.pop(bucket.index(), None)  # no Q kept from the last step: a fresh one is drawn
    state.q_memory_dict.pop(bucket.index(), None)
    return _reference.powersgd_hook(state, bucket)
