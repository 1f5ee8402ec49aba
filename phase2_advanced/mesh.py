"""Exercise 2.8: process groups — data parallel over tensor parallel on a 2-D mesh.

The world's dp * tp ranks are laid out row-major on a (dp, tp) mesh, rank = i * tp + j:

                   tp (j) →
               ┌──────────┬──────────┐
     dp (i) ↓  │  rank 0  │  rank 1  │   tp group {0, 1}: one model replica, sharded (2.7)
               ├──────────┼──────────┤
               │  rank 2  │  rank 3  │   tp group {2, 3}: another replica, other data
               └──────────┴──────────┘
                 dp group   dp group
                 {0, 2}     {1, 3}       same shard, different data: average its gradient

  tp group of rank (i, j): row i      ranks i*tp .. i*tp + tp - 1   (consecutive: one node)
  dp group of rank (i, j): column j   ranks j, j + tp, j + 2*tp, ...

Each tp group trains one tensor-parallel replica on its own slice of the global batch
(dp slice i); the activation all-reduces of 2.7 run inside the tp group, and the
gradient of each shard is averaged over the dp group, the ranks that hold the same
shard. Result: exactly the training of one process on the whole global batch.

Every rank must call dist.new_group for EVERY group, in the same order, even groups it
is not in: a group is named by a per-process counter of new_group calls, and ranks
meet under that name (guidelines 2.8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .tensor_parallel import MLP, ParallelMLP


@dataclass(frozen=True)
class MeshGroups:
    """This rank's two process groups on a (dp, tp) mesh."""

    dp: dist.ProcessGroup  # the dp ranks holding the same shard (a column of the mesh)
    tp: dist.ProcessGroup  # the tp ranks sharing one replica (a row of the mesh)


def build_groups(dp: int, tp: int) -> MeshGroups:
    """Create the row (tp) and column (dp) groups of a (dp, tp) mesh over the whole world
    (dp * tp == world size, rank = i * tp + j) and return this rank's two.
    Collective: every rank of the world calls it, with the same arguments."""
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"a ({dp}, {tp}) mesh needs {dp * tp} ranks, the world has {world}")
    raise NotImplementedError("TODO 2.8: this rank's row and column of the mesh as groups; every rank creates every group, in the same order (docstring above)")


def train(full: MLP, x: torch.Tensor, y: torch.Tensor, groups: MeshGroups, *, steps: int, lr: float) -> ParallelMLP:
    """Train this rank's shard of `full` (the same weights on every rank) on the mesh.

    x, y: (B, hidden), the GLOBAL batch, the same on every rank; B divides by the dp size.
    This rank's model is a ParallelMLP over groups.tp; it trains on the rows of its dp
    index d = dist.get_rank(groups.dp): x.chunk(dp)[d]. Each step: loss =
    F.mse_loss(model(x_d), y_d), backward, gradients averaged over groups.dp, then
    plain SGD (p -= lr * grad). Returns the trained shard: equal, after `steps` steps,
    to this rank's shard of `full` trained in one process on F.mse_loss(full(x), y).
    """
    raise NotImplementedError('TODO 2.8: the contract above; which groups does each collective belong to (guidelines 2.8)?')
