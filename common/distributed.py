"""Join a process group the way torchrun does, on any machine.

One function, `init_distributed`, is called by every rank of every program in this
repository, whether `torchrun` or `common.launch.run_world` started it. Both describe
the world with the same environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so the code under test is the code you deploy.

Backend and device are chosen automatically (COURSE_BACKEND=gloo|nccl overrides):
  * NCCL on CUDA when this node has at least one GPU per local rank (NCCL refuses
    two ranks on one GPU);
  * gloo on CPU otherwise (laptops, CI, macOS, Windows).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_PG_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the world."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, draws progress bars and writes files."""
        return self.rank == 0


def choose_device(local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """cuda:<local_rank> when every local rank can have its own GPU, else cpu."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"environment variable {name} is not set: start this program with "
            "`torchrun --standalone --nproc_per_node=N ...` or through "
            "common.launch.run_world, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def platform_env_defaults() -> dict[str, str]:
    """Settings gloo needs on some laptops (applied only when not already set).

    * macOS: gloo picks the first network interface, which may not reach localhost;
      GLOO_SOCKET_IFNAME=lo0 pins it to the loopback interface.
    * Windows: torch's TCPStore defaults to libuv, which Windows builds may lack;
      USE_LIBUV=0 selects the classic implementation.
    """
    if sys.platform == "darwin":
        return {"GLOO_SOCKET_IFNAME": "lo0"}
    if sys.platform == "win32":
        return {"USE_LIBUV": "0"}
    return {}


def init_distributed(backend: str | None = None, timeout_s: float | None = None,
                     store: dist.Store | None = None) -> DistInfo:
    """Join the world described by the torchrun environment variables; idempotent.

    Without `store`, the ranks meet through MASTER_ADDR:MASTER_PORT (env://, what
    torchrun sets up). With `store` (common.launch.run_world passes a client of the
    store its parent hosts), they meet there; RANK and WORLD_SIZE still say who is who.
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not 0 <= rank < world_size:
        raise RuntimeError(f"RANK={rank} is outside the world of WORLD_SIZE={world_size}")
    for key, value in platform_env_defaults().items():
        os.environ.setdefault(key, value)

    backend = backend or os.environ.get("COURSE_BACKEND") or None  # tests pin gloo: their tensors are on CPU
    device = torch.device("cpu") if backend == "gloo" else choose_device(local_rank, local_world_size)
    backend = backend or backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_PG_TIMEOUT_S)
        # device_id binds this rank's GPU to the group. In torch 2.14.1, under NCCL, the
        # communicator is then created at once (an error shows here, not at the first
        # collective) and sub-groups are split from it (ncclCommSplit). CPU: nothing to bind.
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    return DistInfo(rank, world_size, local_rank, device, backend)


def current_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """This rank's device for collectives on `group` (default: the world) once it is up:
    its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cleanup_distributed() -> None:
    """Leave the process group if we joined one (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
