"""How the ranks hold the model: one strategy per layout, one protocol, chosen once.

    strategy = make_strategy(layout, device, dtype, reshard_after_forward=..., cpu_offload=...)
    model = strategy.prepare(model, channels_last)   the memory format this layout allows
    strategy.hold_like_the_model(copy)               a second model held as the model will be (the EMA)
    strategy.wrap(model, comm_hook)                  hold the model across the ranks
    strategy.net, strategy.module                    what a step calls; the model itself
    strategy.attach_comm_hook(...)                   DDP's communication hook (4.4's compression)
    strategy.sync_points(timer, faults)              where DDP's collectives wait in forward/backward
    strategy.begin_step(step, timer)                 before a step's first forward
    with strategy.no_sync(): ...                     an inner micro-batch: gradients accumulate, nothing reduced
    strategy.before_reduction(faults)                the backward that reduces is about to begin
    strategy.clip_grad_norm_(max_norm)               the whole model's gradient norm, clipped
    strategy.sync_buffers()                          every rank takes rank 0's buffers (BatchNorm statistics)
    strategy.weights_finite()                        collective: the same answer on every rank
    strategy.full_state_dict(), .load_full_state_dict(state)   the whole model's weights
    strategy.fingerprint()                           sha256 of the whole model, on every rank
    strategy.make_store(folder, keep, faults, asynchronous)    the checkpoint store it pairs with
    Strategy.check(cfg)                              options the layout cannot take, one line each
    Strategy.collective, Strategy.fused_sgd          what a step waits in; fused SGD possible

    --parallel ddp    DDPStrategy: every rank holds all parameters, gradients and optimizer
                      state (16 bytes per parameter with Adam in fp32, the same on every rank);
                      one all-reduce of the gradients per step; rank 0 writes one checkpoint file
                      (4.1; stores.FileStore)
    --parallel fsdp   FSDPStrategy: torch's fully_shard (FSDP2: every parameter a DTensor sharded
                      on dim 0 over the ranks): each rank holds 1/N of parameters, gradients and
                      optimizer state. A unit (a residual stage of a ResNet, a transformer block
                      of a ViT) all-gathers its parameters before its forward and again before
                      its backward (--reshard-after-forward, the default; off: kept from forward
                      to backward, ZeRO-2-like memory for one all-gather less per unit), and
                      reduce-scatters its gradients after it; each rank writes only its shards
                      (stores.DCPStore). Phase 2.4 builds the same thing from scratch (ZeRO-3).

The layout's name is read in one place: STRATEGIES, where make_strategy and strategy_class look
it up. A third layout (HSDP: fully_shard over a 2-D mesh, sharded within a node, replicated
across nodes) would be a third class here and one entry in STRATEGIES; the loop, the step, the
EMA and the checkpointer call the protocol and would not change.

Mixed precision under fsdp: MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)
all-gathers and computes in the low dtype and reduce-scatters in fp32, for models without
BatchNorm (ViT). BatchNorm needs its weights in the dtype of its running statistics (torch
2.14 raises "expected scalar type BFloat16 but found Float" on the CPU), so models with
BatchNorm (the ResNets, the small CNN) all-gather fp32 weights and compute in bf16 or fp16
under autocast, as the ddp path does.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from phase4_production.checkpoint import unwrap
from phase4_production.compression import CompressionState
from phase4_production.monitoring import StepTimer
from phase4_production.recovery import FaultInjector
from phase4_production.trainer.comm import register_comm_hook, set_sparsity
from phase4_production.trainer.stores import DCPStore, FileStore


def fingerprint(model: nn.Module | dict) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes, in name order): equal
    fingerprints mean bit-identical weights and buffers. `model`: a module, or a state_dict."""
    digest = hashlib.sha256()
    state = model if isinstance(model, dict) else unwrap(model).state_dict()
    for name, tensor in sorted(state.items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Strategy:
    """The protocol every layout implements (module docstring), with what the layouts share."""

    collective: ClassVar[str] = "a collective"  # what a step's backward waits in, as a timeout names it
    fused_sgd: ClassVar[bool] = True            # torch's fused SGD step works on this layout's parameters
    store: ClassVar[type] = FileStore           # the checkpoint store of this layout

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None, **options: Any):
        self.device, self.dtype = device, dtype  # dtype: autocast's (--amp), None: fp32
        self.net: nn.Module | None = None        # what the step's forward calls
        self.module: nn.Module | None = None     # the model itself

    @staticmethod
    def check(cfg) -> None:
        """Raise ValueError (one line) for an option of `cfg` this layout cannot take."""

    def prepare(self, model: nn.Module, channels_last: bool) -> nn.Module:
        """The bare model in the memory format this layout trains it in (before any copy of it)."""
        return model

    def hold_like_the_model(self, module: nn.Module) -> None:
        """Hold `module`, a copy of the bare model, as wrap() will hold the model (the EMA)."""

    def wrap(self, model: nn.Module, comm_hook: bool = False) -> "Strategy":
        raise NotImplementedError

    def attach_comm_hook(self, options, faults: FaultInjector, step: int, momentum: float,
                         decays: dict[int, float]) -> CompressionState | None:
        """A communication hook on the gradients' collective, where the layout has one."""
        return None

    def sync_points(self, timer: StepTimer, faults: FaultInjector, compiled: bool):
        """What splits a wrapper's forward and backward into work and waiting, or None."""
        return None

    def begin_step(self, step: int, timer: StepTimer) -> None:
        """Called before step `step`'s (0-based) first forward."""

    def before_reduction(self, faults: FaultInjector) -> None:
        """The backward that reduces the gradients is about to begin."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the forward AND backward of an inner micro-batch: no gradient collective."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def sync_buffers(self) -> None:
        """Rank 0's buffers on every rank, where the layout does not keep them equal itself."""

    def weights_finite(self) -> bool:
        """True on every rank when no parameter holds a NaN or an infinity."""
        return all(bool(torch.isfinite(_local(p)).all()) for p in self.module.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's complete state_dict (names without any wrapper prefix) on rank 0."""
        return self.module.state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a complete state_dict (every rank passes the same one) into the model."""
        self.module.load_state_dict(state)

    def fingerprint(self) -> str:
        """fingerprint() of the whole model, on every rank."""
        return fingerprint(self.full_state_dict())

    def make_store(self, folder: str | Path, keep: int = 3, faults: FaultInjector | None = None,
                   asynchronous: bool = False):
        """This layout's checkpoint store over `folder` (stores.py)."""
        return self.store(folder, keep, faults, asynchronous)


class DDPStrategy(Strategy):
    """--parallel ddp: a replica per rank, DDP's all-reduce in backward (module docstring)."""

    collective = "DDP's gradient all-reduce (in backward)"

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None, **options: Any):
        super().__init__(device, dtype)
        self.compression: CompressionState | None = None
        self.options = None  # the parallel section, once a hook is attached

    @staticmethod
    def check(cfg) -> None:
        if cfg.parallel.cpu_offload or not cfg.parallel.reshard_after_forward:
            flag = "--cpu-offload" if cfg.parallel.cpu_offload else "--reshard-after-forward false"
            raise ValueError(f"{flag} applies to --parallel fsdp only; DDP keeps every parameter on every rank")

    def prepare(self, model: nn.Module, channels_last: bool) -> nn.Module:
        return model.to(memory_format=torch.channels_last) if channels_last else model

    def wrap(self, model: nn.Module, comm_hook: bool = False) -> "DDPStrategy":
        """DDP(model); on one rank the model itself, where there is nothing to reduce (unless
        `comm_hook`: a communication hook needs DDP's reducer). DDP would still bucket every
        gradient, and under torch.compile split the model's graph at its bucket boundaries
        (torch._dynamo's DDPOptimizer): a compiled ResNet-50 step on one H200 ran at 5,483
        images/s in DDP and 6,060-6,664 without (torch 2.11, issue 34)."""
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        self.module = model
        self.net = model if alone and not comm_hook else DDP(model, device_ids=[self.device.index]
                                                             if self.device.type == "cuda" else None)
        return self

    def attach_comm_hook(self, options, faults: FaultInjector, step: int, momentum: float,
                         decays: dict[int, float]) -> CompressionState | None:
        """4.4's compression (--compression), or the fault injector's all-reduce point: comm.py."""
        if isinstance(self.net, DDP):
            self.options = options
            self.compression = register_comm_hook(self.net, options, faults, step, momentum, decays)
        return self.compression

    def sync_points(self, timer: StepTimer, faults: FaultInjector, compiled: bool):
        if compiled or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return SyncPoints(self.net, timer, faults)

    def begin_step(self, step: int, timer: StepTimer) -> None:
        """--topk-warmup: the fraction top-k sends at this step."""
        if self.options is not None:
            set_sparsity(self.compression, self.options, step)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.net.no_sync() if self.net is not self.module else contextlib.nullcontext()


