"""One rank of test_4_3_torchrun_agents_lose_and_gain_a_node, started by a real torchrun agent.

Trains a tiny linear model for one epoch (43 samples, global batch 4: 10 steps) with the
graded ElasticSampler and plan_batches, at whatever world size this attempt of the job
has, resuming from the newest checkpoint in $COURSE_RESULT_DIR/ckpt (reference 4.1 code).
After every committed step each rank writes the sample ids it trained on to
records/step<s>.rank<r>.<attempt>.json, where `attempt` orders the attempts of the job
(rank 0's clock at the start of the attempt: every agent runs on this host).

Gates make the test event-driven: with COURSE_ELASTIC_GATES="3@2,...", a rank that is at
step 3 (after committing it, or on starting from it) in a world of 2 writes
gates/at_3_2.rank<r> and waits for gates/go_3_2 (or for its agent to restart it). An
error is written to errors/ and the rank exits non-zero, so its agent restarts the group.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import grading  # noqa: E402
from common.distributed import init_distributed  # noqa: E402
from solutions.phase4_production.checkpoint import CheckpointManager  # noqa: E402

N, GLOBAL_BATCH, MAX_PER_RANK, SEED = 43, 4, 2, 11  # test_4_3_elastic.py's _ELASTIC_N, _ELASTIC_B
_GATE_WAIT_S = 90.0


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _gate(out: Path, step: int, world: int, rank: int) -> None:
    if f"{step}@{world}" not in os.environ.get("COURSE_ELASTIC_GATES", "").split(","):
        return
    gates = out / "gates"
    gates.mkdir(parents=True, exist_ok=True)
    (gates / f"at_{step}_{world}.rank{rank}").touch()
    deadline = time.monotonic() + _GATE_WAIT_S
    while not (gates / f"go_{step}_{world}").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"held at step {step} in a world of {world} for {_GATE_WAIT_S:.0f}s: neither released "
                               "nor restarted by the agent")
        time.sleep(0.02)


def run(mod, out: Path, attempt: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(N, 4, generator=gen), torch.randn(N, 1, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = mod.ElasticSampler(N, GLOBAL_BATCH, seed=SEED)
    manager = CheckpointManager(out / "ckpt", keep=2)
    step = 0
    found = manager.load_latest()
    if found is not None:
        step, state = found
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["data"])
    plan = mod.plan_batches(GLOBAL_BATCH, world, MAX_PER_RANK)
    _gate(out, step, world, rank)
    while step < sampler.steps_per_epoch:
        indices = [int(i) for i in sampler.rank_batches(rank, world)[0]]
        optimizer.zero_grad()
        for part, weight in plan.micro_slices(rank):
            idx = torch.tensor(indices[part])
            (F.mse_loss(model(x[idx]), y[idx]) * weight).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        sampler.advance()
        step += 1
        _write_json(out / "records" / f"step{step:03d}.rank{rank}.{attempt}.json",
                    {"step": step, "rank": rank, "world": world, "attempt": attempt, "ids": indices,
                     "agent": os.environ.get("COURSE_TORCHRUN_AGENT"),
                     "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
        manager.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "data": sampler.state_dict()})
        _gate(out, step, world, rank)


def main() -> None:
    ref = grading.ModuleRef("4.3", os.environ["COURSE_GRADE_KIND"], os.environ["COURSE_GRADE_LOCATION"])
    out = Path(os.environ["COURSE_RESULT_DIR"])
    init_distributed(timeout_s=30)
    rank = dist.get_rank()
    start = [time.time_ns()]
    dist.broadcast_object_list(start, src=0)
    try:
        run(ref.load(), out, start[0])
        dist.barrier()  # nobody tears the group down while a peer still works
        code = 0
    except Exception as exc:  # noqa: BLE001 - the test reports it
        _write_json(out / "errors" / f"rank{rank}.{start[0]}.json",
                    {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    os._exit(code)  # a failing rank leaves at once: its agent then restarts the group


if __name__ == "__main__":
    main()
