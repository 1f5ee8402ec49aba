"""Interleaved 1F1B with each rank's chunks contiguous (rank r holds virtual stages r*v .. r*v+v-1) instead of round-robin (r, r+p, ...): a micro-batch crosses each rank once, so nothing interleaves; the schedule names stages the ranks do not hold."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403
from solutions.phase2_advanced.pipeline import interleaved_schedule as _interleaved_schedule

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_schedule_runs_every_action_once_interleaved", "test_2_6_matches_one_process_interleaved"]


def interleaved_schedule(num_ranks, num_microbatches, num_chunks):
    schedule = _interleaved_schedule(num_ranks, num_microbatches, num_chunks)
    return [[(kind, j, rank * num_chunks + k // num_ranks) for kind, j, k in actions]
            for rank, actions in enumerate(schedule)]