class FSDPStrategy(Strategy):
    """--parallel fsdp: fully_shard on each of fsdp_units(model), then on the root (module docstring)."""

    collective = "FSDP's all-gather or reduce-scatter (in forward or backward)"
    fused_sgd = False  # torch 2.14.1's DTensor has fused Adam/AdamW rules, no fused SGD one (make_optimizer)
    store = DCPStore

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, **options: Any):
        super().__init__(device, dtype)
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.buffers: list[torch.Tensor] = []  # synced from rank 0 (sync_buffers)

    @staticmethod
    def check(cfg) -> None:
        if cfg.parallel.compression != "none":
            raise ValueError(f"--compression {cfg.parallel.compression} is a DDP communication hook; --parallel fsdp "
                             "reduce-scatters gradient shards and takes no comm hook: use --compression none "
                             "with fsdp")
        if cfg.checkpoint.async_checkpoint == "on":
            raise ValueError("--async-checkpoint on: the background writer writes ddp's single file; --parallel "
                             "fsdp writes its shards synchronously: use --async-checkpoint off or auto")

    def hold_like_the_model(self, module: nn.Module) -> None:
        shard(module, self.device, self.dtype, self.reshard_after_forward, self.cpu_offload)

    def wrap(self, model: nn.Module, comm_hook: bool = False) -> "FSDPStrategy":
        """The parameters stay contiguous (prepare leaves the memory format): fully_shard
        refuses non-contiguous ones (torch 2.14), so under fsdp only the inputs go channels_last."""
        if self.cpu_offload and self.device.type != "cuda":
            raise ValueError("--cpu-offload moves the shards from the GPUs to CPU memory (pinned, for fast copies); "
                             "training on the CPU they are in CPU memory already: leave it off")
        shard(model, self.device, self.dtype, self.reshard_after_forward, self.cpu_offload)
        self.net = self.module = model
        self.buffers = list(model.buffers())
        return self

    def begin_step(self, step: int, timer: StepTimer) -> None:
        with timer.phase("comm"):
            self.sync_buffers()  # rank 0's BatchNorm statistics, as DDP's forward broadcasts them

    def before_reduction(self, faults: FaultInjector) -> None:
        faults.point("allreduce")  # the last backward reduce-scatters

    def no_sync(self) -> contextlib.AbstractContextManager:
        return _fsdp_no_sync(self.module)

    def sync_buffers(self) -> None:
        """Rank 0's buffers on every rank, before a step's first forward: what DDP does in its
        forward (broadcast_buffers=True). FSDP shards parameters only; without this each rank's
        BatchNorm statistics would drift apart, and a checkpoint (which keeps one copy of a
        replicated tensor, from whichever rank DCP picks) would not resume bit-identically."""
        if self.buffers and dist.is_initialized() and dist.get_world_size() > 1:
            broadcast_from_rank0(self.buffers)

    def weights_finite(self) -> bool:
        """Collective: each rank sees only its shards."""
        ok = super().weights_finite()
        if dist.is_initialized():
            flag = torch.tensor([0.0 if ok else 1.0], device=next(self.module.parameters()).device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok = flag.item() == 0.0
        return ok

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: gathered on rank 0, on the CPU; {} on the other ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))

    def fingerprint(self) -> str:
        """Collective: computed on rank 0 from the gathered weights, broadcast to the others."""
        state = self.full_state_dict()
        value = fingerprint(state) if dist.get_rank() == 0 else None
        if dist.get_world_size() > 1:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            value = box[0]
        return value


