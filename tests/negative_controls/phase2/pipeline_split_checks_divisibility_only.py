"""split_microbatches checks only that m divides the batch: m = -5 divides 10, and the chunking fails with a RuntimeError instead of the ValueError the docstring promises."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_invalid_settings_raise_value_error"]


def split_microbatches(batch, num_microbatches):
    if len(batch) % num_microbatches:
        raise ValueError(f"a batch of {len(batch)} does not split into {num_microbatches} equal micro-batches")
    return list(batch.chunk(num_microbatches))
