"""broadcast_parameters and broadcast_optimizer_state always broadcast from rank 0, whatever `root_rank` says: every rank ends equal, the root included, so only a comparison with what the root held before the call shows it."""
from solutions.phase3_multi_node import distributed_optimizer as _reference
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_broadcast_parameters", "test_3_5_broadcast_optimizer_state_of_trained_optimizers"]


def broadcast_parameters(params, root_rank=0, group=None):
    _reference.broadcast_parameters(params, root_rank=0, group=group)  # the bug: root_rank dropped


def broadcast_optimizer_state(optimizer, root_rank=0, group=None):
    _reference.broadcast_optimizer_state(optimizer, root_rank=0, group=group)  # the bug: root_rank dropped