# The layouts, by the name --parallel takes: the one place a layout's name is read.
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}


def strategy_class(layout: str) -> type[Strategy]:
    if layout not in STRATEGIES:
        raise ValueError(f"--parallel {layout!r}: choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[layout]


def make_strategy(layout: str, device: torch.device, dtype: torch.dtype | None = None, **options: Any) -> Strategy:
    """The strategy of --parallel `layout` (options: the parallel section's, by keyword)."""
    return strategy_class(layout)(device, dtype, **options)


def other_stores(layout: str, folder: str | Path) -> dict[str, Any]:
    """{layout: its store over `folder`} for every layout whose checkpoints `layout`'s store
    cannot read (another format): a resume refuses a folder that holds only those."""
    mine = strategy_class(layout).store
    return {name: kind.store(folder) for name, kind in STRATEGIES.items() if kind.store is not mine}


def wrap_model(model: nn.Module, layout: str, device: torch.device, dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, cpu_offload: bool = False, comm_hook: bool = False) -> Strategy:
    """make_strategy(...).wrap(model): the model held as --parallel `layout` holds it."""
    return make_strategy(layout, device, dtype, reshard_after_forward=reshard_after_forward,
                         cpu_offload=cpu_offload).wrap(model, comm_hook)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules a practitioner shards one by one before the root: the residual stages of
    a torchvision ResNet, the encoder blocks of a torchvision ViT; none for the small models
    (the root alone then holds every parameter in one unit)."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [getattr(model, f"layer{i}") for i in range(1, 5)]
    layers = getattr(getattr(model, "encoder", None), "layers", None)
    if isinstance(layers, nn.Sequential):
        return list(layers)
    return []


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def shard(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None,
          reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """fully_shard on each of fsdp_units(model), then on the model (the root), over all ranks
    (FSDPStrategy.wrap; also the --model-ema copy, sharded like the model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    low = dtype is not None and not has_batchnorm(model)
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
               "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if low
               else MixedPrecisionPolicy(),
               "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for unit in fsdp_units(model):
        fully_shard(unit, **options)
    # the root's own parameters (stem, head) are the first that backward needs: resharding them
    # after forward would only gather them again at once (fully_shard's docstring, torch 2.14:
    # "we usually set False for the root module")
    fully_shard(model, **{**options, "reshard_after_forward": False})


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values of `tensors` on every rank: one broadcast per dtype (collective)."""
    for group in _by_dtype(tensors):
        flat = torch.cat([b.reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        for b, value in zip(group, flat.split([b.numel() for b in group])):
            b.copy_(value.view_as(b))


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


class SyncPoints:
    """Where DDP's collectives end inside one forward() and one backward() call, so that
    the time a rank spends waiting for the others counts as "comm", not as its own work.

    forward(): in a step's first forward DDP first broadcasts rank 0's buffers (BatchNorm
    statistics; a collective that waits for every rank: torch 2.14.1 broadcasts in a forward
    whose predecessor ran with gradients outside no_sync(), tests/test_claims.py), then
    calls the module: a forward pre-hook on the module marks
    that moment (`synced`) and fires the fault injector's "forward" point. backward(): DDP
    launches each bucket's all-reduce as its gradients become ready; after this rank's last
    gradient (`last_grad`, a post-accumulate-grad hook per parameter) the rest of backward()
    waits for the buckets in flight and for slower ranks. Without the split every rank's
    busy time is the same (the fast ones wait inside DDP for the slow one), and the
    straggler detector could never name anyone."""

    def __init__(self, ddp: nn.Module, timer: StepTimer, faults: FaultInjector):
        self.timer, self.faults = timer, faults
        self.synced = self.last_grad = None
        module = ddp.module
        self.handles = [module.register_forward_pre_hook(self._forward_starts)]
        self.handles += [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in module.parameters() if p.requires_grad]

    def _forward_starts(self, module: nn.Module, args) -> None:
        self.synced = self.timer.mark()
        self.faults.point("forward")

    def _grad_ready(self, param: torch.Tensor) -> None:
        self.last_grad = self.timer.mark()

    def split(self, name: str, begin, point, end) -> None:
        """Count begin..point as comm, point..end as `name` (forward), or the reverse
        (backward: work first, then the wait)."""
        point = point if point is not None else (begin if name == "forward" else end)
        first, second = ("comm", name) if name == "forward" else (name, "comm")
        self.timer.add_span(first, begin, point)
        self.timer.add_span(second, point, end)
