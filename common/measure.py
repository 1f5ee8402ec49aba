"""Measuring what distributed code does, in one place: used by tests and benchmarks,
never inside an exercise (an exercise file holds its idea, not its instruments).

Each section below serves one kind of question:
  * collectives and bytes   which collectives a rank called, with how many bytes, how
                            long they took, and a training step's compute vs communication
  * saved activations       bytes autograd keeps for backward (saved-tensor hooks)
  * tensors held            bytes of the distinct storages an object keeps alive
  * pipeline timelines      a schedule's time grid as text; what a pipeline stage
                            computes (when), posts (in which order) and holds (bytes)
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from common.split import balanced_ranges

# ------------------------------------------------------ collectives and bytes

# collective -> the parameter holding what this rank contributes (its message).
_MESSAGE_ARG = {
    "all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor",
    "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
    "all_to_all_single": "input", "gather": "tensor", "scatter": "scatter_list",
    "send": "tensor", "recv": "tensor", "isend": "tensor", "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list", "barrier": None,
    # the newer names (torch 2.14.1 has them); the old ones above are now deprecated aliases that call them.
    "all_gather_single": "input_tensor", "reduce_scatter_single": "input",
}
# A call under a new name is recorded under the old, familiar one.
_RECORDED_AS = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
# collective -> the parameter naming the other rank: destination or source (a global rank).
_PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src", "broadcast": "src",
             "reduce": "dst", "gather": "dst", "scatter": "src"}


@dataclass
class Call:
    """One call of a torch.distributed function, as the calling rank saw it.

    `numel`/`nbytes`: size of the message this rank passed in (for all_gather the local
    input, for reduce_scatter the full input, for batch_isend_irecv the sum over ops);
    wire traffic depends on the algorithm and is the caller's to derive.
    `peer`: the other rank of a send/recv, the root of a broadcast/reduce/gather/scatter
    (None for the others, or when not given). `seconds`: time spent inside the call,
    measured only by `CollectiveLog(timed=True)`.
    """

    name: str
    numel: int
    nbytes: int
    dtype: torch.dtype | None
    group: object = None
    ops: list = field(default_factory=list)  # batch_isend_irecv: [(op name, peer, numel)]
    peer: int | None = None
    seconds: float = 0.0
    async_op: bool = False  # called with async_op=True (it returned a Work to wait on)


def _message_size(value) -> tuple[int, int, torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        return value.numel(), value.numel() * value.element_size(), value.dtype
    if isinstance(value, (list, tuple)):
        sizes = [_message_size(getattr(v, "tensor", v)) for v in value]
        dtype = next((d for _, _, d in sizes if d is not None), None)
        return sum(n for n, _, _ in sizes), sum(b for _, b, _ in sizes), dtype
    return 0, 0, None


def _on_cuda(value) -> bool:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return any(getattr(getattr(t, "tensor", t), "is_cuda", False) for t in tensors)


class CollectiveLog:
    """Record the torch.distributed calls made inside a `with` block (on this rank).

        with CollectiveLog() as log:
            model_step()
        log.names() == ["all_reduce", "all_reduce"]; log.bytes("all_reduce") == 4 * numel

    It replaces the functions on `torch.distributed` (and its distributed_c10d module, so
    code that imported them by name *after* the block began is seen too) and restores
    them on exit. `also_in`: modules whose globals may hold a watched function under any
    name (`from torch.distributed import all_reduce as ar`); those names are replaced too.
    `on_call(call)` runs before each call reaches torch (e.g. to sample memory at every
    collective). Calls are forwarded unchanged. `timed=True` records each call's wall
    time in `call.seconds` (waiting for a CUDA device before and after, so an
    asynchronous NCCL call is charged its real duration, not its launch); `seconds()` sums it.
    """

    def __init__(self, names=None, on_call: Callable[[Call], None] | None = None,
                 also_in: tuple = (), timed: bool = False):
        self.names_watched = list(names or _MESSAGE_ARG)
        self.names_watched += [new for new, old in _RECORDED_AS.items()  # watching a name watches its new name
                               if old in self.names_watched and new not in self.names_watched]
        self.on_call = on_call
        self.also_in = tuple(also_in)
        self.timed = timed
        self.calls: list[Call] = []
        self._saved: list[tuple[object, str, Callable]] = []
        self._depth = 0

    def _wrap(self, name: str, real: Callable) -> Callable:
        signature = inspect.signature(real)
        arg = _MESSAGE_ARG.get(name)

        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            numel, nbytes, dtype = _message_size(bound.get(arg)) if arg else (0, 0, None)
            peer = bound.get(_PEER_ARG[name]) if name in _PEER_ARG else None
            call = Call(_RECORDED_AS.get(name, name), numel, nbytes, dtype, bound.get("group"), peer=peer,
                        async_op=bool(bound.get("async_op", False)))
            if name == "batch_isend_irecv":
                call.ops = [(getattr(op.op, "__wrapped__", op.op).__name__, op.peer, op.tensor.numel())
                            for op in bound.get(arg, [])]
            if self._depth:  # called by another recorded function (batch_isend_irecv -> isend)
                return real(*args, **kwargs)
            self.calls.append(call)
            if self.on_call is not None:
                self.on_call(call)
            self._depth += 1
            cuda = self.timed and _on_cuda(bound.get(arg) if arg else None)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                call.seconds = time.perf_counter() - start if self.timed else 0.0
                self._depth -= 1

        recorded.__wrapped__ = real
        return recorded

    def __enter__(self) -> "CollectiveLog":
        c10d = dist.distributed_c10d
        for name in self.names_watched:
            real = getattr(dist, name, None)
            if real is None:  # not in this torch version
                continue
            wrapped = self._wrap(name, real)
            for module in (dist, c10d):
                if getattr(module, name, None) is real:
                    self._saved.append((module, name, real))
                    setattr(module, name, wrapped)
            for module in self.also_in:
                for alias, value in list(vars(module).items()):
                    if value is real:
                        self._saved.append((module, alias, real))
                        setattr(module, alias, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def count(self, name: str | None = None) -> int:
        return sum(1 for c in self.calls if name is None or c.name == name)

    def bytes(self, name: str | None = None) -> int:
        return sum(c.nbytes for c in self.calls if name is None or c.name == name)

    def seconds(self, name: str | None = None) -> float:
        """Wall time inside the recorded calls (needs `timed=True`)."""
        return sum(c.seconds for c in self.calls if name is None or c.name == name)

    def clear(self) -> None:
        self.calls.clear()


class StepTimes:
    """Where the time of data-parallel training steps goes, on every rank.

        times = StepTimes()
        for epoch ...:
            with times.loop():                  # the training loop (not evaluation)
                for inputs, targets in loader:
                    with times.step(len(inputs)):
                        train_step(...)
        times.summary()   # collective: call on every rank

    Communication = wall time inside torch.distributed calls during the loop (a
    `CollectiveLog(timed=True)`), which includes waiting for the slowest rank; compute =
    the rest of the step (forward, backward, optimizer). A step's end must wait for the
    device (train_step's `.item()` does), or GPU time would go uncounted.
    """

    def __init__(self) -> None:
        self.steps, self.samples = 0, 0
        self.step_s = self.comm_s = self.loop_s = 0.0
        self._log = CollectiveLog(timed=True)

    @contextmanager
    def loop(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self._log:
                yield
        finally:
            self.loop_s += time.perf_counter() - start
            self.comm_s += self._log.seconds()
            self._log.clear()

    @contextmanager
    def step(self, samples: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.step_s += time.perf_counter() - start
        self.steps += 1
        self.samples += samples

    def summary(self, device: torch.device | None = None) -> dict:
        """{"steps", "step_ms", "compute_ms", "comm_ms" (means over steps and ranks),
        "samples_per_s" (all ranks' samples / the slowest rank's loop time)}."""
        totals = torch.tensor([self.samples, self.step_s, self.comm_s], dtype=torch.float64, device=device)
        slowest = torch.tensor([self.loop_s], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        samples, step_s, comm_s = totals.tolist()
        per_step_ms = 1e3 / max(self.steps * dist.get_world_size(), 1)
        return {"steps": self.steps, "step_ms": step_s * per_step_ms, "comm_ms": comm_s * per_step_ms,
                "compute_ms": (step_s - comm_s) * per_step_ms,
                "samples_per_s": samples / slowest.item() if slowest.item() > 0 else 0.0}


def ring_elements_sent(call: Call, world_size: int) -> float:
    """Elements one rank sends for `call` under the bandwidth-optimal ring algorithms (N = world_size):

        all_reduce                      2(N-1)/N x the tensor
        reduce_scatter(_tensor|_single) (N-1)/N  x the full input
        all_gather(_into_tensor|_single) (N-1)   x the local input (= (N-1)/N x the output)
        anything else                   its whole message

    This counts the call the code makes, not what a backend does with it: gloo (torch
    2.14.1; loopback bytes measured on 2 ranks) runs reduce_scatter_tensor as an all-reduce,
    moving all-reduce's bytes.
    """
    n = world_size
    scatter, gather = (n - 1) / n, n - 1
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": scatter, "reduce_scatter_tensor": scatter,
              "reduce_scatter_single": scatter, "all_gather": gather, "all_gather_into_tensor": gather,
              "all_gather_single": gather}.get(call.name, 1.0)
    return factor * call.numel


@dataclass
class PointToPointOp:
    """One send or receive this rank posted: kind "send" or "recv", the other rank as a
    GLOBAL rank (None if not given), and the tensor itself (kept alive by the log)."""

    kind: str
    peer: int | None
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


_P2P_KIND = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class PointToPointLog(CollectiveLog):
    """A CollectiveLog that also lists every point-to-point op posted, in order, in `ops`.

        with PointToPointLog() as log:
            ring_all_reduce(x)
        [(op.kind, op.peer, op.nbytes) for op in log.ops]   # [("send", 1, 4000), ("recv", 3, 4000), ...]
        log.names()                                         # every torch.distributed call, as CollectiveLog

    send/isend/recv/irecv give one op each, batch_isend_irecv one per op in its list.
    Peers are global ranks whichever way they were given (dst/src, group_dst/group_src,
    a P2POp's peer or group_peer). The log holds the tensors, so storages stay alive
    and distinct while it exists: a buffer allocated at every step shows as many
    storages (`storage_key`), not as one address reused. With `on_op(kind, peer, tensor)`,
    each op goes to it as it is posted instead, and the log keeps no tensor alive.
    """

    def __init__(self, names=None, also_in: tuple = (),
                 on_op: Callable[[str, int | None, torch.Tensor], None] | None = None):
        super().__init__(names=names, also_in=also_in)
        self.ops: list[PointToPointOp] = []
        self.on_op = on_op

    def _wrap(self, name: str, real: Callable) -> Callable:
        recorded = super()._wrap(name, real)
        if name not in _P2P_KIND and name != "batch_isend_irecv":
            return recorded
        signature = inspect.signature(real)

        def seen(*args, **kwargs):
            if not self._depth:  # not called by another watched function (batch_isend_irecv -> isend)
                bound = signature.bind_partial(*args, **kwargs).arguments
                if name == "batch_isend_irecv":
                    posted = [PointToPointOp(_P2P_KIND[inspect.unwrap(op.op).__name__], op.peer, op.tensor)
                              for op in bound["p2p_op_list"]]  # P2POp.peer is global (torch 2.14.1)
                else:
                    kind = _P2P_KIND[name]
                    peer = bound.get("dst" if kind == "send" else "src")
                    group_peer = bound.get("group_dst" if kind == "send" else "group_src")
                    if peer is None and group_peer is not None:
                        group = bound.get("group")
                        peer = dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)
                    posted = [PointToPointOp(kind, peer, bound["tensor"])]
                if self.on_op is None:
                    self.ops += posted
                else:
                    for op in posted:
                        self.on_op(op.kind, op.peer, op.tensor)
            return recorded(*args, **kwargs)

        seen.__wrapped__ = real
        return seen


# ---------------------------------------------------------- saved activations


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this rank holds for `tensor`: a DTensor's local shard (`to_local()`,
    e.g. a parameter, gradient or optimizer state under torch's fully_shard), any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) and _is_dtensor(tensor) else tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor  # here: a plain tensor never pays for the import
    return isinstance(tensor, DTensor)


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """(device, address) of the memory block under `tensor` (a DTensor: under its local shard); None for a
    tensor without storage.

    A view and its base have the same key: they are one buffer in memory.
    """
    tensor = local_tensor(tensor)
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr())
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None


def distinct_storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages under `tensors`, each counted once and whole; `exclude`'s not at all.
    A DTensor counts the storage under its local shard (`local_tensor`): the bytes this rank holds."""
    excluded = {storage_key(t) for t in exclude}
    sizes = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in excluded:
            sizes[key] = local_tensor(t).untyped_storage().nbytes()
    return sum(sizes.values())


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = (),
                           count_if: Callable[[torch.Tensor], bool] | None = None) -> int:
    """Peak bytes of the tensors autograd holds for backward while `fn()` runs.

    Call it with a whole training step, e.g. `lambda: model(x).sum().backward()`. Every
    tensor autograd saves (save_for_backward, and what built-in ops save) passes through
    the pack hook of saved_tensors_hooks; it is counted from then until the graph drops it
    (the holder the hook returned is freed), so the result is the high-water mark over
    forward AND backward, recomputation included.

    * Each storage counts once, whole: a view and its base, or the ReLU output that the
      next Linear saves again as its input, are one buffer in memory.
    * Storages of `exclude` do not count. Pass the model's parameters: Linear saves its
      weight (to compute the input gradient), but parameters live in memory whether or
      not anything is saved, so they are not activation memory.
    * `count_if(tensor)`, if given, picks the saved tensors that count (e.g.
      `torch.is_floating_point`, to leave out a saved RNG state or index tensor).
    * Only what autograd saves is seen: temporaries that die inside forward, gradients,
      and anything a Function hides in ctx attributes instead of save_for_backward.
    """
    excluded = {storage_key(t) for t in exclude}
    live: dict[tuple, list] = {}  # storage key -> [bytes, number of saved references]
    current = peak = 0

    class Holder:
        def __init__(self, tensor: torch.Tensor, key: tuple | None):
            self.tensor, self.key = tensor, key

        def __del__(self):
            nonlocal current
            if self.key is not None:
                entry = live[self.key]
                entry[1] -= 1
                if entry[1] == 0:
                    current -= entry[0]
                    del live[self.key]

    def pack(tensor: torch.Tensor) -> Holder:
        nonlocal current, peak
        key = storage_key(tensor)
        if key is None or key in excluded or (count_if is not None and not count_if(tensor)):
            return Holder(tensor, None)
        if key not in live:
            live[key] = [tensor.untyped_storage().nbytes(), 0]
            current += live[key][0]
            peak = max(peak, current)
        live[key][1] += 1
        return Holder(tensor, key)

    def unpack(holder: Holder) -> torch.Tensor:
        return holder.tensor

    with saved_tensors_hooks(pack, unpack):
        fn()
    return peak


def predicted_saved_bytes(num_blocks: int, segments: int | None, checkpoint_bytes: int, block_bytes: int) -> int:
    """Peak saved bytes of num_blocks identical blocks, checkpointed in `segments` (None: not checkpointed).

    c = checkpoint_bytes: a block's input (a segment's checkpoint), which is the tensor
    the previous block saved as its output (or the stack's input). A = block_bytes: what
    one block saves besides its input, its output among them. Linear -> ReLU: c = A = one
    output; Linear(d, 4d) -> ReLU -> Linear(4d, d) -> ReLU: c = one output, A = 5 outputs.

    Not checkpointed: the input plus every block:      c + n * A.
    k segments (balanced_ranges): segment j's backward re-runs its m_j blocks while
    checkpoints 1..j are still held (later ones were freed by their own backward):

        peak = max over j of (j * c + m_j * A)  ~  k * c + (n/k) * A,
        least at k* = sqrt(n * A / c), capped at n.
    """
    if segments is None:
        return checkpoint_bytes + num_blocks * block_bytes
    ranges = balanced_ranges(num_blocks, segments, "blocks")
    return max(j * checkpoint_bytes + len(part) * block_bytes for j, part in enumerate(ranges, start=1))


# --------------------------------------------------------------- tensors held


def reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor `root` keeps alive through attributes, lists, tuples, sets and dicts (keys too).

    Plain Python objects are entered through their `__dict__` (e.g. an optimizer and the
    shard objects it keeps), and so are torch.optim optimizers (their state, and a wrapped
    one's, as in ZeroRedundancyOptimizer); an nn.Module is not entered (count a model
    through its parameters), nor are torch's other objects (process groups, hook handles). A
    leaf tensor's .grad is reachable through it (a shard the optimizer steps keeps its gradient
    there). A tensor held only by a closure or a local variable is not reachable, so it is not seen.
    """
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(vars(obj).values())
        elif isinstance(obj, torch.nn.Module) or type(obj).__module__.split(".")[0] == "torch":
            continue
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not inspect.ismodule(obj):
            stack.extend(vars(obj).values())
    return found


def module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """model.parameters(), then every tensor a module of `model` holds as a plain attribute (not a
    parameter nor a buffer): e.g. the full parameters a sharded module swaps in while a unit runs,
    as FSDP1 sets its unsharded views, and ZeRO-3 here."""
    found = list(model.parameters())
    for module in model.modules():
        found += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
    return found


def training_memory(model: torch.nn.Module, optimizer: object) -> dict[str, int]:
    """Bytes a rank holds for training right now, by kind; each storage counted once, whole.

        'params'     the storages under model.parameters() and under the tensors its modules
                     hold as plain attributes (module_tensors: a sharded model's gathered
                     parameters); a parameter that is a view of a flat buffer counts the
                     whole buffer, a freed (resized-to-0) one 0, a DTensor its local shard
        'grads'      the storages under their .grad (None: 0)
        'optimizer'  every other tensor `optimizer` keeps reachable (reachable_tensors):
                     shards of parameters and gradients, Adam's state, flat buffers
        'total'      the sum

    A storage shared by two kinds counts in the first (a .grad that is a view of a flat
    buffer the optimizer keeps is a gradient). Activations and temporaries are not here:
    sample this at the moments they matter, e.g. `CollectiveLog(on_call=...)`.
    """
    params = module_tensors(model)
    kinds = {"params": params, "grads": [p.grad for p in params if p.grad is not None],
             "optimizer": reachable_tensors(optimizer)}
    counted: list[torch.Tensor] = []
    result = {}
    for kind, tensors in kinds.items():
        result[kind] = distinct_storage_bytes(tensors, exclude=counted)
        counted += tensors
    result["total"] = sum(result.values())
    return result


class PeakBytes:
    """The largest value seen of each key of `measure()` (e.g. training_memory), and where.

        peak = PeakBytes(lambda: training_memory(model, optimizer))
        with CollectiveLog(on_call=lambda call: peak.sample(call.name)):
            loss.backward(); peak.sample("after backward"); optimizer.step()
        peak.peak["grads"], peak.where["grads"]
    """

    def __init__(self, measure: Callable[[], dict[str, int]]):
        self.measure = measure
        self.peak: dict[str, int] = {}
        self.where: dict[str, str] = {}

    def sample(self, where: str) -> dict[str, int]:
        now = self.measure()
        for key, value in now.items():
            if value > self.peak.get(key, -1):
                self.peak[key], self.where[key] = value, where
        return now


# ------------------------------------------------------------ operations run

# matrix products -> FLOPs (2 per multiply-add) from their operands' shapes
_PRODUCT_FLOPS = {
    "mm": lambda a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
    "bmm": lambda a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
    "addmm": lambda c, a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
    "baddbmm": lambda c, a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2],
}


class OpLog:
    """The torch operations run inside a `with` block, as the dispatcher sees them (on this
    thread, and on the autograd engine's threads during a backward started inside the block).

        with OpLog() as ops:
            out = attention(q, k, v); out.backward(grad)
        ops.largest     (bytes, shape, op name): the largest NEW buffer any operation made
        ops.flops       FLOPs of the matrix products (mm, bmm, addmm, baddbmm), 2 per multiply-add
        ops.names       every operation, in order ("aten.bmm.default", ...)

    Composite operations reach it decomposed (`q @ k.T`, einsum and F.linear arrive as
    mm / bmm / addmm), so the FLOPs count what a kernel computes. A view (transpose, expand)
    makes no buffer and does not count in `largest`. `on_op(name)` runs at each operation, e.g.
    to interleave them with a PointToPointLog's events. Not for timing: every operation passes
    through Python here.
    """

    def __init__(self, on_op: Callable[[str], None] | None = None):
        from torch.utils._python_dispatch import TorchDispatchMode  # here: plain imports stay cheap

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                log._seen(func, args, out)
                return out

        self.on_op = on_op
        self.names: list[str] = []
        self.flops = 0
        self.largest: tuple[int, tuple, str] = (0, (), "")
        self._mode = _Mode()

    def _seen(self, func, args, out) -> None:
        name = str(func)
        self.names.append(name)
        product = _PRODUCT_FLOPS.get(func.overloadpacket.__name__)
        if product is not None and func.namespace == "aten":
            self.flops += product(*args[:3 if func.overloadpacket.__name__.startswith(("addmm", "baddbmm")) else 2])
        if not func.is_view:
            outputs = out if isinstance(out, (list, tuple)) else [out]
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    nbytes = t.untyped_storage().nbytes()
                    if nbytes > self.largest[0]:
                        self.largest = (nbytes, tuple(t.shape), name)
        if self.on_op is not None:
            self.on_op(name)

    def __enter__(self) -> "OpLog":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


# --------------------------------------------------------- pipeline timelines


def render_timeline(grid: list[list[tuple | None]]) -> str:
    """Text picture of a pipeline time grid (grid[t][s] = (kind, microbatch), or None when
    stage s idles at step t): one row per stage, one column per step, '..' when idle.

        stage 0 | F0 F1 .. B1 B0

    Actions on virtual stages, (kind, microbatch, k), are drawn per rank with their chunk as a
    letter, k // p for p ranks (a = chunk 0: stages 0..p-1, b = chunk 1: p..2p-1, ...):

        rank 0  | F0a F1a F0b F1b .. B0b ..
    """
    if not grid:
        return ""
    p = len(grid[0])
    virtual = any(a is not None and len(a) > 2 for row in grid for a in row)
    labels = [[".." if a is None else f"{a[0]}{a[1]}" + (chr(ord("a") + a[2] // p) if len(a) > 2 else "")
               for a in row] for row in grid]
    width = max(len(label) for row in labels for label in row)
    return "\n".join((f"rank {s:<2}" if virtual else f"stage {s}") + " | "
                     + " ".join(row[s].ljust(width) for row in labels).rstrip() for s in range(p))


@dataclass
class Compute:
    """One forward ("F") or backward ("B") of a pipeline stage, timed with time.perf_counter().

    in_numel / out_numel: elements of the stage's input and output (forwards only).
    """

    kind: str
    start: float
    end: float
    in_numel: int = 0
    out_numel: int = 0


_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class StageRecorder:
    """What one pipeline stage computes, posts and holds while a `with` block runs (this rank).

        with StageRecorder(stage, exclude=input_microbatches) as rec:
            run_pipeline(actions, stage, input_microbatches, targets, loss_fn)
        rec.computes    [Compute("F", start, end, ...), Compute("B", ...), ...]  in order
        rec.events      [("F", 0), ("send", 1, 320), ("recv", 1, 320), ("B", 0), ...]  in order
        rec.peak_bytes  the most bytes it held at once for its micro-batches
        rec.held_after_forward  bytes held right after each forward (the first: one micro-batch's worth)

    Computes: a forward runs from the stage's forward pre-hook to its forward hook; a
    backward from its backward pre-hook (the gradient of its output is ready) to the last
    gradient accumulated into its parameters (0 s for a stage without parameters). Waits
    for messages fall outside. On a GPU these are launch times: use torch.profiler there.
    Events: each forward or backward start ("F"/"B", its index among the stage's forwards
    or backwards) and each point-to-point op posted ("send"/"recv", peer rank, numel).
    Bytes held: the distinct storages (each once, whole) of the tensors autograd saved for
    backward, of the stage's outputs and of the tensors handed to sends, each for as long
    as it is alive (weak references: counting keeps nothing alive). The stage's parameters
    and `exclude` (e.g. the input micro-batches, which the caller holds anyway) never
    count. Sampled after each forward, at each backward start and at each p2p op.
    """

    def __init__(self, stage: torch.nn.Module, exclude: Iterable[torch.Tensor] = ()):
        self.stage = stage
        self.excluded = {storage_key(t) for t in [*stage.parameters(), *exclude]}
        self.computes: list[Compute] = []
        self.events: list[tuple] = []
        self.peak_bytes = 0
        self.held_after_forward: list[int] = []
        self._alive: dict[tuple, tuple[StorageWeakRef, int]] = {}  # storage key -> (weak ref, bytes)
        self._exits: list[Callable[[], None]] = []

    def _track(self, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        if key is None or key in self.excluded:
            return
        known = self._alive.get(key)
        if known is None or known[0].expired():  # an address is reused once its storage is freed
            storage = tensor.untyped_storage()
            self._alive[key] = (StorageWeakRef(storage), storage.nbytes())

    def held_bytes(self) -> int:
        """Bytes of the tracked storages alive now."""
        self._alive = {key: entry for key, entry in self._alive.items() if not entry[0].expired()}
        return sum(nbytes for _, nbytes in self._alive.values())

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def _count(self, kind: str) -> int:
        return sum(1 for c in self.computes if c.kind == kind)

    def _forward_starts(self, module, args) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.events.append(("F", self._count("F")))
        now = time.perf_counter()
        self.computes.append(Compute("F", now, now, in_numel=0 if x is None else x.numel()))

    def _forward_ends(self, module, args, output) -> None:
        self.computes[-1].end = time.perf_counter()
        if isinstance(output, torch.Tensor):
            self.computes[-1].out_numel = output.numel()
            self._track(output)
        self.held_after_forward.append(self.held_bytes())
        self._sample()

    def _backward_starts(self, module, grad_output) -> None:
        self.events.append(("B", self._count("B")))
        now = time.perf_counter()
        self.computes.append(Compute("B", now, now))
        self._sample()

    def _gradient_accumulated(self, param) -> None:
        if self.computes and self.computes[-1].kind == "B":
            self.computes[-1].end = time.perf_counter()

    def _p2p(self, kind: str, peer: int | None, tensor: torch.Tensor) -> None:
        self.events.append((kind, peer, tensor.numel()))
        if kind == "send":
            self._track(tensor)
        self._sample()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._track(tensor)
        # A detached alias (same storage), not the tensor itself: an output that its own node saves
        # (ReLU's result) would otherwise hold that node through its grad_fn, a cycle through C++ that
        # Python never collects; a node no backward runs (an input-gradient pass, or a weights-only
        # pass, torch.autograd.backward(inputs=...)) would then keep what it saved forever (torch 2.14.1).
        return tensor.detach()

    def __enter__(self) -> "StageRecorder":
        stage = self.stage
        handles = [stage.register_forward_pre_hook(self._forward_starts),
                   stage.register_forward_hook(self._forward_ends),
                   stage.register_full_backward_pre_hook(self._backward_starts)]
        handles += [p.register_post_accumulate_grad_hook(self._gradient_accumulated)
                    for p in stage.parameters() if p.requires_grad]
        saved = saved_tensors_hooks(self._pack, lambda tensor: tensor)
        log = PointToPointLog(names=_P2P, on_op=self._p2p)
        saved.__enter__()
        log.__enter__()
        self._exits = [lambda: log.__exit__(None, None, None), lambda: saved.__exit__(None, None, None),
                       *(h.remove for h in handles)]
        return self

    def __exit__(self, *exc) -> None:
        for undo in self._exits:
            undo()
        self._exits = []
        self._sample()
