r"""Exercise 3.4: parameter servers, synchronous, asynchronous (stale-synchronous) and load-balanced.

K server ranks own the parameters, a shard each; W worker ranks hold a replica of the model,
compute gradients on their own data, push them to the servers and pull fresh parameters:

      ranks 0..K-1   servers   server k keeps the parameters i with assignment[i] == k
      ranks K..K+W-1 workers   each step: gradient -> every server, parameters <- every server

        worker K        worker K+1       worker K+2          per step, server k receives W
          |  \  push g_k  /  |  \          /  |               gradients of its shard and sends
          |   \ pull w_k /   |   \        /   |               W copies of it: 2 W S_k bytes,
        server 0 (shard 0)              server 1 (shard 1)   the "hot spot" of the design

Modes (`mode=`):
  "sync"   a server waits for one gradient from every active worker, averages them, steps once
           (version += 1) and only then answers them all: W workers with batch B each compute
           exactly SGD on the concatenated batch of W*B samples.
  "async"  a server applies each gradient on arrival, w <- w - lr*g, and answers that worker
           at once: version += 1 per gradient. The gradient was computed on an older version;
           staleness = server version at arrival - version the worker computed on.
           `staleness_bound=s` (stale-synchronous parallel): a worker is not answered while it
           is more than s steps ahead of the slowest active worker (s=0: lock-step rounds).

Messages, all point-to-point on a gloo group (torch.distributed, no RPC):
  worker -> server   header int64 [kind, version] (tag HEADER_TAG), kind PULL, PUSH or DONE;
                     version: that server's version the worker last received (0 before its first
                     pull), i.e. the one a PUSH's gradient was computed on; servers read it in a
                     PUSH only (staleness);
                     a PUSH is followed by the flat gradient of the server's shard (DATA_TAG)
  server -> worker   int64 [version] (HEADER_TAG), then the flat shard (DATA_TAG)
Flat shards and gradients are in the parameters' dtype (what `flatten` gives: float32 here).
Every receive buffer has exactly the dtype and the number of elements of what is sent: gloo
(torch 2.14.1) copies a message into a larger buffer, or one of another dtype, without an
error, reinterpreting its bytes.
A server serves workers in arrival order: it receives the next header from ANY source
(`dist.recv(header, src=None)`, which gloo supports and NCCL does not), then the rest
from that worker. Every reply is an isend: on gloo (torch 2.14.1) a blocking `dist.send`
returns only once the peer has posted its receive, and a server blocked on one worker
while that worker pushes to another server can close a cycle (phase3 guidelines, 3.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

PULL, PUSH, DONE = 0, 1, 2
HEADER_TAG, DATA_TAG = 1, 2
# The parameter-server traffic runs on gloo (receive-from-any-source), whose point-to-point
# messages live in host memory: servers keep their shards there, as PS hosts do; a worker's
# model may sit on a GPU and is copied through this device.
PS_DEVICE = torch.device("cpu")


# ------------------------------------------------------------ which server owns what


def assign_parameters(sizes: list[int], num_servers: int) -> list[int]:
    """Greedy largest-first bin packing: the server of each parameter, balancing bytes.

    sizes[i]: bytes (or elements) of parameter i. Parameters are placed in order of
    decreasing size (equal sizes: lower index first), each on the server with the least
    load so far (equal loads: lower server index). Returns assignment[i] in 0..num_servers-1.
    """
    raise NotImplementedError("TODO 3.4: assignment[i] = parameter i's server: largest first, to the least-loaded server, ties as documented; see sorted's key")


def round_robin(sizes: list[int], num_servers: int) -> list[int]:
    """Parameter i on server i % num_servers, whatever its size (the naive assignment)."""
    return [i % num_servers for i in range(len(sizes))]


def server_loads(sizes: list[int], assignment: list[int], num_servers: int) -> list[int]:
    """Total size each server owns under `assignment`."""
    loads = [0] * num_servers
    for size, server in zip(sizes, assignment):
        loads[server] += size
    return loads


def load_ratio(loads: list[int]) -> float:
    """max / min load: 1.0 is perfect balance; inf when a server owns nothing."""
    return max(loads) / min(loads) if min(loads) > 0 else float("inf")


def shard_of(assignment: list[int], server: int) -> list[int]:
    """Indices of the parameters `server` owns, in parameter order (its flat layout)."""
    return [i for i, owner in enumerate(assignment) if owner == server]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat float tensor on PS_DEVICE holding `tensors` end to end (a copy)."""
    return torch.cat([t.detach().reshape(-1).to(PS_DEVICE) for t in tensors])


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat` (as laid out by `flatten`) back into `tensors`, on their own devices."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def ps_group():
    """The group the parameter-server messages travel on; call it on EVERY rank, first.

    gloo's world group as is; under NCCL a new gloo group of the same ranks (NCCL has no
    receive-from-any-source). Same ranks, same order: group rank = global rank.
    """
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


# ------------------------------------------------------------ the server


@dataclass
class ServerRecord:
    """What a server returns once every worker is done.

    params: index in the model's parameter list -> its final value (the server's shard).
    version: updates applied (sync: steps; async: gradients).
    staleness: (worker rank, staleness) of every gradient, in arrival order.
    """

    params: dict[int, torch.Tensor]
    version: int
    staleness: list[tuple[int, int]] = field(default_factory=list)


class ParameterServer:
    """Server rank k (< num_servers): owns shard_of(assignment, k) of `params`.

    params: the model's parameters (their initial values; the same list on every rank).
    Workers are the ranks num_servers..world_size-1 of `group`: None (the world) on gloo,
    ps_group() under NCCL. `serve()` answers them until each has sent DONE.
    """

    def __init__(self, params: list[torch.Tensor], assignment: list[int], num_servers: int, lr: float,
                 mode: str = "sync", staleness_bound: int | None = None, group=None):
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.group, self.lr, self.mode, self.bound = group, lr, mode, staleness_bound
        self.rank = dist.get_rank(group)
        self.owned = shard_of(assignment, self.rank)
        if not self.owned:
            raise ValueError(f"server {self.rank} owns no parameter: use fewer servers than parameters")
        self.shapes = [params[i].shape for i in self.owned]
        self.shard = flatten([params[i] for i in self.owned])  # this server's parameters, flat
        self.version = 0
        self.active = set(range(num_servers, dist.get_world_size(group)))  # workers not done yet
        self.clock = {w: 0 for w in self.active}  # gradients received from each worker
        self.staleness: list[tuple[int, int]] = []
        self.grad_sum = torch.zeros_like(self.shard)  # sync: the gradients of this round, summed
        self.pushed: list[int] = []  # sync: workers that pushed in this round
        self.waiting: list[int] = []  # async: workers whose reply is held back (staleness bound)
        self.sending: dict[int, list] = {}  # worker -> (work, tensor) of its reply in flight

    def reply(self, worker: int) -> None:
        """Send `worker` the current version and a snapshot of the shard (isend, never blocks)."""
        for work, _ in self.sending.pop(worker, []):
            work.wait()  # the previous reply (the worker has received it: it pushed since)
        version = torch.tensor([self.version], dtype=torch.int64, device=PS_DEVICE)
        snapshot = self.shard.clone()  # the shard changes while the send is in flight
        self.sending[worker] = [(dist.isend(version, worker, self.group, tag=HEADER_TAG), version),
                                (dist.isend(snapshot, worker, self.group, tag=DATA_TAG), snapshot)]

    def serve(self) -> ServerRecord:
        """Answer workers in arrival order until every worker has sent DONE; then return the record.

        PULL: reply now (whatever the mode). PUSH: receive the gradient, then on_push_sync or
        on_push_async. DONE: the worker is no longer active, and what waited for it may go on:
        sync, a round whose gradients now come from every active worker steps (step_round); a
        round with no gradient never steps (the version stays); async, the replies the bound held
        back are reconsidered (release_waiting: the slowest of the workers still active).
        """
        raise NotImplementedError('TODO 3.4: while workers are active: take a header from any worker, act on its kind (PULL, PUSH, DONE); then wait for all replies')
        values = self.shard.split([shape.numel() for shape in self.shapes])
        return ServerRecord({i: v.view(shape).clone() for i, v, shape in zip(self.owned, values, self.shapes)},
                            self.version, self.staleness)

    def on_push_sync(self, worker: int, version: int, grad: torch.Tensor) -> None:
        """A gradient of this round from `worker`; once every active worker has pushed: step_round()."""
        raise NotImplementedError("TODO 3.4: record staleness 0, add the gradient to the round's sum; once all active workers pushed, step_round(); no reply before")

    def step_round(self) -> None:
        """Sync: one SGD step with the mean of this round's gradients, then answer the round's workers."""
        raise NotImplementedError("TODO 3.4: one SGD step with the mean of the round's gradients (version + 1), answer the round's workers, start an empty round")

    def on_push_async(self, worker: int, version: int, grad: torch.Tensor) -> None:
        """Apply `grad` (computed on `version`) now; answer `worker` when the staleness bound allows."""
        raise NotImplementedError("TODO 3.4: record (worker, my version - the gradient's); apply it (SGD, version + 1, its clock + 1); it waits in release_waiting")

    def release_waiting(self) -> None:
        """Reply to each waiting worker that is at most `staleness_bound` steps ahead of the slowest active one."""
        raise NotImplementedError("TODO 3.4: no bound: answer every waiting worker; bound s: only those at most s steps above the slowest active worker's clock")


# ------------------------------------------------------------ the worker


def run_worker(model: torch.nn.Module, batches: Iterable[Any], loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
               assignment: list[int], num_servers: int, group=None) -> int:
    """Train `model` through the servers (ranks >= num_servers call this); returns the steps
    taken: the number of batches trained on (one push to every server each).

    First pull every shard (the servers' values replace the model's). Then per batch: clear
    the gradients (model.zero_grad(): each push is this batch's gradient alone, as one process's
    SGD steps), loss_fn(model, batch).backward(); push each server its shard of the gradient (a
    parameter without .grad pushes zeros) with the version of that shard the gradient was
    computed on; receive every server's answer (version, fresh shard) into the model.
    Finally tell every server DONE. Afterwards the model holds the last parameters pulled.
    Servers are ranks 0..num_servers-1 of `group` (as for ParameterServer).
    """
    raise NotImplementedError("TODO 3.4: pull, then per batch backward/push/pull, then DONE to every server; post a step's messages (isend/irecv) before waiting")
