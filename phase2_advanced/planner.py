"""Exercise 2.12: a layout planner — memory and step time of a layout, before any GPU is booked.

Given a dense transformer, a cluster and a global batch, predict for each layout (dp with a
ZeRO stage, tp, pp with a schedule, cp, micro-batches, activation checkpointing) what one GPU
holds and how long a step takes, and rank the layouts that fit. Every number comes from a
formula of an earlier exercise, so the course's own worlds can check it (guidelines 2.12):

  memory per GPU (bytes), Psi = the parameters of the largest pipeline stage on one tp rank:
    parameters  Psi * P_p     gradients  Psi * P_g     optimizer  Psi * P_o      (2.4)
    /(dp*cp) from ZeRO stage 3 / stage 2 / stage 1 on (the data-parallel ranks: dp * cp)
    P = bytes per parameter: mixed precision 2 + 2 + 12 (the ZeRO paper's K = 12: fp32
    master weights, Adam's two moments); the course's fp32 worlds 4 + 4 + 8
    activations: in-flight (chunk, micro-batch) pairs on rank 0 (2.6) x layers per chunk x
    one layer's bytes (Korthikanti et al. 2022, Table 2, with sequence parallelism inside tp):
        s b h (34 + 5 a s / h) / t           s = sequence / cp, b = micro-batch, t = tp
        the 5as/h term (saved softmax) is 0 with FlashAttention-style kernels or cp > 1;
        checkpointing keeps 2 s b h / t per layer, plus one layer's full activations
    Layout(sp=False), tp without sequence parallelism (2.7, 2.11): s b h (10 + 24/t + 5 a s/(h t)),
    checkpointing keeps 2 s b h (the layer's input, whole on every tp rank)

  bytes each rank sends per step (ring algorithms of 1.3; S = the whole tensor):
    all-reduce 2(n-1)/n S     reduce-scatter, all-gather (n-1)/n S     send S
    tp  4 all-reduces of the (b, s, h) activation per layer and micro-batch (2.7; 6 with
        checkpointing: the forward runs twice); sequence parallelism's all-gather +
        reduce-scatter pairs move the same bytes (2.9)
    cp  ring attention: 3cp-2 hops of this rank's K and V per layer and micro-batch (2.9)
    pp  per micro-batch, an activation forward and a gradient back per stage boundary (2.6):
        (b, s, h / tp) with sequence parallelism, the whole (b, s, h) on every tp rank without
    dp  the gradient all-reduce (2.8), or ZeRO's reduce-scatter + all-gather (2.4)

  step time = (compute + tp + cp) / (1 - bubble) + pp + dp      (no overlap: an upper bound)
    compute = FLOPs per token x tokens / (world x peak x efficiency)    (Kaplan et al. 2020)
    each collective: latencies x alpha + bytes x beta (1.3), with the link of its group

Placement, tp innermost (rank = ((i_pp * dp + i_dp) * cp + i_cp) * tp + i_tp):

    node 0 (8 GPUs)                               node 1
    ┌──────────────────────────────────────────┐ ┌──────────────────────
    │ [tp tp] [tp tp] │ [tp tp] [tp tp]         │ │ [tp tp] [tp tp] ...
    │ └─ cp ──┘       │                         │ │
    │ └──────── dp ───┘                         │ │
    └──────────────────────────────────────────┘ └──────────────────────
                         └──────────── pp (outermost) ───────────┘

A group stays inside a node when its span (tp; tp*cp; tp*cp*dp; the world for pp) divides
the GPUs per node; otherwise its ring crosses nodes and the inter-node alpha, beta set the
pace. Expert parallelism (ep) is left out: it needs a mixture-of-experts model (experts,
top-k, capacity) and its all-to-all bytes depend on the routing (2.10 measures them).

Production: torchtitan's parallelize step and Megatron-LM's argument checks choose layouts
by hand from the same arithmetic; the JAX scaling book and the Ultra-Scale Playbook teach it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send")
DIMENSIONS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class Model:
    """A dense decoder transformer. Parameters of one layer (kv = hidden * kv_heads / heads):

        attention  hidden * (hidden + 2 kv) + hidden * hidden      (fused q|k|v, then out)
        MLP        2 * hidden * ffn_hidden  (gated, SwiGLU: 3 *)
        biases     (hidden + 2 kv) + ffn_hidden (gated: 2 ffn_hidden)  sharded by tp,
                   + 2 * hidden (out and MLP-down biases)               replicated   (bias only)
        2 norms    hidden each (LayerNorm with bias: 2 * hidden each)   replicated
    The model: an embedding vocab x hidden, the layers, a final norm, an output layer
    hidden x vocab (tied: the embedding itself when the whole model is on one stage).
    flash: attention kernels that save no s x s scores (FlashAttention, SDPA's flash path).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None  # None: as many as heads (multi-head attention)
    gated: bool = False
    bias: bool = True
    tied: bool = False
    flash: bool = False

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "ffn_hidden", "seq_len", "vocab"):
            _positive(field, getattr(self, field))
        kv = self.heads if self.kv_heads is None else self.kv_heads
        _positive("kv_heads", kv)
        if self.hidden % self.heads or self.heads % kv:
            raise ValueError(f"model {self.name}: heads must divide hidden and kv_heads divide heads, got hidden="
                             f"{self.hidden}, heads={self.heads}, kv_heads={kv}")

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): hidden * kv_heads / heads."""
        return self.hidden * (self.heads if self.kv_heads is None else self.kv_heads) // self.heads

    @property
    def norm_parameters(self) -> int:
        return (2 if self.bias else 1) * self.hidden

    def layer_parameters(self, tp: int = 1) -> int:
        """Parameters of one layer on one of tp ranks (sharded part / tp + replicated part)."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
        sharded = h * (h + 2 * kv) + h * h + (3 if self.gated else 2) * h * f
        replicated = 2 * self.norm_parameters
        if self.bias:
            sharded += h + 2 * kv + (2 if self.gated else 1) * f
            replicated += 2 * h
        return sharded // tp + replicated

    def parameters(self) -> int:
        """All parameters of the model (the formula of the class docstring)."""
        return stage_parameters(self, 1, 1)[0]


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node accelerators. memory_bytes per GPU; alpha (s) and beta (s/byte) of a
    link inside a node and between nodes (1.3); peak_flops (FLOP/s, dense, the training dtype)
    per GPU, of which the matrix products reach `efficiency`."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_bytes: float
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    peak_flops: float
    efficiency: float = 0.5

    def __post_init__(self):
        for field in ("nodes", "gpus_per_node"):
            _positive(field, getattr(self, field))
        numbers = (self.memory_bytes, self.beta_intra, self.beta_inter, self.peak_flops, self.efficiency)
        if min(numbers) <= 0 or min(self.alpha_intra, self.alpha_inter) < 0 or self.efficiency > 1:
            raise ValueError(f"cluster {self.name}: memory, betas, peak and efficiency (<= 1) must be > 0, alphas >= 0")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """How world = dp * cp * tp * pp ranks train: dp replicas (ZeRO stage `zero` shards over the
    dp * cp ranks that hold the same parameters), tp-way tensor parallelism, cp-way context
    parallelism (ring attention), pp stages run by `schedule` (interleaved: `chunks` = v model
    chunks per rank), `microbatches` per step per replica, activation checkpointing (full
    recompute of every layer) or not. sp: sequence parallelism inside tp (2.9); False: 2.7's
    tensor parallelism alone (2.11): the norms, dropouts and stage outputs whole on every tp rank."""

    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    cp: int = 1
    microbatches: int = 1
    checkpointing: bool = False
    sp: bool = True

    def __post_init__(self):
        for field in ("dp", "tp", "pp", "chunks", "cp", "microbatches"):
            _positive(field, getattr(self, field))
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp is True (sequence parallelism inside tp) or False, got {self.sp!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero is a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise ValueError(f"chunks = {self.chunks} needs schedule 'interleaved' (one chunk per rank otherwise)")
        if self.zero >= 2 and self.pp > 1:
            raise ValueError("ZeRO stage 2 or 3 with pp > 1: each micro-batch would reduce-scatter the gradients "
                             "(DeepSpeed refuses it); use zero <= 1 with pipelines")

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def describe(self) -> str:
        pipe = f"pp{self.pp} {self.schedule}" + (f" v{self.chunks}" if self.chunks > 1 else "")
        nosp = " nosp" if self.tp > 1 and not self.sp else ""
        return (f"dp{self.dp} zero{self.zero} tp{self.tp}{nosp} cp{self.cp} {pipe} m{self.microbatches}"
                + (" ckpt" if self.checkpointing else ""))


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the weights, of their gradients, of the optimizer's state (fp32
    master copy and Adam's moments, whatever it keeps), and per activation element."""

    params: int = 2
    grads: int = 2
    optimizer: int = 12
    activations: int = 2


MIXED = Precision(2, 2, 12, 2)  # bf16 weights and gradients, fp32 master + Adam (ZeRO paper, K = 12)
FP32 = Precision(4, 4, 8, 4)  # the course's worlds: fp32 weights, gradients, Adam's exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Collective:
    """`count` calls per step of collective `kind` in dimension `dim`'s groups of n ranks, each on a
    tensor of `nbytes` (the whole tensor: all-gather's output, reduce-scatter's input; a send's message)."""

    dim: str
    kind: str
    n: int
    nbytes: float
    count: int


@dataclass(frozen=True)
class Memory:
    """Bytes one GPU holds at its peak, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Memory
    time: dict  # step_time's terms, seconds


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def stage_parameters(model: Model, pp: int, tp: int) -> list[int]:
    """Parameters each of the pp pipeline ranks holds on one of its tp ranks: layers / pp layers
    each (interleaved chunks included); rank 0 also the embedding, rank pp-1 the final norm and
    the output layer (tied and pp = 1: none, it is the embedding; tied and pp > 1: a copy, as
    Megatron-LM keeps). Embedding and output are vocab-parallel: ceil(vocab / tp) rows each."""
    if model.layers % pp:
        raise ValueError(f"{model.layers} layers do not split over pp = {pp} stages: use a divisor")
    stages = [model.layers // pp * model.layer_parameters(tp)] * pp
    rows = -(-model.vocab // tp) * model.hidden
    stages[0] += rows
    stages[-1] += model.norm_parameters + (0 if model.tied and pp == 1 else rows)
    return stages


def micro_batch_size(layout: Layout, batch: int) -> int:
    """Sequences per micro-batch: batch / (dp * microbatches)."""
    return batch // (layout.dp * layout.microbatches)


def check_layout(model: Model, layout: Layout, batch: int) -> None:
    """ValueError (one line) unless the layout can run this model on this global batch (sequences)."""
    _positive("batch", batch)
    problems = []
    kv = model.kv_dim * model.heads // model.hidden
    if model.heads % layout.tp or kv % layout.tp or model.ffn_hidden % layout.tp:
        problems.append(f"tp = {layout.tp} must divide heads ({model.heads}), kv heads ({kv}) and ffn_hidden")
    if model.layers % (layout.pp * layout.chunks):
        problems.append(f"pp * chunks = {layout.pp * layout.chunks} must divide the {model.layers} layers")
    if layout.cp > 1 and model.seq_len % (2 * layout.cp):
        problems.append(f"2 * cp = {2 * layout.cp} must divide seq_len {model.seq_len} (2 chunks per rank, 2.9)")
    if batch % (layout.dp * layout.microbatches):
        problems.append(f"dp * microbatches = {layout.dp * layout.microbatches} must divide the batch {batch}")
    if layout.pp > 1 and layout.microbatches < layout.pp:
        problems.append(f"pp = {layout.pp} needs at least as many micro-batches, got {layout.microbatches}")
    if layout.schedule == "interleaved" and layout.microbatches % layout.pp:
        problems.append(f"interleaved needs micro-batches in groups of pp = {layout.pp}")
    if problems:
        raise ValueError(f"layout {layout.describe()} cannot run {model.name}: " + "; ".join(problems))


# ------------------------------------------------------------------ the schedule (2.6)


def in_flight(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> int:
    """The most (chunk, micro-batch) activations one rank holds at once: rank 0's peak, 2.6's
    max_in_flight of that schedule's rank 0 (pp = p, microbatches = m, chunks = v):
    gpipe m; 1f1b and zb-h1 min(p, m); interleaved min(2(p-1) + (v-1)p + 1, v m), which is 1F1B's
    min(p, m) when v = 1."""
    raise NotImplementedError("TODO 2.12: the docstring's count per schedule (2.6's module docstring says why each holds what it holds)")


def bubble_fraction(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of the pipeline's time (2.6), p = pp, m = microbatches, v = chunks:
    gpipe, 1f1b (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); zb-h1 with t_F = t_B = t_W:
    (p-1)(t_F+t_B-t_W) / (m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W)) = (p-1)/(3m+p-1). 0 when p = 1."""
    raise NotImplementedError("TODO 2.12: the docstring's fraction per schedule; zb-h1 from 2.6's zero-bubble time with F, B, W one unit each")


# ------------------------------------------------------------------ memory


def activation_bytes(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> float:
    """Activation bytes rank 0 holds at its peak (Korthikanti et al. 2022, Table 2). One layer, one
    micro-batch of b = micro_batch_size sequences, s = seq_len / cp, h = hidden, a = heads, t = tp:
        full   sp=True:  s b h (34 + 5 a s / h) / t           (sequence parallelism inside tp)
               sp=False: s b h (10 + 24 / t + 5 a s / (h t))  (Table 2's "tensor parallel" row)
               the 5as/h term (saved scores) is 0 when model.flash or cp > 1
        held   full, or with checkpointing only the layer's input: 2 s b h / t (sp=True), 2 s b h
               (sp=False: whole on every tp rank)
    held x layers per chunk (layers / (pp * chunks)) x in_flight(...), plus, with checkpointing,
    one layer's full activations (the layer being recomputed); all x precision.activations / 2
    (the formula counts 2-byte activations, 1-byte dropout masks).
    sp=False relies on the paper's count per layer (its Section 4.2: attention 11 s b h + 5 a s^2 b,
    MLP 19 s b h, two norms 4 s b h): without sequence parallelism 10 s b h stay whole on every tp
    rank (the norms' inputs 4, the inputs of the q|k|v and first MLP matrices 2 + 2, the two dropout
    masks 1 + 1); the other 24 s b h and the scores are split by heads or ffn columns."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: the docstring's formula (sp or not): one layer's bytes, times the layers of the chunks in flight on rank 0")


def memory(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> Memory:
    """Bytes one GPU holds: Psi = max(stage_parameters(model, pp, tp)) parameters, times
    precision.params, .grads, .optimizer; ZeRO stage >= 1 divides the optimizer state, >= 2 the
    gradients too, 3 the parameters too, by the dp * cp ranks holding the same parameters (2.4);
    activations: activation_bytes."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: the docstring's four terms (2.4's table of what each ZeRO stage shards)")


# ------------------------------------------------------------------ communication


def ring_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes one of n ranks sends for one collective on a tensor of nbytes (1.3's ring algorithms):
    all_reduce 2(n-1)/n nbytes; reduce_scatter, all_gather (n-1)/n nbytes; send nbytes; 0 when n = 1.
    ValueError for another kind."""
    raise NotImplementedError("TODO 2.12: the docstring's three cases (1.3's cost_terms for the ring); a group of one sends nothing")


def tp_collectives(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> list[Collective]:
    """Per step: 4 all-reduces (6 with checkpointing) per layer (layers / pp on a rank) and micro-batch
    in the tp group, each of a (b, seq_len / cp, hidden) activation of precision.activations bytes;
    [] when tp = 1. The same with or without layout.sp: sequence parallelism's all-gather +
    reduce-scatter pairs are an all-reduce's two halves (2.9), the same bytes."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: 2.7's f and g: how many all-reduces per layer forward and backward, and one more forward when recomputing?")


def cp_collectives(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> list[Collective]:
    """Per step: ring attention's sends in the cp group, per layer (layers / pp) and micro-batch: 3cp-2
    messages (4cp-3 with checkpointing: the forward's cp-1 again), each this rank's K and V, two
    (b, seq_len / cp, kv_dim / tp) tensors of precision.activations bytes; [] when cp = 1."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: 2.9's ring: K/V hops forward (cp-1), backward (cp-1) plus dK/dV (cp, the last one home)")


def pp_collectives(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> list[Collective]:
    """Per step, the busiest pipeline rank's sends: per micro-batch, one activation per virtual stage
    it holds that is not the last, one gradient per virtual stage it holds that is not the first:
    2v - 1 when pp = 2, 2v when pp > 2 (v = chunks); each a (b, seq_len / cp, hidden / tp) tensor
    of precision.activations bytes with layout.sp (the stage's output is sharded), the whole
    (b, seq_len / cp, hidden) without (sp=False: every tp rank sends it to its peer, 2.11).
    [] when pp = 1."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: the boundaries a rank's virtual stages send across (2.6's interleaved placement), times m; sp: h / tp")


def dp_collectives(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> list[Collective]:
    """Per step, over the n = dp * cp ranks holding the same parameters, Psi = max(stage_parameters):
    gradients G = Psi * precision.grads bytes, weights W = Psi * precision.params bytes, m = microbatches:
        zero 0  all_reduce(G) once
        zero 1  reduce_scatter(G) once, all_gather(W) once (the updated weights)
        zero 2  reduce_scatter(G) per micro-batch (no whole gradient is kept), all_gather(W) once
        zero 3  all_gather(W) twice per micro-batch (forward, backward), reduce_scatter(G) per micro-batch
    [] when n = 1."""
    check_layout(model, layout, batch)
    raise NotImplementedError("TODO 2.12: the docstring's table (2.4's guidelines: what each stage sends and when)")


def collectives(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> list[Collective]:
    """Every collective of a step: tp's, cp's, pp's, dp's."""
    return [c for fn in (tp_collectives, cp_collectives, pp_collectives, dp_collectives)
            for c in fn(model, layout, batch, precision)]


def communication_bytes(model: Model, layout: Layout, batch: int, precision: Precision = MIXED) -> dict[str, float]:
    """{dimension: bytes one rank of it sends per step} (ring_bytes of every collective, times its count)."""
    sent = dict.fromkeys(DIMENSIONS, 0.0)
    for c in collectives(model, layout, batch, precision):
        sent[c.dim] += c.count * ring_bytes(c.kind, c.n, c.nbytes)
    return sent


# ------------------------------------------------------------------ time


def link(cluster: Cluster, layout: Layout, dim: str) -> tuple[float, float]:
    """(alpha, beta) of dimension dim's groups, placed tp innermost, then cp, dp, pp outermost: a group
    spans tp (tp), tp*cp (cp), tp*cp*dp (dp) or the world (pp) consecutive ranks, and runs on the
    intra-node link iff its span divides gpus_per_node, else on the inter-node one."""
    raise NotImplementedError("TODO 2.12: the span of dim's group under the docstring's placement; inside a node or across (2.8: tp innermost)")


def collective_seconds(c: Collective, alpha: float, beta: float) -> float:
    """c.count x (latencies x alpha + ring_bytes x beta); latencies on the ring: all_reduce 2(n-1),
    reduce_scatter and all_gather n-1, send 1; 0 when n = 1 (1.3's cost_terms)."""
    raise NotImplementedError("TODO 2.12: 1.3's alpha-beta cost of one call, times the calls")


def flops_per_token(model: Model, checkpointing: bool = False) -> float:
    """Training FLOPs per token (Kaplan et al. 2020, Table 1: forward 2N + 2 layers seq_len hidden, N the
    parameters less the embedding, a lookup): 3x the forward, 4x with checkpointing (one more forward)."""
    forward = 2 * (model.parameters() - model.vocab * model.hidden) + 2 * model.layers * model.seq_len * model.hidden
    return (4 if checkpointing else 3) * forward


def step_time(model: Model, cluster: Cluster, layout: Layout, batch: int,
              precision: Precision = MIXED) -> dict[str, float]:
    """Seconds of one step, by term: compute = flops_per_token x batch x seq_len / (world x peak_flops x
    efficiency); tp, cp, pp, dp = the collective_seconds of that dimension's collectives on its link;
    bubble = (compute + tp + cp) x f / (1 - f), f = bubble_fraction; total = their sum. ValueError
    unless layout.world == cluster.world (and check_layout)."""
    check_layout(model, layout, batch)
    if layout.world != cluster.world:
        raise ValueError(f"layout {layout.describe()} has {layout.world} ranks, cluster {cluster.name} "
                         f"{cluster.world} GPUs: dp * cp * tp * pp must equal them")
    raise NotImplementedError("TODO 2.12: the docstring's terms: compute, each dimension on its link, the bubble around what the pipeline runs")


# ------------------------------------------------------------------ ranking


def candidate_layouts(model: Model, cluster: Cluster, batch: int) -> list[Layout]:
    """Every layout with dp * cp * tp * pp = cluster.world that check_layout accepts: ZeRO 0-3 (0-1 with
    pp > 1), schedule 1f1b alone when pp = 1, else gpipe, 1f1b, zb-h1 and interleaved with v = 2 and 4;
    every micro-batch count dividing batch / dp; checkpointing off and on. In that order (tp, cp, pp
    growing, then zero, schedule, chunks, micro-batches, checkpointing). Sequence parallelism always
    (sp=True): for the same tp bytes it holds less (34/t against 10 + 24/t a layer, a tp-th of the
    pipeline message), so a Layout(sp=False) never beats its sp=True twin."""
    world = cluster.world
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for tp in divisors:
        for cp in divisors:
            for pp in divisors:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if batch % dp:
                    continue
                pipes = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                                       ("interleaved", 2), ("interleaved", 4)]
                for zero in range(4 if pp == 1 else 2):
                    for schedule, v in pipes:
                        for m in (d for d in range(1, batch // dp + 1) if batch // dp % d == 0):
                            for ckpt in (False, True):
                                layout = Layout(dp, zero, tp, pp, schedule, v, cp, m, ckpt)
                                try:
                                    check_layout(model, layout, batch)
                                except ValueError:
                                    continue
                                out.append(layout)
    return out


def rank_layouts(model: Model, cluster: Cluster, batch: int, precision: Precision = MIXED) -> list[Plan]:
    """A Plan (layout, memory, step_time) for every candidate_layouts layout whose memory total is at most
    cluster.memory_bytes, fastest first (step_time's total), ties: less memory first, then candidate order."""
    raise NotImplementedError("TODO 2.12: keep the layouts that fit; sort by the docstring's key (sorted() is stable)")


# ------------------------------------------------------------------ presets and the command line

GB = 1e9
MODELS = {
    # the course's own: a 2.9 Block stack like 2.11's toy transformer (LayerNorm, biases, GELU MLP)
    "course-toy": Model("course-toy", layers=4, hidden=32, heads=4, ffn_hidden=128, seq_len=16, vocab=64),
    # GPT-3 XL (Brown et al. 2020, Table 2.1; 16 heads of 128 as Megatron-LM runs it), tied embedding
    "gpt3-1.3b": Model("gpt3-1.3b", 24, 2048, 16, 8192, 2048, 50257, tied=True),
    # Llama 3 8B (Meta's model card and params.json): GQA with 8 KV heads, SwiGLU, RMSNorm, no biases
    "llama3-8b": Model("llama3-8b", 32, 4096, 32, 14336, 8192, 128256, kv_heads=8, gated=True, bias=False,
                       flash=True),
    # Megatron-LM's GPT-3 175B (Narayanan et al. 2021, Table 1)
    "gpt3-175b": Model("gpt3-175b", 96, 12288, 96, 4 * 12288, 2048, 51200),
}
# H100 SXM: 989 TFLOP/s dense bf16, 80 GB; NVLink 4 ~ 450 GB/s a direction; 8 x 400 Gb/s InfiniBand a node,
# ~ 50 GB/s a GPU. alpha: a few microseconds (NCCL's small-message latency). Round figures: guidelines 2.12.
_H100 = dict(memory_bytes=80 * GB, alpha_intra=5e-6, beta_intra=1 / (450 * GB), alpha_inter=10e-6,
             beta_inter=1 / (50 * GB), peak_flops=989e12, efficiency=0.5)
_A100 = dict(memory_bytes=80 * GB, alpha_intra=5e-6, beta_intra=1 / (300 * GB), alpha_inter=10e-6,
             beta_inter=1 / (25 * GB), peak_flops=312e12, efficiency=0.5)
CLUSTERS = {
    "1x8-h100": Cluster("1x8-h100", 1, 8, **_H100),
    "4x8-h100": Cluster("4x8-h100", 4, 8, **_H100),
    "16x8-h100": Cluster("16x8-h100", 16, 8, **_H100),
    "8x8-a100": Cluster("8x8-a100", 8, 8, **_A100),
    # 8 gloo processes on one laptop: loopback ~ 2 GB/s, ~ 50 us a message, ~ 50 GFLOP/s a core
    "laptop-cpu": Cluster("laptop-cpu", 1, 8, memory_bytes=2 * GB, alpha_intra=50e-6, beta_intra=1 / (2 * GB),
                          alpha_inter=50e-6, beta_inter=1 / (2 * GB), peak_flops=50e9, efficiency=0.5),
}
DEFAULT_BATCH = {"course-toy": 16, "gpt3-1.3b": 512, "llama3-8b": 64, "gpt3-175b": 1536}


def format_table(plans: list[Plan], model: Model, batch: int, top: int) -> str:
    """The ranking as text: one row per plan, memory in GB and times in milliseconds."""
    tokens = batch * model.seq_len
    head = (f"{'#':>3} {'layout':<44} {'mem GB':>7} {'step ms':>9} {'tokens/s':>11} | {'compute':>8} {'tp':>7} "
            f"{'cp':>7} {'pp':>7} {'dp':>7} {'bubble':>7}")
    lines = [head, "-" * len(head)]
    for i, plan in enumerate(plans[:top], 1):
        t = plan.time
        lines.append(f"{i:>3} {plan.layout.describe():<44} {plan.memory.total / GB:7.2f} {t['total'] * 1e3:9.2f} "
                     f"{tokens / t['total']:11.4g} | " + " ".join(f"{t[k] * 1e3:{8 if k == 'compute' else 7}.2f}"
                                                           for k in ("compute", *DIMENSIONS, "bubble")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rank the parallel layouts of a model on a cluster (exercise 2.12).")
    parser.add_argument("--model", required=True, help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--cluster", required=True, help=f"one of {', '.join(CLUSTERS)}")
    parser.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: per model)")
    parser.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    parser.add_argument("--top", type=int, default=20, help="rows to print")

    def error(message: str):
        print(f"planner: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error
    args = parser.parse_args(argv)
    if args.model not in MODELS:
        error(f"unknown model {args.model!r}: use one of {', '.join(MODELS)}")
    if args.cluster not in CLUSTERS:
        error(f"unknown cluster {args.cluster!r}: use one of {', '.join(CLUSTERS)}")
    model, cluster = MODELS[args.model], CLUSTERS[args.cluster]
    batch = DEFAULT_BATCH[args.model] if args.batch is None else args.batch
    if batch < 1 or args.top < 1:
        error(f"--batch and --top must be >= 1, got {batch} and {args.top}")
    plans = rank_layouts(model, cluster, batch, MIXED if args.precision == "mixed" else FP32)
    if not plans:
        print(f"planner: no layout of {model.name} fits {cluster.name} with a batch of {batch}: more GPUs, or a "
              "smaller batch or model", file=sys.stderr)
        return 1
    print(f"{model.name} ({model.parameters() / 1e9:.3g}B parameters), batch {batch} x {model.seq_len} tokens, on "
          f"{cluster.name} ({cluster.world} GPUs): {len(plans)} layouts fit, fastest first")
    print(format_table(plans, model, batch, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

