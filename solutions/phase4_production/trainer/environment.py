"""What the trainer reads from its environment besides its flags, checked before any rank starts.

    launch_environment()          the launcher's variables: under torchrun (RANK set) the world it
                                  describes must be whole (RANK, WORLD_SIZE, LOCAL_RANK,
                                  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, integers in range), else
                                  one line; without torchrun, torchrun's TORCHELASTIC_* variables that a
                                  parent left behind are dropped (said in a note): they would name this
                                  run as a restart of another job. Returns the notes to print
    device_environment(...)       the device's: a backend pinned by COURSE_BACKEND that the device cannot
                                  use, GPUs hidden from --device auto (CUDA_VISIBLE_DEVICES, a torch
                                  without CUDA), a CUBLAS_WORKSPACE_CONFIG that --deterministic cannot
                                  use: one line each; threads that oversubscribe the cores, torchrun's
                                  shared rendezvous store, NCCL errors that would not end a rank, and a
                                  fault injector armed by COURSE_FAULTS: a note each

Why. A variable is an input like a flag: a RANK left exported in a shell, a PyTorchJob that runs the
trainer without torchrun (RANK and WORLD_SIZE but no LOCAL_RANK), a TORCHELASTIC_RUN_ID inherited
from a torchrun job that started this shell: each used to make another run than the one asked for
(a rank on the wrong GPU, a live run's folder taken over as "a restart of the same job", an error
said once and then never again). Every variable the trainer reads is listed in
solutions/phase4_production/surface.toml and the README's inventory, and tests/test_trainer_surface.py
fails when the source reads one that is not.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# torchrun's description of the world (torch/distributed/elastic/agent/server/local_elastic_agent.py)
WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# what the trainer reads of torchrun's own variables: meaningful only in a process torchrun started
ELASTIC = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
# cuBLAS's deterministic workspaces (torch.use_deterministic_algorithms' docstring, torch 2.14.1)
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def launch_environment() -> list[str]:
    """Check the launcher's variables (module docstring): ValueError (one line) for a torchrun world
    that is not whole; the notes to print (rank 0's or the launcher's) otherwise."""
    env = os.environ  # its keys read here: WORLD, ELASTIC (surface.toml lists this function's)
    if "RANK" not in os.environ:
        left = {name: env.pop(name) for name in ELASTIC if name in env}
        if not left:
            return []
        said = ", ".join(f"{name}={value}" for name, value in left.items())
        return [f"note: ignoring {said}, left in the environment by another launch: this run was not started "
                "by torchrun (RANK is not set), so it starts its own ranks as a new job"]
    missing = [name for name in WORLD if not env.get(name)]
    if missing:
        raise ValueError(f"RANK={env['RANK']} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not: the environment describes part of a torchrun world (a launcher other than torchrun, "
                         "or a RANK left exported); start the trainer with torchrun (solutions/phase4_production/"
                         "README.md), or unset RANK to let it start its own ranks")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        if name in env:
            try:
                values[name] = int(env[name])
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is not an integer: the launcher's environment is not "
                                 "torchrun's; start the trainer with torchrun") from None
    rank, world, local, local_world = (values[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if not (0 <= rank < world and 0 <= local < local_world <= world and 0 < values["MASTER_PORT"] < 65536
            and values.get("TORCHELASTIC_RESTART_COUNT", 0) >= 0):
        raise ValueError(f"the torchrun world in the environment does not add up (RANK={rank}, WORLD_SIZE={world}, "
                         f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world}, MASTER_PORT={values['MASTER_PORT']}): "
                         "start the trainer with torchrun, or unset RANK to let it start its own ranks")
    return []


def node_gpus() -> int:
    """NVIDIA GPUs this node has, whatever this process may see (Linux: the driver's
    /proc/driver/nvidia/gpus/, one folder per GPU); 0 where unknown."""
    try:
        return sum(1 for _ in Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return 0


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, as a scheduler's cgroup sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def device_environment(device: str, gpus: int, local_ranks: int, deterministic: bool) -> list[str]:
    """Check the variables that decide where and how the ranks compute (module docstring), for
    --device `device`, `gpus` visible GPUs and `local_ranks` ranks on this node: ValueError (one
    line) for one that makes another run than asked; the notes to print otherwise."""
    notes = []
    training_on_gpus = device == "cuda" or (device == "auto" and gpus > 0)
    pinned = os.environ.get("COURSE_BACKEND")
    if pinned not in (None, "", "gloo", "nccl"):
        raise ValueError(f"COURSE_BACKEND={pinned!r} is no backend: gloo or nccl, or unset it (the trainer picks "
                         "the backend from --device)")
    if pinned == "nccl" and not training_on_gpus:
        raise ValueError("COURSE_BACKEND=nccl pins NCCL, which needs GPUs, and this run trains on the CPU (--device "
                         "cpu, or no GPU visible): unset COURSE_BACKEND")
    if device == "auto" and gpus == 0 and node_gpus() > 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None else \
            "this torch cannot use them (built without CUDA, or a driver it does not support)"
        raise ValueError(f"--device auto: this node has {node_gpus()} NVIDIA GPU(s) and this process sees none "
                         f"({why}): make them visible, or pass --device cpu to train on the CPU on purpose")
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic and training_on_gpus and cublas not in (None, *DETERMINISTIC_CUBLAS):
        raise ValueError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={cublas!r} lets cuBLAS be nondeterministic "
                         f"(torch refuses it at the first matrix product): set it to {DETERMINISTIC_CUBLAS[0]} or "
                         f"{DETERMINISTIC_CUBLAS[1]}, or unset it")
    threads, cores = torch.get_num_threads(), usable_cores()  # a rank's own under torchrun (the launcher's: 1)
    if "RANK" in os.environ and threads > 1 and threads * local_ranks > cores:
        omp = os.environ.get("OMP_NUM_THREADS", "unset")
        notes.append(f"note: {local_ranks} rank(s) x {threads} threads each (OMP_NUM_THREADS={omp}) on {cores} cores: "
                     f"the threads wait for each other; OMP_NUM_THREADS={max(cores // local_ranks, 1)} fits")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        notes.append("note: torchrun shares its rendezvous store with the ranks (TORCH_DISABLE_SHARE_RDZV_TCP_STORE "
                     "is not 1): a restarted attempt can connect to a dead rank's store; export "
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where torchrun runs (solutions/phase4_production/README.md)")
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("NCCL_ASYNC_ERROR_HANDLING"))
    if training_on_gpus and handling in ("0", "2"):
        notes.append(f"note: TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: a collective that times out does not end "
                     "its rank (torch 2.14's NoHandling/CleanUpOnly), so a stuck rank hangs the job instead of "
                     "ending the attempt; unset it, or set 1 or 3")
    faults = os.environ.get("COURSE_FAULTS", "").strip()
    if faults:
        notes.append(f"[fault injector] armed by COURSE_FAULTS={faults}: these faults will fire in this run (a "
                     "test's setting); unset COURSE_FAULTS for a real run")
    return notes
