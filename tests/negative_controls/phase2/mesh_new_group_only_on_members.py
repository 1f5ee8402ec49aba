"""Each rank calls dist.new_group only for its own row and column: ranks meet under the same group name for different groups.

Group names are a per-process counter of new_group calls, so rank 0's row {0, 1} and rank 2's
row {2, 3} are both "group 1" and meet in the same rendezvous. On torch 2.14.1 with gloo we saw both
outcomes, depending on timing: ranks wired to the wrong peers (an all-reduce "over {0, 1}" summed
ranks from both rows), or ranks waiting forever (the world's deadline ends it).
"""
import torch.distributed as dist

from solutions.phase2_advanced.mesh import *  # noqa: F401,F403

EXERCISE = "2.8"
WORLD_TIMEOUT = 15  # its tests' worlds take about a second; the deadlock is caught after 15 s, not 60
CAUGHT_BY = ["test_2_8_groups_are_the_rows_and_columns_of_the_mesh"]


def build_groups(dp, tp):
    i, j = divmod(dist.get_rank(), tp)
    tp_group = dist.new_group([i * tp + jj for jj in range(tp)])
    dp_group = dist.new_group([ii * tp + j for ii in range(dp)])
    return MeshGroups(dp=dp_group, tp=tp_group)  # noqa: F405
