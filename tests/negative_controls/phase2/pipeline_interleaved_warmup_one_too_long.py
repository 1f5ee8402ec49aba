"""Interleaved 1F1B with a warm-up of 2(p-r-1) + (v-1)p + 1 forwards, one more than Megatron's: rank r holds one chunk's activations more than the schedule needs, above the stated bound min(2(p-r-1) + (v-1)p + 1, v*m)."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_settings

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_bubble_and_in_flight_interleaved"]


def interleaved_schedule(num_ranks, num_microbatches, num_chunks):
    _check_settings(num_ranks, num_microbatches, num_chunks, names=("num_ranks", "num_microbatches", "num_chunks"))
    if num_microbatches % num_ranks:
        raise ValueError(f"m = {num_microbatches} is not a multiple of p = {num_ranks}")
    p, v = num_ranks, num_chunks
    schedule = []
    for rank in range(p):
        def order(i, kind):
            chunk = (i // p) % v
            return (kind, (i // (p * v)) * p + i % p, (chunk if kind == "F" else v - 1 - chunk) * p + rank)

        count = v * num_microbatches
        warmup = min(2 * (p - rank - 1) + (v - 1) * p + 1 if v > 1 else p - rank, count)
        actions = [order(i, "F") for i in range(warmup)]
        for i in range(count - warmup):
            actions += [order(warmup + i, "F"), order(i, "B")]
        actions += [order(i, "B") for i in range(count - warmup, count)]
        schedule.append(actions)
    return schedule
