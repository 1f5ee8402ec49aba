"""One rank of test_3_3_runs_under_two_torchrun_agents, started by a real torchrun agent.

The graded module comes from the environment (COURSE_GRADE_KIND, COURSE_GRADE_LOCATION:
the fields of the test's ModuleRef). The rank builds its topology from torchrun's
variables with the graded topology_from_env(), its groups with the graded
build_groups(), all-reduces a few tensors hierarchically, and writes what it saw to
$COURSE_RESULT_DIR/rank<RANK>.pkl (plain data). A rank that raises writes its error
there and exits non-zero, so its agent stops the job at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TESTS), str(_TESTS.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import grading  # noqa: E402
from common.distributed import init_distributed  # noqa: E402
from torchrun_worker import report_and_exit  # noqa: E402

CASES = [(torch.float32, (1001,)), (torch.int64, (3, 5)), (torch.float64, (1,))]


def run(ref: grading.ModuleRef) -> dict:
    mod = ref.load()
    topology = mod.topology_from_env()
    out = {"env": {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
           "topology": {k: getattr(topology, k) for k in ("rank", "node_rank", "local_rank", "num_nodes",
                                                          "ranks_per_node")}}
    groups = mod.build_groups(topology)
    out["intra"] = dist.get_process_group_ranks(groups.intra)
    out["inter"] = dist.get_process_group_ranks(groups.inter)
    out["results"] = {}
    for dtype, shape in CASES:
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        x = (torch.randn(shape, generator=gen) * 10).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        mod.hierarchical_all_reduce(x, groups)
        out["results"][f"{dtype} {shape}"] = (x, expected)
    return out


def main() -> None:
    ref = grading.ModuleRef("3.3", os.environ["COURSE_GRADE_KIND"], os.environ["COURSE_GRADE_LOCATION"])
    result_dir = Path(os.environ["COURSE_RESULT_DIR"])
    init_distributed(timeout_s=float(os.environ.get("COURSE_PG_TIMEOUT_S", "60")))
    report_and_exit(lambda: run(ref), result_dir / f"rank{dist.get_rank()}.pkl")


if __name__ == "__main__":
    main()
