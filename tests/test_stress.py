"""Worlds end cleanly every time, not 98% of the time.

Ranks were seen to die (SIGABRT) while leaving, after they had delivered their result:
about 2% of worlds failed with "rank N died (killed by signal 6) before reporting". Now
no rank leaves before every rank has delivered (a barrier on the parent's store), and a
rank leaves without tearing its process group down. This runs worlds whose ranks finish
at different moments (one rank leaves while its peer still works) and demands that
every one succeeds with no rank dying at all, not even after delivering.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from common.launch import run_world

WORLDS = 24  # ~8 s on 2 cores with the fork server; a spawn-only platform takes ~10x longer


def _uneven_finish(world: int):
    rank, size = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(3)
    for step in range(3):
        t = torch.full((3,), float(rank + step))
        dist.all_reduce(t)
        found = torch.tensor([float(rank == step % size)])
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        total += t * found
    # One rank has more left to do after the last collective: its peers leave first.
    if rank == world % size:
        x, m = torch.eye(64), torch.full((64, 64), 1.0 / 64)
        for _ in range(200):
            x = x @ m
    return total.tolist()


def test_many_worlds_all_end_cleanly():
    for world in range(WORLDS):
        size = 3 if world % 4 == 3 else 2  # mostly pairs, as in the failures seen; some trios
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = run_world(_uneven_finish, size, args=(world,), timeout=120)
        step_sum = [sum(r + step for r in range(size)) for step in range(3)]
        assert results == [[float(sum(step_sum))] * 3] * size, f"world {world}: {results}"
        deaths = [str(w.message) for w in caught if "delivered its result" in str(w.message)]
        assert not deaths, f"world {world} of {size} ranks: {deaths}"
