"""The backward-pass counts start again only in the wrapper's zero_grad(), not at step(): a loop that clears gradients with model.zero_grad() takes the next step's first pass for pass k+1."""
from solutions.phase3_multi_node import distributed_optimizer as _reference
from solutions.phase3_multi_node.distributed_optimizer import *  # noqa: F401,F403

EXERCISE = "3.5"
CAUGHT_BY = ["test_3_5_accumulation_matches_one_big_batch"]


class DistributedOptimizer(_reference.DistributedOptimizer):
    def synchronize(self):
        self._launch_in_order(everything=True)
        divisor = _reference._world_size(self.group) * self.backward_passes_per_step
        for p, work in self._pending:
            if work is not None:
                work.wait()
            if divisor > 1:
                p.grad.div_(divisor)
        self._pending.clear()
        self._launched = 0  # the bug: self._passes is left as it is (zero_grad() resets it)
