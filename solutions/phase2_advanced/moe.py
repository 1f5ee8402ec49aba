"""Exercise 2.10: expert parallelism — a mixture-of-experts layer whose experts live on different ranks.

A mixture-of-experts (MoE) layer replaces one MLP by E MLPs, the experts, and a router
that sends each token to k of them (Switch Transformer: k = 1; GShard, V-MoE: k = 2).
Parameters grow E-fold, the FLOPs per token only k-fold. With expert parallelism the
E experts are split over the ep ranks of a group (rank j of it holds experts
[j*E/ep, (j+1)*E/ep)); every rank keeps its own tokens and a replica of the router, and
two all-to-alls move each token to the rank of its expert and its result back:

    rank 0 tokens ─router─> choices ─sort by expert─┐               ┌─ experts 0..E/ep-1 ─┐
                                                    ├─ all-to-all ──┤  (rows from every   ├─ all-to-all ─> rows back,
    rank 1 tokens ─router─> choices ─sort by expert─┘  (dispatch)   └─ rank, any order)  ─┘   (combine)    weighted, summed

The contract, for one group of T tokens (one rank's), logits (T, E) = router(x):

  * route: probabilities p = softmax(logits.float()): float32 whatever the logits' dtype (bf16,
    float64), and every decision below is made on them. Each token takes its k most probable
    experts, best first; equal probabilities: the LOWER expert index first, for any E, also where
    the logits differ (0 and 1e-8 give equal float32 probabilities). Gate weights:
    p itself for k = 1 (Switch), renormalised over the k choices, p_j / sum of the k, for k >= 2
    (GShard), whether the assignment is kept or not. weights and aux_loss are float32.
  * capacity: C = expert_capacity(T, E, k, capacity_factor) slots per expert for this group.
    Assignments claim slots in (choice, token) order: every token's first choice, tokens in
    order, then every token's second choice, ...; an assignment is kept iff fewer than C
    earlier ones went to the same expert. A dropped assignment contributes nothing (the
    residual around the layer carries the token).
  * balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; GShard's l_aux for k = 2):
        aux = E * sum_i f_i * P_i,   f_i = share of the T tokens whose FIRST choice is i,
                                     P_i = mean over the T tokens of p_i.
    f_i counts every first choice, dropped or not (as both papers' algorithms do); it is a
    constant (no gradient), P_i carries the gradient to the router. aux = 1 when balanced.
    A group of no tokens (T = 0): experts, weights and kept are (0, k), aux = 0 (not the NaN of
    a mean over nothing, which the sync would spread to every rank's router).
  * output: y_t = sum over the kept choices j of token t of weight_tj * expert_{e_tj}(x_t),
    in x's dtype (the weights cast to it).

Training on W ranks (ep divides W; 2.8's mesh with rank = i*ep + j): the rows i are the ep
groups (the all-to-alls), the columns the expert-data-parallel groups (the ranks that hold
the same experts). Each rank backpropagates its own loss_r = task_r + alpha * aux_r; the
objective is their mean, so after backward every gradient is made that of the mean:
the router (replicated everywhere) averaged over the W ranks, each expert summed over its
column and divided by W (its gradient already sums the losses of its whole row).

Cost per layer and step, per rank: 4 all-to-alls of the kept rows (dispatch and combine,
forward and backward), each at most k*T*hidden elements sent (no padding: the split sizes
are exchanged first, E integers), of which (ep-1)/ep leave the rank on balanced routing.
Every rank makes all of them, even one that sends or receives no row (T = 0, or experts no
token picked): an all-to-all left out on one rank leaves its peers waiting (a deadlock).

Production: torchtitan's MoE with expert parallelism (all_to_all_single_autograd and a
grouped GEMM), Megatron-LM's --expert-model-parallel-size, DeepSpeed-MoE
(phase2_advanced/guidelines.md, 2.10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.distributed import current_device

from .mesh import build_groups
from .tensor_parallel import MLP


def _ep(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(this rank's index in the expert-parallel group, its size); None is the default group."""
    return dist.get_rank(group), dist.get_world_size(group)


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float | None) -> int:
    """Slots per expert for a group of `tokens` tokens: ceil(capacity_factor * k * tokens / num_experts).
    capacity_factor None: no token is ever dropped (an expert gets each token at most once)."""
    if capacity_factor is None:
        return tokens
    if capacity_factor < 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be >= 0 (or None: no dropping)")
    return math.ceil(capacity_factor * k * tokens / num_experts)


def load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean of the tokens each expert processed: 1.0 when balanced, E when one expert takes all.
    The slowest expert (and the rank holding it) sets the layer's time. No token at all: 1.0."""
    counts = tokens_per_expert.double()
    mean = counts.mean().item()
    return counts.max().item() / mean if mean > 0 else 1.0


