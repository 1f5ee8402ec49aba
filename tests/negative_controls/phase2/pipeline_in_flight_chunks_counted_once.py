"""max_in_flight counts a micro-batch once however many of the rank's chunks hold it (keyed by micro-batch, not by (stage, micro-batch)): F0 on chunk 0 and F0 on chunk 1 look like one micro-batch's activations, and interleaved 1F1B's memory is underestimated."""
from solutions.phase2_advanced.pipeline import *  # noqa: F401,F403

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_max_in_flight_counts_each_chunk_interleaved"]


def max_in_flight(actions):
    split = {a[1] for a in actions if a[0] == "W"}
    alive, peak = set(), 0
    for action in actions:
        if action[0] == "F":
            alive.add(action[1])
        elif action[0] == "W" or action[1] not in split:
            alive.discard(action[1])
        peak = max(peak, len(alive))
    return peak
