"""Exercise 2.7: tensor parallelism, Megatron style.

Every weight matrix of a block is split across the p ranks of a tensor-parallel process
group (`group=`, the default process group when None; p = its size, the tensor-parallel
degree); every rank of the group sees the same full batch. For one
linear layer Y = X A  (X: (b*s, h_in), A: (h_in, h_out); nn.Linear stores W = A^T):

    column-parallel  A = [A_1 | A_2 | ... | A_p]     Y_r = X A_r            no communication
    row-parallel     A = [A_1 ; A_2 ; ... ; A_p]     Y = sum_r X_r A_r      one all-reduce

Column then row needs ONE all-reduce, because GELU is element-wise and acts on the
column shards without gathering them. Megatron's MLP block on 2 ranks:

          rank 0:   X ─f─> X A_1 ─GELU─> Z_1 ─> Z_1 B_1 ─┐
                                                        g ─> Y = Z_1 B_1 + Z_2 B_2 + b
          rank 1:   X ─f─> X A_2 ─GELU─> Z_2 ─> Z_2 B_2 ─┘

    f  CopyToTensorParallelRegion      forward: identity      backward: all-reduce
    g  ReduceFromTensorParallelRegion  forward: all-reduce    backward: identity

Attention is the same shape: heads split over ranks (the fused qkv projection is
column-parallel, per head), attention per local head, output projection row-parallel.

Cost per block (MLP or attention), per step: one all-reduce of b*s*h activations in
forward (g) and one in backward (f); a transformer layer (attention + MLP) does 4.
A ring all-reduce of n bytes takes about 2(p-1)/p * n / bandwidth and sits on the
critical path (the next layer needs its result), so TP stays inside one node (NVLink).

Production: torch.distributed.tensor.parallel.parallelize_module(model, tp_mesh,
{"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}) over DTensor; Megatron-LM's
ColumnParallelLinear / RowParallelLinear.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.distributed import current_device


def _tp(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(this rank's index in the tensor-parallel group, its size); None is the default group."""
    return dist.get_rank(group), dist.get_world_size(group)


def _per_rank(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what}={n} does not split over {world} tensor-parallel ranks: use a multiple of {world}")
    return n // world