# ------------------------------------------------------------------ the router


@dataclass
class Routing:
    """What the router decided for one group of T tokens (see the module docstring)."""

    experts: torch.Tensor  # (T, k) int64: the experts of each token, best first
    weights: torch.Tensor  # (T, k) float32: their gate weights (renormalised over the k when k >= 2)
    kept: torch.Tensor  # (T, k) bool: the assignment got a slot within its expert's capacity
    aux_loss: torch.Tensor  # () float32: the balancing loss E * sum_i f_i * P_i


def route(logits: torch.Tensor, k: int, capacity: int) -> Routing:
    """Top-k routing of one group: logits (T, E), any floating dtype -> Routing, decided on the
    float32 probabilities. Differentiable through the weights and aux_loss; experts and kept are
    decisions (no gradient). T = 0: empty experts, weights and kept, aux_loss 0."""
    tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and the number of experts, {num_experts}")
    # EXERCISE 2.10: the contract of the module docstring: top-k (ties: lower expert), gates, slots in (choice, token) order, aux
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = probs.sort(dim=-1, descending=True, stable=True)  # stable: equal p keep index order
    top, experts = top[:, :k], experts[:, :k]
    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top
    queue = F.one_hot(experts.t().reshape(-1), num_experts)  # (k*T, E): assignments in (choice, token) order
    position = (queue.cumsum(dim=0) * queue).sum(dim=-1) - 1  # how many earlier ones went to the same expert
    kept = (position < capacity).view(k, tokens).t()
    first = F.one_hot(experts[:, 0], num_experts).float().mean(dim=0)  # f_i: first choices, dropped or not
    aux_loss = num_experts * (first * probs.mean(dim=0)).sum() if tokens else probs.sum()  # T = 0: 0, not NaN
    return Routing(experts, weights, kept, aux_loss)
    # END EXERCISE


# ------------------------------------------------------------------ all-to-all with uneven splits


class _AllToAll(torch.autograd.Function):
    """Forward: rows of x go to the ranks of `group` as send_splits says; backward: their gradients come back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        # EXERCISE 2.10: rows of x, send_splits[q] of them in turn, go to rank q; return the rows received (all_to_all's docstring)
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out
        # END EXERCISE

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # EXERCISE 2.10: (the gradient of x, None, None, None): each row's gradient goes back to the rank it came from
        out = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return out, None, None, None
        # END EXERCISE


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-to-all of rows within `group` (None: the default group).

    x (sum(send_splits), ...): its first send_splits[0] rows go to rank 0 of the group, the
    next send_splits[1] to rank 1, ... Returns (sum(recv_splits), ...): the recv_splits[q] rows
    rank q sent to this rank, in rank order q = 0, 1, ... Every rank passes the splits that
    match its peers' (recv_splits[q] here == send_splits[this rank] on rank q). Backward sends
    each row's gradient back to the rank the row came from. x is left unchanged."""
    return _AllToAll.apply(x, [int(n) for n in send_splits], [int(n) for n in recv_splits], group)


# ------------------------------------------------------------------ the layers


