"""How the trainer holds the model across ranks: one interface for the loop, two ways.

    parallel = wrap_model(model, cfg, device, dtype)
    parallel.net                   what a step calls: DDP(model) (the model on one rank), or the model
                                   itself after fully_shard
    parallel.module                the model (hooks, evaluation, the optimizer's parameters)
    with parallel.no_sync(): ...   an inner micro-batch: gradients accumulate, nothing is reduced
    parallel.sync_buffers()        every rank takes rank 0's buffers (BatchNorm statistics)
    parallel.weights_finite()      collective: the same answer on every rank
    parallel.full_state_dict()     collective: the whole model's state_dict on rank 0 ({} elsewhere)

    --parallel ddp    every rank holds all parameters, gradients and optimizer state (16 bytes
                      per parameter with Adam in fp32, the same on every rank); one all-reduce
                      of the gradients per step; rank 0 writes one checkpoint file (4.1)
    --parallel fsdp   torch's fully_shard (FSDP2: every parameter a DTensor sharded on dim 0
                      over the ranks): each rank holds 1/N of parameters, gradients and
                      optimizer state. A unit (a residual stage of a ResNet, a transformer
                      block of a ViT) all-gathers its parameters before its forward and
                      again before its backward (--reshard-after-forward, the default; off:
                      kept from forward to backward, ZeRO-2-like memory for one all-gather
                      less per unit), and reduce-scatters its gradients after it; each rank
                      writes only its shards (sharded_checkpoint.py). Phase 2.4 builds the
                      same thing from scratch (ZeRO-3).

Mixed precision under fsdp: MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)
all-gathers and computes in the low dtype and reduce-scatters in fp32, for models without
BatchNorm (ViT). BatchNorm needs its weights in the dtype of its running statistics (torch
2.14 raises "expected scalar type BFloat16 but found Float" on the CPU), so models with
BatchNorm (the ResNets, the small CNN) all-gather fp32 weights and compute in bf16 or fp16
under autocast, as the ddp path does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

PARALLEL_MODES = ("ddp", "fsdp")


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


@dataclass
class Parallel:
    """The model as the ranks hold it (see the module docstring)."""

    kind: str                      # "ddp" or "fsdp"
    net: nn.Module                 # what the step's forward calls
    module: nn.Module              # the model itself
    buffers: list[torch.Tensor] = field(default_factory=list)  # synced from rank 0 under fsdp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the forward AND backward of an inner micro-batch: no gradient collective."""
        if self.kind == "ddp":
            return self.net.no_sync() if self.net is not self.module else contextlib.nullcontext()
        return _fsdp_no_sync(self.module)

    def sync_buffers(self) -> None:
        """Rank 0's buffers on every rank, before a step's first forward: what DDP does in its
        forward (broadcast_buffers=True). FSDP shards parameters only; without this each rank's
        BatchNorm statistics would drift apart, and a checkpoint (which keeps one copy of a
        replicated tensor, from whichever rank DCP picks) would not resume bit-identically."""
        if self.kind == "fsdp" and self.buffers and dist.is_initialized() and dist.get_world_size() > 1:
            for group in _by_dtype(self.buffers):
                flat = torch.cat([b.reshape(-1) for b in group])
                dist.broadcast(flat, src=0)
                for b, value in zip(group, flat.split([b.numel() for b in group])):
                    b.copy_(value.view_as(b))

    def weights_finite(self) -> bool:
        """True on every rank when no parameter holds a NaN or an infinity (collective under
        fsdp, where each rank sees only its shards)."""
        ok = all(bool(torch.isfinite(_local(p)).all()) for p in self.module.parameters())
        if self.kind == "fsdp" and dist.is_initialized():
            flag = torch.tensor([0.0 if ok else 1.0], device=next(self.module.parameters()).device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            ok = flag.item() == 0.0
        return ok

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's complete state_dict (names without any wrapper prefix) on rank 0, on the
        CPU; {} on the other ranks under fsdp. Collective under fsdp."""
        if self.kind == "ddp":
            return self.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a complete state_dict (every rank passes the same one) into the model."""
        if self.kind == "ddp":
            self.module.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))


def wrap_model(model: nn.Module, kind: str, device: torch.device, dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, cpu_offload: bool = False, comm_hook: bool = False) -> Parallel:
    """DDP(model), or fully_shard on each of fsdp_units(model), then on the model (the root).
    `dtype`: the autocast dtype of --amp (None: fp32), for fsdp's MixedPrecisionPolicy.
    ddp on one rank: the model itself, where there is nothing to reduce (unless `comm_hook`:
    a communication hook needs DDP's reducer). DDP would still bucket every gradient, and
    under torch.compile split the model's graph at its bucket boundaries (torch._dynamo's
    DDPOptimizer): a compiled ResNet-50 step on one H200 ran at 5,483 images/s in DDP and
    6,060-6,664 without (torch 2.11, issue 34)."""
    if kind == "ddp":
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        net = model if alone and not comm_hook else DDP(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)
        return Parallel("ddp", net, model)
    if kind != "fsdp":
        raise ValueError(f"--parallel {kind!r}: choose one of {', '.join(PARALLEL_MODES)}")
    if cpu_offload and device.type != "cuda":
        raise ValueError("--cpu-offload moves the shards from the GPUs to CPU memory (pinned, for fast copies); "
                         "training on the CPU they are in CPU memory already: leave it off")
    shard(model, device, dtype, reshard_after_forward, cpu_offload)
    return Parallel("fsdp", model, model, list(model.buffers()))


def shard(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None,
          reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """fully_shard on each of fsdp_units(model), then on the model (the root), over all ranks
    (wrap_model's fsdp; also the --model-ema copy, sharded like the model)."""
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
