"""Passes are counted but never checked against k: a (k+1)-th backward before step() just accumulates one more
gradient into .grad, and step() divides the sum of k+1 passes by k."""
from solutions.phase3_multi_node import distributed_optimizer as _reference
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_extra_backward_pass_before_step_raises"]


class DistributedOptimizer(_reference.DistributedOptimizer):
    def _on_grad_ready(self, param):
        self._passes[param] += 1  # the bug: no RuntimeError past backward_passes_per_step
        if self._passes[param] == self.backward_passes_per_step:
            self._launch_in_order()
