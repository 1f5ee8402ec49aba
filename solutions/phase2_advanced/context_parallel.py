"""Exercise 2.9: sequence and context parallelism — long sequences on many ranks.

Two ways to split the SEQUENCE of a transformer's activations over ranks.

Sequence parallelism (SP, Korthikanti et al. 2022), on 2.7's tensor-parallel block. 2.7
left the (b, s, h) tensors around each block (LayerNorm, dropout, residual) whole on
every one of the t ranks. SP keeps them split along s, and turns each of 2.7's region
operators into its sequence-parallel form (same bytes: an all-reduce IS a reduce-scatter
then an all-gather):

    (b, s/t, h) ─LN─> g ─> (b, s, h) ─column─> shards ─row─> partial (b, s, h) ─ḡ─> (b, s/t, h) ─+x─>
                      │                                                            │
    g  GatherFromSequenceParallelRegion        forward: all-gather s    backward: reduce-scatter
    ḡ  ReduceScatterToSequenceParallelRegion   forward: reduce-scatter  backward: all-gather

Context parallelism (CP, ring attention): attention itself runs on sequence chunks.
Each of cp ranks holds the Q, K, V of 2 of the 2cp chunks of the sequence, chunks
i and 2cp-1-i ("load-balanced": under a causal mask every rank then has the same work);
the K/V blocks travel around a ring while each rank computes with the one it holds:

      step 0          step 1          step 2          step 3        (cp = 4; rank r holds
    r0: KV0   ──>   r1: KV0   ──>   r2: KV0   ──>   r3: KV0          Q_r throughout)
    r1: KV1         r2: KV1         r3: KV1         r0: KV1
    ...  each rank sends the block it holds to rank r+1 while computing with it

Partial results merge with the log-sum-exp rule (online softmax), so no rank ever holds
the S x S score matrix, only (S/cp) x (S/cp) blocks. DeepSpeed-Ulysses instead swaps
sequence for heads with two all-to-alls (heads must divide by cp): ulysses_attention.

Cost per layer and rank (elements; guidelines 2.9): ring attention sends (cp-1)/cp of the
full K and V in forward; SP's collectives move what 2.7's all-reduces move.

Production (torch 2.14.1): torch.distributed.tensor.experimental.context_parallel, and
SequenceParallel in torch.distributed.tensor.parallel; Megatron-LM's --sequence-parallel and
--context-parallel-size; DeepSpeed-Ulysses (guidelines 2.9, "In production").
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .tensor_parallel import MLP, ParallelMLP, ParallelSelfAttention, SelfAttention

SEQ_DIM = 1  # the sequence dimension of the (batch, seq, hidden) activations of sequence parallelism


def _group(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank's index in the group, its size); None is the default group."""
    return dist.get_rank(group), dist.get_world_size(group)


