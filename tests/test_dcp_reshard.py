"""torch.distributed.checkpoint reshards on gloo/CPU (torch 2.14, run on 2.14.1): a demo, not graded.

Phase 4.3's guidelines (section "Resharding with torch.distributed.checkpoint") rely on it:
a state sharded over 2 ranks is saved with dcp.save and loaded into 1, 3 and 4 ranks with
dcp.load through solutions.phase4_production.elastic's save_sharded / load_sharded. It lives
outside tests/test_phase4.py so that grading a learner's phase 4 does not pay for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.launch import run_world
from compare import assert_no_problems, diff_report

def _dcp_reshard(folder: str) -> dict:
    """In a world of 4: a (10, 3) state sharded Shard(0) over ranks {0, 1} is saved with DCP, then
    loaded into Shard(0) layouts over 1, 3 and 4 ranks (uneven shards included)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from solutions.phase4_production.elastic import load_sharded, save_sharded

    rank = dist.get_rank()
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    meshes = {n: DeviceMesh("cpu", list(range(n))) for n in (2, 1, 3, 4)}  # every rank builds every mesh
    if rank < 2:
        save_sharded({"exp_avg": distribute_tensor(full, meshes[2], [Shard(0)]), "step": torch.tensor(5)}, folder,
                     meshes[2].get_group())
    dist.barrier()
    out = {}
    for n in (1, 3, 4):
        if rank < n:
            state = {"exp_avg": distribute_tensor(torch.zeros(10, 3), meshes[n], [Shard(0)]), "step": torch.tensor(0)}
            load_sharded(state, folder, meshes[n].get_group())
            out[n] = {"local": state["exp_avg"].to_local().clone(), "full": state["exp_avg"].full_tensor(),
                      "step": int(state["step"])}
        dist.barrier()
    return out


def test_dcp_reshards_a_state_saved_by_2_ranks_into_1_3_and_4(tmp_path):
    """torch 2.14 (run on 2.14.1), gloo on CPU: dcp.save from 2 ranks, dcp.load into 1, 3 and 4 ranks."""
    results = run_world(_dcp_reshard, 4, args=(str(tmp_path / "dcp"),))
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    problems = []
    for n in (1, 3, 4):
        rows = list(torch.arange(10).chunk(n))
        for rank in range(n):
            got = results[rank][n]
            want = full[rows[rank]] if rank < len(rows) else full[:0]
            for what, a, b in (("local shard", got["local"], want), ("full tensor", got["full"], full)):
                report = diff_report(a, b, f"loaded into {n} ranks, rank {rank}: {what}")
                if report:
                    problems.append(report)
            if got["step"] != 5:
                problems.append(f"loaded into {n} ranks, rank {rank}: replicated 'step' is {got['step']}, expected 5")
    assert_no_problems(problems, "torch.distributed.checkpoint resharding 2 -> 1, 3, 4 ranks:")
