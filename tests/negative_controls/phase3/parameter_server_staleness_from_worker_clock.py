"""Staleness is measured from the worker's own step count (its clock) instead of the version of
the parameters it computed on: server version - steps of this worker, which counts the other
workers' gradients even when they were already in the parameters the worker used."""
from solutions.phase3_multi_node import parameter_server as _reference
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_async_records_staleness"]


class ParameterServer(_reference.ParameterServer):
    def on_push_async(self, worker, version, grad):
        self.staleness.append((worker, self.version - self.clock[worker]))
        self.shard.add_(grad, alpha=-self.lr)
        self.version += 1
        self.clock[worker] += 1
        self.waiting.append(worker)
        self.release_waiting()