# ============================================================ sequence parallelism
# Each operator is an autograd.Function called as `Op.apply(x, group)` (None: the default
# group) on (batch, seq, ...) tensors; its backward returns (gradient of x, None). Neither x
# nor the upstream gradient is modified. Shards are CONTIGUOUS ranges of the sequence:
# rank r of t holds positions [r*s/t, (r+1)*s/t).


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g: (b, s/t, ...) -> (b, s, ...), every rank's shard side by side along dim 1 in rank
    order. Backward: the full gradient's sum over ranks, of which this rank keeps its own
    positions: a reduce-scatter (every rank's copy of the gathered tensor fed its own shards)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        # EXERCISE 2.9: every rank's x side by side along SEQ_DIM, in rank order of the group; backward needs the group
        ctx.group = group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_group(group)[1])]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=SEQ_DIM)
        # END EXERCISE

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # EXERCISE 2.9: (this rank's positions of grad, summed over the group, None): one reduce-scatter (guidelines 2.9)
        world = _group(ctx.group)[1]
        parts = [part.contiguous() for part in grad.chunk(world, dim=SEQ_DIM)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine, None
        # END EXERCISE


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """ḡ: partial sums (b, s, ...) -> this rank's positions (b, s/t, ...) of their sum over
    ranks (a reduce-scatter). Backward: every rank's gradient slice gathered (an all-gather),
    since this rank's partial sum fed every rank's shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        # EXERCISE 2.9: this rank's s/t positions (SEQ_DIM) of the sum of x over the group; backward needs the group
        ctx.group = group
        parts = [part.contiguous() for part in x.chunk(_group(group)[1], dim=SEQ_DIM)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=group)
        return mine
        # END EXERCISE

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # EXERCISE 2.9: (every rank's grad concatenated along SEQ_DIM in rank order, None): one all-gather
        parts = [torch.empty_like(grad, memory_format=torch.contiguous_format) for _ in range(_group(ctx.group)[1])]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=SEQ_DIM), None
        # END EXERCISE


class Block(nn.Module):
    """Reference (unsharded) pre-LayerNorm transformer block on (batch, seq, hidden):

        x = x + dropout(attn(ln1(x)));   x = x + dropout(mlp(ln2(x)))

    attn is 2.7's SelfAttention (fused qkv, out), mlp 2.7's MLP (fc1, GELU, fc2)."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal)
        self.mlp = MLP(hidden, ffn_hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


@torch.no_grad()
def copy_block_(module: nn.Module, block: Block) -> nn.Module:
    """Copy an unsharded Block's weights into `module`, a block sharded over a group with the same four parts
    (ln1, ln2 whole; attn, mlp 2.7's parallel modules, each keeping this rank's shard). Returns module."""
    module.ln1.load_state_dict(block.ln1.state_dict())
    module.ln2.load_state_dict(block.ln2.state_dict())
    module.attn.copy_from_full_(block.attn)
    module.mlp.copy_from_full_(block.mlp)
    return module


class SequenceParallelBlock(nn.Module):
    """Block with tensor parallelism inside attention and MLP (2.7's shards: attn.qkv and
    mlp.fc1 column-parallel, attn.out and mlp.fc2 row-parallel, over `group`) and sequence
    parallelism outside them: input and output are this rank's (b, s/t, h) shard of the
    sequence, and ln1, ln2, dropout and the residual adds work on that shard.

    ln1, ln2 and the row-parallel biases (attn.out.bias, mlp.fc2.bias) are replicated: each
    rank's backward gives their gradient over its own s/t positions only, so after backward
    call reduce_replicated_grads() to sum them over the group.
    """

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, causal: bool = False, dropout: float = 0.0, *,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group
        self.ln1 = nn.LayerNorm(hidden, device=device)
        self.ln2 = nn.LayerNorm(hidden, device=device)
        self.attn = ParallelSelfAttention(hidden, heads, causal, device=device, group=group)
        self.mlp = ParallelMLP(hidden, ffn_hidden, device=device, group=group)
        self.drop = nn.Dropout(dropout)

    @classmethod
    def from_full(cls, block: Block, *, group: dist.ProcessGroup | None = None) -> SequenceParallelBlock:
        """This rank's part of an unsharded Block (the same weights on every rank of the group)."""
        attn = block.attn
        return copy_block_(cls(attn.embed_dim, attn.num_heads, block.mlp.fc1.out_features, attn.causal, block.drop.p,
                               device=block.ln1.weight.device, group=group), block)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/t, h) shard -> (b, s/t, h): this rank's positions of attn(full sequence)."""
        # EXERCISE 2.9: g in, 2.7's attention on my heads with self.attn's weights (no f, no all-reduce), ḡ out, then the bias
        attn = self.attn
        full = GatherFromSequenceParallelRegion.apply(x, self.group)
        b, s, _ = full.shape
        width = attn.local_heads * attn.head_dim
        q, k, v = F.linear(full, attn.qkv.weight, attn.qkv.bias).split(width, dim=-1)
        q, k, v = (t.reshape(b, s, attn.local_heads, attn.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal).transpose(1, 2).reshape(b, s, width)
        return ReduceScatterToSequenceParallelRegion.apply(F.linear(y, attn.out.weight), self.group) + attn.out.bias
        # END EXERCISE

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/t, h) shard -> (b, s/t, h): this rank's positions of mlp(full sequence)."""
        # EXERCISE 2.9: as _attention, with 2.7's MLP computation on self.mlp's shards
        mlp = self.mlp
        full = GatherFromSequenceParallelRegion.apply(x, self.group)
        z = F.gelu(F.linear(full, mlp.fc1.weight, mlp.fc1.bias))
        return ReduceScatterToSequenceParallelRegion.apply(F.linear(z, mlp.fc2.weight), self.group) + mlp.fc2.bias
        # END EXERCISE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/t, h): this rank's positions of the sequence -> the same positions of Block(x)."""
        # EXERCISE 2.9: Block.forward on the shard, with _attention and _mlp as the branches
        x = x + self.drop(self._attention(self.ln1(x)))
        return x + self.drop(self._mlp(self.ln2(x)))
        # END EXERCISE

    def reduce_replicated_grads(self) -> None:
        """After backward: sum over the group the gradients of the parameters every rank holds
        whole (each saw only its own positions), so every rank has the full gradient."""
        # EXERCISE 2.9: sum over self.group the .grad of every parameter that is whole on each rank (which ones are?)
        for p in [*self.ln1.parameters(), *self.ln2.parameters(), self.attn.out.bias, self.mlp.fc2.bias]:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
        # END EXERCISE


# ============================================================ ring attention
# q, k, v: (batch, heads, n, head_dim), this rank's two chunks of the sequence (n = 2c,
# c = seq_len / 2cp), in the load-balanced layout below; the same layout for q and k/v.


def load_balanced_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds, in order: chunk rank then chunk
    2cp-1-rank of the sequence cut into 2cp equal chunks (a LongTensor of seq_len / cp)."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} does not split into 2 * cp = {2 * cp} equal chunks: "
                         f"use a multiple of {2 * cp}")
    # EXERCISE 2.9: chunk `rank` then chunk 2cp-1-rank, each c = seq_len / 2cp positions long
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    # END EXERCISE


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = -2) -> torch.Tensor:
    """This rank's chunks of a full-sequence tensor (the sequence along `dim`)."""
    positions = load_balanced_positions(x.shape[dim], rank, cp).to(x.device)
    return x.index_select(dim, positions)


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (.., nq, d) over ONE block of keys k, v (.., nk, d): (out (.., nq, d),
    lse (.., nq)), lse_i = log sum_j exp(score_ij) over the keys query i may see. Causal: the
    query at global position q_pos[i] sees the key at k_pos[j] iff k_pos[j] <= q_pos[i]; every
    query must see at least one key of the block. Safe for scores of any size."""
    # EXERCISE 2.9: scaled scores, the causal mask on GLOBAL positions, a softmax that subtracts each row's max; (out, lse)
    scores = (q @ k.mT) * scale
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / total, (top + torch.log(total)).squeeze(-1)
    # END EXERCISE


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A (out, lse) and over keys B (block_out, block_lse) -> attention over
    A and B, for every query (each must see at least one key of A and one of B)."""
    # EXERCISE 2.9: the log-sum-exp rule: new lse, then each output weighted by exp(its lse - new lse)
    new = torch.logaddexp(lse, block_lse)
    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(block_lse - new).unsqueeze(-1) * block_out), new
    # END EXERCISE


