"""Under torchrun the node and local rank are worked out from RANK and LOCAL_WORLD_SIZE; GROUP_RANK and
LOCAL_RANK are never read, so variables that contradict RANK go unnoticed."""
import os

from solutions.phase3_multi_node.hierarchical import *  # noqa: F401,F403

EXERCISE = "3.3"
CAUGHT_BY = ["test_3_3_contradicting_torchrun_variables_refused"]


def topology_from_env(ranks_per_node=None):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    size = ranks_per_node if ranks_per_node is not None else int(os.environ["LOCAL_WORLD_SIZE"])
    if size < 1 or world % size:
        raise ValueError(f"{world} ranks do not make nodes of {size}")
    node, local = divmod(rank, size)  # the bug: torchrun's own GROUP_RANK / LOCAL_RANK ignored
    return Topology(rank, node, local, world // size, size)  # noqa: F405
