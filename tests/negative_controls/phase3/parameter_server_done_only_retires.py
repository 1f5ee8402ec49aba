"""A DONE only removes the worker from the active set: a sync round that was waiting for nobody but the
finished worker never steps, and a reply held back by the staleness bound because of the finished worker is
never sent, so workers with more batches than another wait forever."""
import torch
import torch.distributed as dist

from solutions.phase3_multi_node import parameter_server as _reference
from solutions.phase3_multi_node.parameter_server import *  # noqa: F401,F403
from solutions.phase3_multi_node.parameter_server import DONE, HEADER_TAG, PS_DEVICE, PULL, PUSH, ServerRecord

EXERCISE = "3.4"
CAUGHT_BY = ["test_3_4_done_completes_a_round_and_releases_a_held_worker"]
WORLD_TIMEOUT = 15  # its test's world takes about a second; the deadlock is caught after 15 s, not 60


class ParameterServer(_reference.ParameterServer):
    def serve(self):
        while self.active:
            header = torch.empty(2, dtype=torch.int64, device=PS_DEVICE)
            worker = dist.recv(header, src=None, group=self.group, tag=HEADER_TAG)
            kind, version = header.tolist()
            if kind == PULL:
                self.reply(worker)
            elif kind == PUSH:
                grad = torch.empty_like(self.shard)
                dist.recv(grad, src=worker, group=self.group, tag=_reference.DATA_TAG)
                (self.on_push_sync if self.mode == "sync" else self.on_push_async)(worker, version, grad)
            elif kind == DONE:
                self.active.discard(worker)  # the bug: nothing else may now complete
        for works in self.sending.values():
            for work, _ in works:
                work.wait()
        values = self.shard.split([shape.numel() for shape in self.shapes])
        return ServerRecord({i: v.view(shape).clone() for i, v, shape in zip(self.owned, values, self.shapes)},
                            self.version, self.staleness)