def _needed(rank: int, src: int, c: int, causal: bool) -> tuple[slice, slice]:
    """(rows of my q, columns of the block that rank src holds) that can see each other. Under
    the causal mask in the load-balanced layout, all of my own block is needed (with the
    mask) and exactly half of every other one (without it)."""
    # EXERCISE 2.9: my chunks are rank and 2cp-1-rank, src's are src and 2cp-1-src: which come before which? (guidelines 2.9)
    everything = slice(None)
    if not causal or src == rank:
        return everything, everything
    if src < rank:  # its first chunk is before both of mine, its second after both
        return everything, slice(0, c)
    return slice(c, None), everything  # its two chunks are after my first, before my second
    # END EXERCISE


class RingAttention(torch.autograd.Function):
    """Ring attention over the ranks of `group`: apply(q, k, v, causal, group) -> this rank's
    rows of softmax(Q K^T / sqrt(d) [causal mask]) V over the WHOLE sequence."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        # EXERCISE 2.9: cp steps: start passing the held K/V on, compute with it (only what _needed says), merge, then wait; save lse
        rank, cp = _group(group)
        n, c = q.shape[-2], q.shape[-2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        nxt, prv = _ring_peers(group)
        q_pos = load_balanced_positions(n * cp, rank, cp).to(q.device)
        out = lse = None
        kv = (k.contiguous(), v.contiguous())
        for step in range(cp):
            src = (rank - step) % cp
            pending = _ring_exchange(kv, nxt, prv, group) if step < cp - 1 else None
            rows, cols = _needed(rank, src, c, causal)
            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)
            block_out, block_lse = attention_block(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                   q_pos[rows], k_pos[cols], causal, scale)
            if out is None:
                out, lse = block_out, block_lse
            else:
                merged = merge_partials(out[..., rows, :], lse[..., rows], block_out, block_lse)
                out[..., rows, :], lse[..., rows] = merged
            if pending is not None:
                kv = pending()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out
        # END EXERCISE

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        # EXERCISE 2.9: the ring again, P from the saved lse; dK/dV accumulate while travelling with their block, then go home
        q, k, v, out, lse = ctx.saved_tensors
        causal, group = ctx.causal, ctx.group
        rank, cp = _group(group)
        n, c = q.shape[-2], q.shape[-2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        nxt, prv = _ring_peers(group)
        q_pos = load_balanced_positions(n * cp, rank, cp).to(q.device)
        delta = (dout * out).sum(dim=-1, keepdim=True)  # D_i = sum_d dO_i O_i
        dq = torch.zeros_like(q)
        kv = (k.contiguous(), v.contiguous())
        dkv = tuple(torch.zeros_like(t) for t in kv)  # like the contiguous copies: they are sent
        for step in range(cp):
            src = (rank - step) % cp
            pending = _ring_exchange(kv, nxt, prv, group) if step < cp - 1 else None
            rows, cols = _needed(rank, src, c, causal)
            kb, vb = kv[0][..., cols, :], kv[1][..., cols, :]
            k_pos = load_balanced_positions(n * cp, src, cp).to(q.device)
            scores = (q[..., rows, :] @ kb.mT) * scale
            if causal:
                scores = scores.masked_fill(k_pos[cols][None, :] > q_pos[rows][:, None], float("-inf"))
            p = torch.exp(scores - lse[..., rows].unsqueeze(-1))
            dp = dout[..., rows, :] @ vb.mT
            ds = p * (dp - delta[..., rows, :]) * scale
            dq[..., rows, :] += ds @ kb
            dkv[0][..., cols, :] += ds.mT @ q[..., rows, :]
            dkv[1][..., cols, :] += p.mT @ dout[..., rows, :]
            dkv = _ring_exchange(dkv, nxt, prv, group)()  # on with their block; the last hop takes them home
            if pending is not None:
                kv = pending()
        return dq, dkv[0], dkv[1], None, None
        # END EXERCISE


def _ring_peers(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(the next rank, the previous rank) of this one on the ring of the group's ranks in order,
    as GLOBAL ranks (what send and receive take as dst and src)."""
    # EXERCISE 2.9: neighbours of my index in the group, mod its size, turned into global ranks (dist.get_global_rank)
    rank, cp = _group(group)
    group = group if group is not None else dist.group.WORLD
    return dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    # END EXERCISE


