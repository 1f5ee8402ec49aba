"""Interleaved 1F1B whose backwards visit the chunks in the forwards' order (chunk 0 first) instead of reversed: the backward of micro-batch 0 on stage 0 waits for stage 1, ..., for stage p on rank 0, which comes later in rank 0's own list: the virtual-stage order deadlocks."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import _check_settings

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_schedule_runs_every_action_once_interleaved", "test_2_6_bubble_and_in_flight_interleaved"]


def interleaved_schedule(num_ranks, num_microbatches, num_chunks):
    _check_settings(num_ranks, num_microbatches, num_chunks, names=("num_ranks", "num_microbatches", "num_chunks"))
    if num_microbatches % num_ranks:
        raise ValueError(f"m = {num_microbatches} is not a multiple of p = {num_ranks}")
    p, v = num_ranks, num_chunks
    schedule = []
    for rank in range(p):
        def order(i, kind):
            return (kind, (i // (p * v)) * p + i % p, ((i // p) % v) * p + rank)  # the same chunk order both ways

        count = v * num_microbatches
        warmup = min(2 * (p - rank - 1) + (v - 1) * p if v > 1 else p - rank - 1, count)
        actions = [order(i, "F") for i in range(warmup)]
        for i in range(count - warmup):
            actions += [order(warmup + i, "F"), order(i, "B")]
        actions += [order(i, "B") for i in range(count - warmup, count)]
        schedule.append(actions)
    return schedule