# ------------------------------------------------------------------ f, g and friends
# Inside the "tensor-parallel region" each rank holds a shard; outside it every rank
# holds the same full tensor. Each operator below is an autograd.Function whose
# backward is the conjugate of its forward; `Op.apply(x, group)` communicates within
# `group` (None: the default group; `Op.apply(x)` alike), and backward returns (gradient of
# x, None). Neither x nor the upstream gradient is modified: autograd may still use them.


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: enter the region. Forward: identity (every rank already holds the full X).
    Backward: all-reduce, since X feeds all p shards: dL/dX = sum_r dL_r/dX."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        raise NotImplementedError('TODO 2.7: x unchanged; backward will need the group (ctx is the place to keep it)')

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise NotImplementedError('TODO 2.7: (dL/dx summed over the ranks of the group, None); leave grad itself unmodified (guidelines 2.7, "f and g")')


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: leave the region by summing partial results. Forward: all-reduce.
    Backward: identity (each partial sum X_r A_r gets the full upstream gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        raise NotImplementedError('TODO 2.7: the sum of x over the ranks of the group, in a new tensor (x itself unmodified)')

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise NotImplementedError('TODO 2.7: (the upstream gradient unchanged, None): d(sum)/d(partial) is the identity')


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """Leave the region by concatenating shards: forward all-gathers the last dim in rank
    order, (..., n) -> (..., n*p); backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        raise NotImplementedError("TODO 2.7: every rank's x side by side along the last dim, in rank order of the group (the gloo note in the guidelines)")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise NotImplementedError("TODO 2.7: (the part of grad that forward took from this rank's x, None); no communication")


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Enter the region by slicing a full tensor: forward keeps this rank's slice of the
    last dim, (..., n*p) -> (..., n), no communication; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        raise NotImplementedError("TODO 2.7: this rank's n = x.shape[-1] / p columns of x, p = the group's size; no communication")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise NotImplementedError("TODO 2.7: (the gradient of the full x: every rank's grad side by side along the last dim, None)")


# ----------------------------------------------------------------- parallel linears


class ColumnParallelLinear(nn.Module):
    """nn.Linear(in_features, out_features) with the weight W (out, in) split along out.

    Rank r (its index in `group`, p = the group's size) holds rows [r*n, (r+1)*n) of W
    and of the bias (if any), n = out_features / p.
    Input (..., in_features), the same full tensor on every rank; it passes through f.
    Output (..., n): this rank's columns of Y, or (..., out_features) on every rank
    with gather_output=True (all-gather; its backward takes this rank's slice).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 *, device: torch.device | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group
        _, world = _tp(group)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.out_per_rank = _per_rank(out_features, world, "out_features")
        device = device or current_device()
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the FULL matrix, then keep this rank's shard: with the
        same seed on every rank the shards tile one nn.Linear (Megatron's CPU initialisation)."""
        self.copy_from_full_(nn.Linear(self.in_features, self.out_features, bias=self.bias is not None))

    @classmethod
    def from_full(cls, linear: nn.Linear, gather_output: bool = False, *,
                  group: dist.ProcessGroup | None = None) -> ColumnParallelLinear:
        """This rank's shard of an unsharded nn.Linear (same weights on every rank of the group)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output,
                    device=linear.weight.device, group=group)
        return layer.copy_from_full_(linear)

    @torch.no_grad()
    def copy_from_full_(self, linear: nn.Linear) -> ColumnParallelLinear:
        """Overwrite this rank's shard with rows [r*n, (r+1)*n) of linear.weight and linear.bias."""
        raise NotImplementedError("TODO 2.7: self.weight (and self.bias, unless bias=False) := this rank's rows of linear's (see the class docstring)")
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO 2.7: (..., in) -> this rank's columns of x W^T + b (all columns if gather_output); x enters the region through f")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} on this rank), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """nn.Linear(in_features, out_features) with the weight W (out, in) split along in.

    Rank r (its index in `group`, p = the group's size) holds columns [r*n, (r+1)*n) of W,
    n = in_features / p, and the WHOLE bias if any (replicated), added once after the
    all-reduce of the partial sums (g).
    Input (..., n): this rank's slice of X (input_is_parallel=True, e.g. the output of a
    ColumnParallelLinear), or the full (..., in_features), sliced here first.
    Output (..., out_features), the same full tensor on every rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 *, device: torch.device | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group
        _, world = _tp(group)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self.in_per_rank = _per_rank(in_features, world, "in_features")
        device = device or current_device()
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Full nn.Linear initialisation, then keep this rank's shard (see ColumnParallelLinear)."""
        self.copy_from_full_(nn.Linear(self.in_features, self.out_features, bias=self.bias is not None))

    @classmethod
    def from_full(cls, linear: nn.Linear, input_is_parallel: bool = True, *,
                  group: dist.ProcessGroup | None = None) -> RowParallelLinear:
        """This rank's shard of an unsharded nn.Linear (same weights on every rank of the group)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel,
                    device=linear.weight.device, group=group)
        return layer.copy_from_full_(linear)

    @torch.no_grad()
    def copy_from_full_(self, linear: nn.Linear) -> RowParallelLinear:
        """Overwrite this rank's shard with columns [r*n, (r+1)*n) of linear.weight and the whole bias."""
        raise NotImplementedError("TODO 2.7: self.weight := this rank's columns of linear.weight; self.bias (unless bias=False) := all of linear.bias")
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError('TODO 2.7: -> the full x W^T + b on every rank: the partial sums leave the region through g; mind where the bias goes')

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """Reference (unsharded) transformer MLP: fc2(GELU(fc1(x))), (..., hidden) -> (..., hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """MLP with fc1 column-parallel (no gather) and fc2 row-parallel (input already split),
    both over `group` (None: the default group): one all-reduce in forward (fc2's g) and
    one in backward (fc1's f)."""

    def __init__(self, hidden: int, ffn_hidden: int, *, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, gather_output=False, device=device, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True, device=device, group=group)

    @classmethod
    def from_full(cls, mlp: MLP, *, group: dist.ProcessGroup | None = None) -> ParallelMLP:
        module = cls(mlp.fc1.in_features, mlp.fc1.out_features, device=mlp.fc1.weight.device, group=group)
        return module.copy_from_full_(mlp)

    def copy_from_full_(self, mlp: MLP) -> ParallelMLP:
        self.fc1.copy_from_full_(mlp.fc1)
        self.fc2.copy_from_full_(mlp.fc2)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO 2.7: MLP.forward's computation on the shards (which of its ops can act on a column shard?)")


# --------------------------------------------------------------------- attention


class SelfAttention(nn.Module):
    """Reference (unsharded) multi-head self-attention on (batch, seq, embed_dim).

    qkv = Linear(E, 3E): its output is [q | k | v], each E = H heads x D wide, head h in
    columns h*D:(h+1)*D (so rows h*D:(h+1)*D of W_q, W_k, W_v belong to head h);
    out = Linear(E, E) on the heads' outputs concatenated in head order.
    """

    def __init__(self, embed_dim: int, num_heads: int, causal: bool = False):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not a multiple of num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=-1)
        q, k, v = (t.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (b, heads, s, D)
        return self.out(y.transpose(1, 2).reshape(b, s, e))


class ParallelSelfAttention(nn.Module):
    """SelfAttention with its heads split over ranks: rank r owns heads [r*H/p, (r+1)*H/p).

    qkv  ColumnParallelLinear(E, 3E) whose weight on rank r is, PER HEAD,
             [W_q rows of my heads ; W_k rows of my heads ; W_v rows of my heads]   (3E/p, E)
         (not rows r*3E/p:(r+1)*3E/p of the fused weight!) and the bias likewise, so its
         output splits into this rank's q | k | v, each E/p = (H/p) * D wide;
    attention per local head: no communication, heads are independent;
    out  RowParallelLinear(E, E, input_is_parallel=True): its input is my heads' outputs.
    One all-reduce in forward (out's g), one in backward (qkv's f).
    """

    def __init__(self, embed_dim: int, num_heads: int, causal: bool = False, *, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        _, world = _tp(group)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not a multiple of num_heads={num_heads}")
        self.local_heads = _per_rank(num_heads, world, "num_heads")
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.head_dim = embed_dim // num_heads
        self.qkv = ColumnParallelLinear(embed_dim, 3 * embed_dim, gather_output=False, device=device, group=group)
        self.out = RowParallelLinear(embed_dim, embed_dim, input_is_parallel=True, device=device, group=group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A full SelfAttention's initialisation, then keep this rank's heads."""
        self.copy_from_full_(SelfAttention(self.embed_dim, self.num_heads, self.causal))

    @classmethod
    def from_full(cls, attn: SelfAttention, *, group: dist.ProcessGroup | None = None) -> ParallelSelfAttention:
        module = cls(attn.embed_dim, attn.num_heads, attn.causal, device=attn.qkv.weight.device, group=group)
        return module.copy_from_full_(attn)

    @torch.no_grad()
    def copy_from_full_(self, attn: SelfAttention) -> ParallelSelfAttention:
        """Copy this rank's heads: per-head rows of qkv (see the class docstring), out as a RowParallelLinear."""
        raise NotImplementedError("TODO 2.7: self.qkv := this rank's heads' rows of EACH of W_q, W_k, W_v (weight, bias; the docstring's layout); self.out: attn.out")
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, E) -> (batch, seq, E), the same full tensor on every rank."""
        raise NotImplementedError("TODO 2.7: SelfAttention.forward on this rank's self.local_heads heads; self.out finishes with the one all-reduce")
