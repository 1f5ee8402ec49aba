"""Exercise 2.11: 3-D parallelism — a transformer on a (dp, pp, tp) mesh.

The three earlier dimensions at once: tensor parallelism (2.7) inside every block,
pipeline stages (2.5, 2.6) along the depth, data parallelism (2.8) across replicas.
pp * dp * tp ranks form a mesh with named dimensions. tp is innermost, so a tp group is
consecutive ranks (one node: its all-reduces run twice per block per pass, the most
frequent traffic, and the model waits for each); pp is outermost, so the stages are what
crosses the slow links between nodes (one activation per micro-batch, the least traffic):

    (pp, dp, tp) = (2, 2, 2): rank = (s * dp + d) * tp + t   (torchtitan's and Megatron-LM's order)

                      replica 0 (d = 0)     replica 1 (d = 1)
                    ┌────────┬────────┐   ┌────────┬────────┐
      stage 0       │ rank 0 │ rank 1 │   │ rank 2 │ rank 3 │   node A: blocks 0 .. L/2-1
                    └────────┴────────┘   └────────┴────────┘
                          │ activations down, their gradients up
                    ┌────────┬────────┐   ┌────────┬────────┐
      stage 1       │ rank 4 │ rank 5 │   │ rank 6 │ rank 7 │   node B: blocks L/2 .. L-1
                    └────────┴────────┘   └────────┴────────┘
        tp {0,1}: two all-reduces of (b/m, seq, h) per block, forward and backward
        dp {0,2}: this rank's gradient shard, once per step (the same shard of the same stage)
        pp {0,4}: one (b/m, seq, h) activation forward and one gradient back per micro-batch

Each rank runs its pipeline row (2.6's schedule and executor) on its replica's slice of
the global batch; inside a stage every layer is tensor-parallel over the tp group; after
the pipeline, each gradient is averaged over the dp group (the ranks holding the same
shard), never over pp or tp. Result: exactly the training of one process on the whole
global batch. Two things need all three groups' care: the loss (it exists on the last
stage of each replica only) and the gradient norm for clipping (every parameter counted
once: tp shards summed over the tp group, whole copies once, stages summed over pp).

Production (torch 2.14.1): torch.distributed.device_mesh.init_device_mesh with named
dimensions, DTensor's parallelize_module for tp, torch.distributed.pipelining for pp,
fully_shard for dp; torchtitan composes them in its parallelize step (guidelines 2.11).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.distributed import current_device
from common.split import balanced_ranges

from .context_parallel import Block, copy_block_
from .pipeline import VirtualStage, interleaved_schedule, one_f_one_b_schedule, run_pipeline, split_microbatches
from .tensor_parallel import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear

MESH_DIMS = ("pp", "dp", "tp")  # outermost first; callers index the mesh by name (mesh["dp"])


class Transformer(nn.Module):
    """A decoder stack of `layers` pre-LayerNorm blocks (2.9's Block: 2.7's attention and MLP):
    (batch, seq, hidden) -> (batch, seq, hidden). `blocks` is the nn.Sequential the pipeline cuts."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn_hidden: int, causal: bool = True):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(hidden, heads, ffn_hidden, causal) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class TensorParallelBlock(nn.Module):
    """2.9's Block with 2.7's tensor parallelism inside attention and MLP, over `group`.

    Input and output: the full (batch, seq, hidden) on every rank of the group. ln1, ln2 and
    the row-parallel biases (attn.out.bias, mlp.fc2.bias) are whole copies on every rank: each
    rank saw every position, so their gradients are already equal across the group (no
    reduction, unlike 2.9's sequence parallelism). No dropout: it would need the same mask on
    every rank of the group."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, causal: bool = False, *,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, device=device)
        self.ln2 = nn.LayerNorm(hidden, device=device)
        self.attn = ParallelSelfAttention(hidden, heads, causal, device=device, group=group)
        self.mlp = ParallelMLP(hidden, ffn_hidden, device=device, group=group)

    @classmethod
    def from_full(cls, block: Block, *, group: dist.ProcessGroup | None = None) -> TensorParallelBlock:
        """This rank's part of an unsharded Block (the same weights on every rank of the group)."""
        if block.drop.p:
            raise ValueError(f"a tensor-parallel block here has no dropout (the Block has p={block.drop.p}): "
                             "every rank of the group would need the same mask")
        attn = block.attn
        return copy_block_(cls(attn.embed_dim, attn.num_heads, block.mlp.fc1.out_features, attn.causal,
                               device=block.ln1.weight.device, group=group), block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_mesh(dp: int, pp: int, tp: int) -> DeviceMesh:
    """The world as a mesh of sizes dp, pp, tp with dimension names "dp", "pp", "tp", tp innermost (a tp
    group is tp consecutive ranks), laid out in the order MESH_DIMS (pp outermost). Collective: every
    rank calls it with the same arguments. Raises ValueError unless dp * pp * tp is the world size.
    dp outermost is a valid layout too; the rest of this exercise only indexes the mesh by name."""
    raise NotImplementedError('TODO 2.11: check the sizes, then one init_device_mesh call: its device type, shape and names (guidelines 2.11)')


def build_stages(model: Transformer, mesh: DeviceMesh, num_chunks: int = 1) -> list[VirtualStage]:
    """This rank's pipeline stages of `model` (the same weights on every rank), tensor-parallel.

    The L blocks are cut into V = pp * num_chunks virtual stages, stage k holding the blocks
    balanced_ranges(L, V)[k]; this rank, at index s of its pp group, holds stages s, s + pp, ...,
    s + (num_chunks - 1) * pp (2.6's round-robin; num_chunks = 1: stage s alone), in that order.
    Each is a VirtualStage whose layers are TensorParallelBlock.from_full(block, group=this rank's
    tp group), and whose `ranks[k]` is the GLOBAL rank of this rank's pp group holding stage k.
    `model` is left as it was: the stages hold their own parameters, whatever tp is.
    """
    raise NotImplementedError('TODO 2.11: my pp index and pp group\'s global ranks (mesh["pp"]); VirtualStage per chunk over tp-sharded blocks')


def grad_norm(stages: list[VirtualStage], mesh: DeviceMesh) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (every parameter of every stage counted once), the
    same 0-d float32 tensor on every rank. A parameter is a tp shard when it is a
    ColumnParallelLinear's, or a RowParallelLinear's weight; every other parameter is a whole copy
    on each rank of the tp group. Replicas (dp) hold the same gradients: not summed over dp.
    Parameters without a gradient count as zero. Collective over the tp and pp groups."""
    raise NotImplementedError("TODO 2.11: sums of squares: shards summed over tp, whole copies once, then every stage's over pp")


def train_step(stages: list[VirtualStage], mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor, *,
               num_microbatches: int, lr: float, max_norm: float | None = None) -> float:
    """One step of SGD on the mesh; returns the loss of the GLOBAL batch (a float, on every rank).

    x, y: (B, seq, hidden), the global batch, the same on every rank; B divides by the dp size,
    and this rank's replica (its index d in mesh["dp"]) trains on x.chunk(dp)[d] cut into
    num_microbatches (2.6's split_microbatches; ValueError if they do not divide). The stages
    run their pp row of 2.6's 1F1B schedule (num_chunks = 1) or interleaved schedule (several
    stages per rank) with run_pipeline and loss F.mse_loss; then each gradient is averaged over
    mesh["dp"]; with max_norm, gradients are scaled by min(1, max_norm / (grad_norm + 1e-6))
    (torch.nn.utils.clip_grad_norm_'s rule); then p -= lr * grad. Gradients are zeroed before the
    pipeline runs. Afterwards every parameter equals one process's after the same step on
    F.mse_loss(model(x), y), and the loss returned is that process's loss before the step.
    """
    raise NotImplementedError('TODO 2.11: dp slice, micro-batches, my pp row of a schedule, run_pipeline; dp-averaged grads, clip, SGD; loss to all')


def train(model: Transformer, x: torch.Tensor, y: torch.Tensor, mesh: DeviceMesh, *, steps: int, lr: float,
          num_microbatches: int, num_chunks: int = 1,
          max_norm: float | None = None) -> tuple[list[VirtualStage], list[float]]:
    """build_stages, then `steps` train_steps: this rank's trained stages and the loss of each step."""
    stages = build_stages(model, mesh, num_chunks)
    losses = [train_step(stages, mesh, x, y, num_microbatches=num_microbatches, lr=lr, max_norm=max_norm)
              for _ in range(steps)]
    return stages, losses
