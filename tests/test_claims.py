"""Claims the guidelines and the trainer's docs make about torch's behaviour, held against the
installed torch (2.14.1 when written), so that a torch upgrade that changes one fails here
instead of leaving a sentence wrong.

    phase4_production/guidelines.md 4.6   TORCH_DISTRIBUTED_DEBUG is read when torch.distributed is
                                          imported; TORCH_NCCL_TRACE_BUFFER_SIZE is the deprecated
                                          name of TORCH_FR_BUFFER_SIZE (the deployment files use the new)
    phase4_production/guidelines.md       which of DDP's forwards broadcast the buffers: a step's
      (4.5 Stragglers; "An evaluation      first, not one after a no_sync() one, and only the first
      that cannot deadlock")               no-grad forward of an evaluation
    solutions/phase4_production/README.md fully_shard with set_requires_gradient_sync(False) keeps
      ("What accumulation costs under fsdp")   the whole model's gradient, unsharded, in fp32

Two processes' worth of time: one subprocess (the environment read at import) and one world of
2 gloo ranks for the rest; about 8 s in all.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from common.launch import run_world

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "solutions" / "phase4_production" / "deployment"

_IMPORT_TIME = r"""
import os, torch, torch.distributed as dist
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"           # too late: read at import
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
backend = lambda g: type(g._get_backend(torch.device("cpu"))).__name__
print("late", dist.get_debug_level(), backend(dist.group.WORLD))
dist.set_debug_level_from_env()                            # the documented way from inside
print("from_env", dist.get_debug_level(), backend(dist.new_group([0])))
for _ in range(8):
    dist.all_reduce(torch.ones(4))
import pickle
print("entries", len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]))
dist.destroy_process_group()
"""


def test_debug_level_is_read_at_import_and_the_old_buffer_name_warns():
    """guidelines 4.6: an os.environ TORCH_DISTRIBUTED_DEBUG=DETAIL set after `import torch` does
    nothing (no ProcessGroupWrapper); set_debug_level_from_env() applies it to groups made after.
    TORCH_NCCL_TRACE_BUFFER_SIZE still sizes the flight recorder (gloo records into it too), with
    torch's deprecation warning naming TORCH_FR_BUFFER_SIZE."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_DISTRIBUTED_DEBUG", "TORCH_FR_BUFFER_SIZE")}
    env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "5"
    proc = subprocess.run([sys.executable, "-c", _IMPORT_TIME], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["late"] == "DebugLevel.OFF ProcessGroupGloo", (
        f"TORCH_DISTRIBUTED_DEBUG set after import took effect ({lines['late']}): guidelines 4.6 says it does not")
    assert lines["from_env"] == "DebugLevel.DETAIL _ProcessGroupWrapper", lines["from_env"]
    assert lines["entries"] == "5", f"the flight recorder kept {lines['entries']} entries with the old name's 5"
    assert re.search(r"TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE", proc.stderr), (
        "no deprecation warning for TORCH_NCCL_TRACE_BUFFER_SIZE: check guidelines 4.6 and the deployment README")


def test_deployment_files_name_the_flight_recorder_by_its_current_name():
    files = [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix != ".md" and p.parent.name != "schemas"]
    old = []
    for path in files:
        for line in path.read_text(errors="ignore").splitlines():
            code = line.split("#", 1)[0]
            if "TORCH_NCCL_TRACE_BUFFER_SIZE" in code:
                old.append(f"{path.relative_to(DEPLOY)}: {line.strip()}")
    assert not old, "deprecated name (torch 2.14 warns), set TORCH_FR_BUFFER_SIZE instead: " + "; ".join(old)


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python holds (a DTensor: its local piece)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        local = getattr(obj, "_local_tensor", obj)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _rank_claims() -> dict:
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.simplefilter("ignore", FutureWarning)  # gc's walk touches deprecated module attributes
    rank = dist.get_rank()
    out = {}

    # DDP: which forwards broadcast the buffers (rank 0's over everyone's). Rank 1 changes a
    # buffer before each of ten forwards and records whether rank 0's value came back.
    torch.manual_seed(0)
    net = nn.Linear(4, 4)
    net.register_buffer("marker", torch.zeros(1))
    ddp = DDP(net)
    overwritten = []

    def forward(no_sync: bool = False, grad: bool = True) -> None:
        if rank == 1:
            net.marker.fill_(100.0 + len(overwritten))
        with ddp.no_sync() if no_sync else contextlib.nullcontext(), torch.set_grad_enabled(grad):
            y = ddp(torch.randn(2, 4))
            if grad:
                y.sum().backward()
        overwritten.append(net.marker.item() == 0.0)

    forward(), forward()                               # 1, 2: two steps
    forward(no_sync=True), forward()                   # 3, 4: a step of two micro-batches
    forward(no_sync=True), forward()                   # 5, 6: another
    forward(grad=False), forward(grad=False)           # 7, 8: an evaluation
    forward(), forward()                               # 9, 10: two steps
    out["broadcast_in"] = [i + 1 for i, yes in enumerate(overwritten) if yes]

    # fully_shard: what a backward without gradient sync leaves behind, in bytes.
    d = 256
    model = nn.Sequential(nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(8, d)
    gc.collect()
    before = _live_tensor_bytes()
    model(x).sum().backward()
    gc.collect()
    out["synced_bytes"] = _live_tensor_bytes() - before
    for p in model.parameters():
        p.grad = None
    gc.collect()
    before = _live_tensor_bytes()
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    gc.collect()
    out["no_sync_bytes"] = _live_tensor_bytes() - before
    out["full_fp32_bytes"] = 2 * d * d * 4
    return out


def test_ddp_buffer_broadcasts_and_fsdp_no_sync_holds_unsharded_fp32_gradients():
    results = run_world(_rank_claims, 2, timeout=90)
    rank0, rank1 = results
    # A forward broadcasts when the one before it ran with gradients outside no_sync() (or it
    # is the first): steps' first micro-batches and the first no-grad forward of an evaluation.
    assert rank1["broadcast_in"] == [1, 2, 3, 5, 7, 10], (
        f"DDP broadcast the buffers in forwards {rank1['broadcast_in']} of 10, not in 1, 2, 3, 5, 7, 10: "
        "the guidelines (4.5 Stragglers, the trainer's evaluation) describe the latter")
    for rank, res in enumerate(results):
        full = res["full_fp32_bytes"]
        assert res["synced_bytes"] < full, (
            f"rank {rank}: after a synced backward {res['synced_bytes']} bytes more are held, not a shard of {full}")
        assert res["no_sync_bytes"] >= full, (
            f"rank {rank}: after a backward without gradient sync only {res['no_sync_bytes']} bytes more are held; "
            f"the README says the whole model's fp32 gradient ({full} bytes) stays on every rank")