def _ring_exchange(tensors: tuple[torch.Tensor, ...], nxt: int, prv: int, group: dist.ProcessGroup | None):
    """Post sends of `tensors` to global rank nxt and receives of as many (same shapes) from
    global rank prv, without waiting; return a function that waits for all of them and returns
    the received tensors. In a group of one rank (nxt is this rank) nothing moves."""
    # EXERCISE 2.9: post non-blocking sends and receives (dist.batch_isend_irecv) in the group; return a function that waits
    if nxt == dist.get_rank():  # a ring of one rank: what it would send to itself stays
        return lambda: tensors
    received = tuple(torch.empty_like(t) for t in tensors)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors] + \
          [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    works = dist.batch_isend_irecv(ops)

    def wait() -> tuple[torch.Tensor, ...]:
        for work in works:
            work.wait()
        return received

    return wait
    # END EXERCISE


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over a sequence split over the cp ranks of `group` (None: the default group).

    q, k, v: (batch, heads, n, head_dim), this rank's positions load_balanced_positions(n * cp,
    rank, cp) of the full Q, K, V. Returns this rank's rows of
    F.scaled_dot_product_attention(Q, K, V, is_causal=causal), differentiable in q, k, v.
    Collective over the group."""
    if q.shape[-2] % 2 or q.shape[:-1] != k.shape[:-1] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v must be (batch, heads, n, head_dim) alike with n even (2 chunks per rank), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return RingAttention.apply(q, k, v, causal, group)


# ============================================================ DeepSpeed-Ulysses


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, to_heads: bool) -> torch.Tensor:
    """to_heads: (b, H, n, d) my sequence chunk of all heads -> (b, H/cp, cp*n, d) my heads
    (H/cp of them, in rank order) over the chunks of every rank (in rank order).
    Otherwise the inverse. One all_to_all_single."""
    # EXERCISE 2.9: dist.all_to_all_single sends slice j of dim 0 to rank j: put the split dim first, rearrange what arrives
    cp = _group(group)[1]
    if to_heads:
        b, heads, n, d = x.shape
        send = x.reshape(b, cp, heads // cp, n, d).transpose(0, 1).contiguous()  # [j]: rank j's heads
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # [j]: my heads, rank j's chunk
        return received.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * n, d)
    b, heads, length, d = x.shape
    send = x.reshape(b, heads, cp, length // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [j]: rank j's chunk
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [j]: rank j's heads, my chunk
    return received.transpose(0, 1).reshape(b, cp * heads, length // cp, d)
    # END EXERCISE


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, to_heads=True)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, to_heads=False), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group, to_heads=False)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, to_heads=True), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """ring_attention's contract (same layout, same result), by DeepSpeed-Ulysses: all-to-all
    to whole sequences of heads/cp heads, attention, all-to-all back. heads % cp must be 0."""
    cp = _group(group)[1]
    if q.shape[1] % cp:
        raise ValueError(f"Ulysses splits the {q.shape[1]} heads over {cp} ranks: use a multiple of {cp} heads")
    # EXERCISE 2.9: q, k, v to heads, attention in position order (the gathered chunks are in rank order), back to sequence
    q, k, v = (_SequenceToHeads.apply(t, group) for t in (q, k, v))
    length = q.shape[-2]
    order = torch.cat([load_balanced_positions(length, j, cp) for j in range(cp)]).to(q.device)
    natural = torch.argsort(order)
    y = F.scaled_dot_product_attention(q[..., natural, :], k[..., natural, :], v[..., natural, :], is_causal=causal)
    return _HeadsToSequence.apply(y[..., order, :], group)
    # END EXERCISE
