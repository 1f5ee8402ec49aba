"""Staleness is recorded as (version the worker computed on - server version): the wrong sign,
so every stale gradient shows a negative staleness."""
from solutions.phase3_multi_node import parameter_server as _reference
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_async_records_staleness"]


class ParameterServer(_reference.ParameterServer):
    def on_push_async(self, worker, version, grad):
        self.staleness.append((worker, version - self.version))
        self.shard.add_(grad, alpha=-self.lr)
        self.version += 1
        self.clock[worker] += 1
        self.waiting.append(worker)
        self.release_waiting()
