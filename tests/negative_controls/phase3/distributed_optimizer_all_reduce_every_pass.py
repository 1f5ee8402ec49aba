"""The hook launches an all-reduce on every backward pass, not only on the last of the step: k times the
traffic, and each all-reduce writes into a .grad that the next backward pass is accumulating into (a race:
the result depends on when each all-reduce lands)."""
from solutions.phase3_multi_node import distributed_optimizer as _reference
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_no_communication_before_the_last_pass"]
WORLD_TIMEOUT = 15  # the shared world of its test takes seconds; a case hangs with this mistake: ended after 15 s, not 60


class DistributedOptimizer(_reference.DistributedOptimizer):
    def _on_grad_ready(self, param):
        self._passes[param] += 1
        self._launch(param)
