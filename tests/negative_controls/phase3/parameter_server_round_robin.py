"""Parameters are dealt to the servers round-robin, whatever their size: the server that gets the
embedding table carries almost all the bytes (max/min load ratio far from 1)."""
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_greedy_assignment_balances_bytes"]


def assign_parameters(sizes, num_servers):
    return [i % num_servers for i in range(len(sizes))]