class MoE(nn.Module):
    """Reference mixture-of-experts layer in one process (the ground truth of 2.10).

    x (G, T, hidden): G groups of T tokens (group g = the tokens of rank g), each routed on
    its own (its own capacity, its own aux). Returns (y (G, T, hidden), the mean of the G
    groups' aux losses). router: nn.Linear(hidden, E, bias=False); experts: E of 2.7's MLP."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 1,
                 capacity_factor: float | None = None):
        super().__init__()
        self.hidden, self.ffn_hidden, self.num_experts = hidden, ffn_hidden, num_experts
        self.k, self.capacity_factor = k, capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, ffn_hidden) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, losses = [], []
        for tokens in x:  # one group at a time
            r = route(self.router(tokens), self.k,
                      expert_capacity(len(tokens), self.num_experts, self.k, self.capacity_factor))
            y = torch.zeros_like(tokens)
            for e, expert in enumerate(self.experts):
                token, choice = ((r.experts == e) & r.kept).nonzero(as_tuple=True)
                y = y.index_add(0, token, expert(tokens[token]) * r.weights[token, choice].unsqueeze(-1).to(y.dtype))
            outputs.append(y)
            losses.append(r.aux_loss)
        return torch.stack(outputs), torch.stack(losses).mean()


class ExpertParallelMoE(nn.Module):
    """MoE with its experts sharded over `group` (None: the default group; ep = its size).

    Rank j of the group holds experts [j*E/ep, (j+1)*E/ep) as self.experts (local index i is
    global expert j*E/ep + i) and a replica of the router. forward(x): x (T, hidden), this
    rank's tokens -> (y (T, hidden) in x's dtype, this rank's aux loss, float32), equal to MoE
    on the group of x (T = 0 included: the rank still joins both all-to-alls, its experts serve
    its peers). After each forward, self.tokens_per_expert (E/ep,) int64 holds how many rows each
    local expert processed in THAT forward (kept assignments from every rank of the group; set
    anew, not a running total)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 1,
                 capacity_factor: float | None = None, *, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        _, ep = _ep(group)
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} does not split over {ep} expert-parallel ranks: "
                             f"use a multiple of {ep}")
        self.hidden, self.ffn_hidden, self.num_experts = hidden, ffn_hidden, num_experts
        self.k, self.capacity_factor, self.group = k, capacity_factor, group
        self.local_experts = num_experts // ep
        device = device or current_device()
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device)
        self.experts = nn.ModuleList(MLP(hidden, ffn_hidden).to(device) for _ in range(self.local_experts))
        self.tokens_per_expert = torch.zeros(self.local_experts, dtype=torch.int64, device=device)

    @classmethod
    def from_full(cls, moe: MoE, *, group: dist.ProcessGroup | None = None) -> ExpertParallelMoE:
        """This rank's part of an unsharded MoE (the same weights on every rank): the router, and its experts."""
        layer = cls(moe.hidden, moe.ffn_hidden, moe.num_experts, moe.k, moe.capacity_factor,
                    device=moe.router.weight.device, group=group)
        rank, _ = _ep(group)
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            for i, expert in enumerate(layer.experts):
                expert.load_state_dict(moe.experts[rank * layer.local_experts + i].state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # EXERCISE 2.10: route, exchange counts, dispatch with all_to_all, run your experts, send back, weight and sum
        _, ep = _ep(self.group)
        tokens, local = len(x), self.local_experts
        r = route(self.router(x), self.k, expert_capacity(tokens, self.num_experts, self.k, self.capacity_factor))
        token, choice = r.kept.nonzero(as_tuple=True)
        expert = r.experts[token, choice]
        order = torch.argsort(expert, stable=True)  # rows grouped by expert, hence by destination rank
        token, choice, expert = token[order], choice[order], expert[order]
        counts = torch.bincount(expert, minlength=self.num_experts)  # rows to each expert, from here
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert], flattened
        received = received.view(ep, local)
        send, recv = counts.view(ep, local).sum(dim=1).tolist(), received.sum(dim=1).tolist()
        rows = all_to_all(x[token], send, recv, self.group)  # by source rank, then by local expert
        which = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), received.flatten())
        out = torch.zeros_like(rows)
        for i, mlp in enumerate(self.experts):
            index = (which == i).nonzero(as_tuple=True)[0]
            out = out.index_copy(0, index, mlp(rows[index]))
        back = all_to_all(out, recv, send, self.group)  # in the order this rank sent them
        y = torch.zeros_like(x).index_add(0, token, back * r.weights[token, choice].unsqueeze(-1).to(x.dtype))
        self.tokens_per_expert = received.sum(dim=0)
        return y, r.aux_loss
        # END EXERCISE


# ------------------------------------------------------------------ groups and gradients


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups on a (W/ep, ep) mesh of the world, rank = i*ep + j (2.8's layout)."""

    ep: dist.ProcessGroup  # row i: the ranks the experts are sharded over (the all-to-alls)
    expert_dp: dist.ProcessGroup  # column j: the ranks holding the same experts, other tokens


def build_expert_groups(ep: int) -> ExpertGroups:
    """Every rank calls it (collective): 2.8's build_groups(dp=W/ep, tp=ep), renamed."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"ep={ep} must divide the world size {world}")
    mesh = build_groups(world // ep, ep)
    return ExpertGroups(ep=mesh.tp, expert_dp=mesh.dp)


def sync_gradients(model: ExpertParallelMoE, groups: ExpertGroups) -> None:
    """After each rank's loss_r.backward(): make every gradient that of the mean of the W ranks' losses.

    model.router: replicated on every rank of the world: its gradient averaged over the world.
    model.experts: expert e's gradient already sums the losses of the ranks of this row (the
    ep group): summed over groups.expert_dp and divided by the world size W. A gradient that is
    None (the parameter took no part here) counts as zeros and is set."""
    # EXERCISE 2.10: the docstring's rule, parameter by parameter; which group and which divisor for each kind?
    world = dist.get_world_size()
    for params, group in ((model.router.parameters(), None), (model.experts.parameters(), groups.expert_dp)):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
    # END EXERCISE
