"""The synchronous server answers each worker as soon as its gradient arrives, before the round's
step: the worker pulls the parameters of before the step and computes its next gradient on them."""
from solutions.phase3_multi_node import parameter_server as _reference
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_sync_equals_single_process_sgd"]
WORLD_TIMEOUT = 15  # its world takes about a second; the early reply is a race that can also hang (61 s of a CI run at 60)


class ParameterServer(_reference.ParameterServer):
    def on_push_sync(self, worker, version, grad):
        self.staleness.append((worker, self.version - version))
        self.grad_sum += grad
        self.pushed.append(worker)
        self.reply(worker)  # pulled before the server stepped
        if set(self.pushed) >= self.active:
            self.shard.add_(self.grad_sum, alpha=-self.lr / len(self.pushed))
            self.version += 1
            self.grad_sum.zero_()
            self.pushed = []
