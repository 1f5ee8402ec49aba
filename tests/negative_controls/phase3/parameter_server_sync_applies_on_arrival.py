"""The synchronous server applies each gradient as it arrives (W SGD steps per round, i.e. the sum
of the gradients, not their mean), and answers the workers only once the round is complete."""
from solutions.phase3_multi_node import parameter_server as _reference
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_sync_equals_single_process_sgd"]


class ParameterServer(_reference.ParameterServer):
    def on_push_sync(self, worker, version, grad):
        self.staleness.append((worker, self.version - version))
        self.shard.add_(grad, alpha=-self.lr)
        self.pushed.append(worker)
        if set(self.pushed) >= self.active:
            self.step_round()

    def step_round(self):
        self.version += 1
        for worker in self.pushed:
            self.reply(worker)
        self.pushed = []
