"""4.4 Gradient compression as DDP communication hooks: top-k with error feedback (and DGC's
momentum correction), and PowerSGD.

Both plug into DDP the way torch's built-in hooks do:

    state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=10)
    ddp_model.register_comm_hook(state, powersgd_hook)    # or TopKState(ratio=0.01), topk_hook
    ...
    state.bytes_per_step[-1]    # bytes this rank handed to collectives in the last backward pass

DDP calls a hook once per gradient bucket, during backward, as soon as the bucket is full:

    bucket.buffer()       this rank's flat gradient, 1-D: the bucket's parameters back to back
    bucket.gradients()    views of that buffer, one per parameter (order of bucket.parameters())
    bucket.index()        the bucket's number; stable once DDP has rebuilt its buckets after
                          the first iteration (why state keyed by it waits for iteration 2)
    bucket.is_last()      True for the last bucket of the backward pass

and the hook returns a torch.futures.Future whose value is the AVERAGED flat gradient (the
buffer's shape and dtype); DDP waits for every bucket's future at the end of backward and
writes the values into the parameters' .grad.

Error feedback: the part of its gradient a rank could not send (its residual e) is added to
its next gradient, so compression delays mass instead of losing it. With s_t what rank r
sent at step t and e_t = (g_t + e_{t-1}) - s_t, the sum telescopes:
    sum_t mean_r s_t  +  mean_r e_T  =  sum_t mean_r g_t       (exactly, up to float rounding)

Under momentum (Deep Gradient Compression, Lin et al. 2018), what is delayed must be the
velocity, not the gradient: TopKState(momentum=0.9) keeps u <- m u + g and v <- v + u per
rank, sends top-k of v, and zeroes v and u where it sent (factor masking); the optimizer
then runs without momentum:

    ddp_model.register_comm_hook(TopKState(ratio=0.01, momentum=0.9, nesterov=True), topk_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)     # momentum=0: it is in the hook
"""

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with the real objects (bucket: dist.GradBucket, return: Future[torch.Tensor]).
Future = torch.futures.Future[torch.Tensor]


class CompressionState:
    """What every hook's state holds: the group, the iteration count, the bytes sent.

    `iter`: backward passes finished (advanced by `record` on the last bucket).
    `bytes_per_step[t]`: bytes this rank handed to collectives in backward pass t, counted as
    the sizes of its messages (an all_reduce's tensor, an all_gather's input), the way
    common.measure.CollectiveLog counts them; what the wire carries depends on the algorithm.
    """

    def __init__(self, process_group=None):
        self.process_group = process_group
        self.iter = 0
        self.bytes_per_step: list[int] = []
        self._bytes_this_step = 0

    def group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def record(self, bucket: dist.GradBucket, nbytes: int) -> None:
        """Count `nbytes` for `bucket`; call it once per hook call, AFTER reading `iter` (on the
        last bucket it closes the step: appends the step's bytes and advances `iter`)."""
        self._bytes_this_step += int(nbytes)
        if bucket.is_last():
            self.bytes_per_step.append(self._bytes_this_step)
            self._bytes_this_step = 0
            self.iter += 1


def allreduce_mean(tensor: torch.Tensor, group) -> Future:
    """Average `tensor` over `group` in place, as torch's allreduce_hook does (divide first, then
    sum: no overflow in fp16); returns a Future of `tensor`."""
    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# ---------------------------------------------------------------- top-k sparsification


class TopKState(CompressionState):
    """Settings and memory of `topk_hook`.

    ratio: fraction of each bucket's entries a rank sends per step, k = topk_count(n, ratio).
    use_error_feedback: keep what was not sent (`residuals[bucket index]`, the bucket's
    shape) and add it to the next gradient; False shows what is lost without it.
    start_iter: plain all-reduce before this iteration (DDP rebuilds its buckets after
    iteration 0, so a residual kept from then would not fit); >= 2 with error feedback.
    The fields may be changed between steps (e.g. ratio = 1.0 sends everything; the
    trainer's sparsity warm-up sets ratio every step from `sparsity_warmup`).

    Momentum correction (DGC, Lin et al. 2018): with momentum > 0 the hook carries SGD's
    momentum, and the optimizer must run WITHOUT momentum and weight decay
    (torch.optim.SGD(params, lr)): .grad receives the update direction itself.
    momentum, nesterov: torch.optim.SGD's meanings (dampening 0).
    momentum_masking: zero the momentum at the entries sent, as the residual is zeroed
    there (DGC's momentum factor masking).
    weight_decay: a number, or a function parameter -> number (e.g. 0 for biases); added to
    each parameter's gradient before momentum, where torch.optim.SGD adds it, so it is
    compressed and delayed with the gradient (this course's choice; DGC's reference
    implementation instead keeps it out of the compressed stream, in a dense momentum buffer
    of its optimizer: guidelines 4.4, "Weight decay").

    Memory, per bucket index from start_iter on (each the bucket's shape):
        residuals[i]  v, this rank's accumulated update not sent yet:  v <- v + u
                      (v <- v + g + m u with nesterov; v <- v + g without momentum: plain
                      error feedback, v the residual)
        momenta[i]    u, this rank's momentum:  u <- m u + g   (only with momentum)
    Before start_iter, with momentum: param_momenta[p], per parameter, the momentum of the
    averaged gradient (DDP's buckets change after iteration 0, its parameters do not);
    `memory` moves it into momenta[i] when the bucket starts compressing.
    """

    def __init__(self, process_group=None, ratio: float = 0.01, use_error_feedback: bool = True, start_iter: int = 2,
                 momentum: float = 0.0, nesterov: bool = False, momentum_masking: bool = True,
                 weight_decay: float | Callable[[torch.Tensor], float] = 0.0):
        super().__init__(process_group)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        if use_error_feedback and start_iter < 2:
            raise ValueError("start_iter must be >= 2 with error feedback: DDP rebuilds its buckets after iteration 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if momentum and not use_error_feedback:
            raise ValueError("momentum correction accumulates in the error-feedback memory: use_error_feedback=True")
        if nesterov and not momentum:
            raise ValueError("nesterov needs a momentum > 0 (as torch.optim.SGD)")
        self.ratio = ratio
        self.use_error_feedback = use_error_feedback
        self.start_iter = start_iter
        self.momentum = momentum
        self.nesterov = nesterov
        self.momentum_masking = momentum_masking
        self.weight_decay = weight_decay
        self.residuals: dict[int, torch.Tensor] = {}
        self.momenta: dict[int, torch.Tensor] = {}
        self.param_momenta: dict[torch.Tensor, torch.Tensor] = {}

    def decay_of(self, param: torch.Tensor) -> float:
        """The weight decay of `param` (a parameter of the model)."""
        return float(self.weight_decay(param)) if callable(self.weight_decay) else float(self.weight_decay)

    def memory(self, bucket: dist.GradBucket) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(momenta[i] or None without momentum, residuals[i]) of the bucket, i = bucket.index(),
        made on the bucket's first compressed step: the residual zeros, the momentum the
        bucket's parameters' param_momenta (the same on every rank; zeros where none)."""
        index = bucket.index()
        if index not in self.residuals:
            self.residuals[index] = torch.zeros_like(bucket.buffer())
            if self.momentum:
                pieces = [self.param_momenta.pop(p, None) for p in bucket.parameters()]
                self.momenta[index] = torch.cat([torch.zeros_like(g).reshape(-1) if u is None else u.reshape(-1)
                                                 for u, g in zip(pieces, bucket.gradients())])
        return self.momenta.get(index), self.residuals[index]

    def reset_memory(self) -> None:
        """Forget every residual and momentum: call it after a step whose gradients were not
        finite (a step GradScaler skips), or the inf/NaN kept in them poisons every later step."""
        self.residuals.clear()
        self.momenta.clear()
        self.param_momenta.clear()


def topk_count(numel: int, ratio: float) -> int:
    """k: how many of `numel` entries a rank sends at `ratio` (at least 1, at most numel)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def sparsity_warmup(step: int, warmup_steps: int, ratio: float, first: float = 0.25) -> float:
    """DGC's sparsity warm-up: the fraction to send at compressed step `step` (0: the first),
    falling exponentially from `first` to `ratio` over `warmup_steps` steps, then `ratio`.
    (DGC on ImageNet: 25 %, 6.25 %, 1.56 %, 0.4 %, 0.1 % in the first epochs, a quarter each.)"""
    if step >= warmup_steps or first <= ratio:
        return ratio
    return first * (ratio / first) ** (max(step, 0) / warmup_steps)


def allreduce_with_momentum(state: TopKState, bucket: dist.GradBucket) -> Future:
    """topk_hook before start_iter when it carries momentum or weight decay: the plain average
    (allreduce_mean), then, per parameter p of the bucket, the direction torch.optim.SGD
    (momentum, nesterov, weight_decay) would step along: d = average + decay_of(p) p;
    u = m u + d (u = d the first time), kept in state.param_momenta[p]; the buffer gets
    d + m u with nesterov, u without (d when momentum is 0). Returns a Future of the buffer."""
    raise NotImplementedError("TODO 4.4: momentum SGD's step direction on the averaged gradient, per parameter (the docstring); state.param_momenta keeps u")


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> Future:
    """DDP comm hook: each rank sends the k largest-magnitude entries of its accumulated
    gradient a, values and int64 indices, to every rank (all_gather: indices differ between
    ranks); every rank sums the p sparse vectors into a dense one, in rank order, and divides
    by p. Returns a Future of the bucket's buffer holding that average.

    a: first g = this rank's gradient + decay_of(p) p per parameter p. Without error
    feedback a = g, nothing kept. With it (state.memory: u, v), a = v after
        u <- m u + g;  v <- v + u   (nesterov: v <- v + g + m u; no momentum: v <- v + g)
    and then v <- 0 at the entries sent, and u <- 0 there too with momentum_masking.
    Before start_iter: a plain all-reduce (allreduce_with_momentum with momentum or weight decay)."""
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        if state.momentum or state.weight_decay:
            return allreduce_with_momentum(state, bucket)
        return allreduce_mean(buffer, group)
    raise NotImplementedError("TODO 4.4: the docstring's average of every rank's top-k of its OWN accumulated gradient; v (u) keep what was unsent; state.record")


# ---------------------------------------------------------------- PowerSGD


class PowerSGDState(CompressionState):
    """Settings and memory of `powersgd_hook`: the constructor of torch's PowerSGDState
    (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook, torch 2.14), same meanings.

    matrix_approximation_rank  r: each compressed gradient matrix M (n x m) is sent as
                               P (n x r) and Q (m x r), r = min(n, m, this)
    start_powerSGD_iter        plain all-reduce before this iteration (>1 with error feedback
                               or warm start: DDP rebuilds its buckets after iteration 0)
    min_compression_rate       compress M only if (n + m) * r * rate < n * m; the rest (biases,
                               small matrices) is all-reduced as it is
    use_error_feedback         error_dict[bucket index]: local input - decompressed average,
                               added to the next gradient
    warm_start                 keep Q (q_memory_dict) from the last step instead of a fresh
                               random Q every step
    orthogonalization_epsilon  added to each column's norm in Gram-Schmidt (0: none)
    random_seed                seeds `rng`, which draws one torch seed per fresh Q
    batch_tensors_with_same_shape  compress same-shaped matrices of a bucket as one batch
    compression_stats_logging_frequency  accepted for compatibility; bytes_per_step replaces it
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False):
        super().__init__(process_group)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("start_powerSGD_iter must be > 1 with error feedback or warm start: "
                             "DDP rebuilds its buckets after iteration 0")
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.compression_stats_logging_frequency = compression_stats_logging_frequency
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = np.random.RandomState(random_seed)  # the same draws on every rank
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}

    def reset_memory(self) -> None:
        """Forget the errors and the warm-start P and Q: call it after a step whose gradients
        were not finite (a step GradScaler skips), or the inf/NaN they keep poisons every later
        step. The next compressed step draws a fresh Q."""
        self.error_dict.clear()
        self.p_memory_dict.clear()
        self.q_memory_dict.clear()


@dataclass
class BucketSplit:
    """A bucket's per-parameter gradients, split the way torch's powerSGD_hook splits them.

    matrices: (b, n, m) tensors to compress, grouped by matrix shape in order of first
    appearance (b = 1: a view into the bucket; b > 1 only when batching: a stacked copy,
    written back by `copy_back`). uncompressed: the per-parameter views all-reduced as they
    are. ranks[i]: r of matrices[i]. p_numel, q_numel: total sizes of the Ps and the Qs.
    """

    matrices: list[torch.Tensor]
    uncompressed: list[torch.Tensor]
    ranks: list[int]
    stacked_from: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def p_numel(self) -> int:
        return sum(m.shape[0] * m.shape[1] * r for m, r in zip(self.matrices, self.ranks))

    @property
    def q_numel(self) -> int:
        return sum(m.shape[0] * m.shape[2] * r for m, r in zip(self.matrices, self.ranks))

    def low_rank_views(self, memory: torch.Tensor, side: str) -> list[torch.Tensor]:
        """Views of flat `memory` (p_numel or q_numel long): (b, n, r) per matrix for side "p",
        (b, m, r) for side "q", back to back in the order of `matrices`."""
        views, offset = [], 0
        for matrix, r in zip(self.matrices, self.ranks):
            b, n, m = matrix.shape
            rows = n if side == "p" else m
            views.append(memory[offset:offset + b * rows * r].view(b, rows, r))
            offset += b * rows * r
        return views

    def copy_back(self) -> None:
        """Write stacked (batched) matrices back into the bucket's views."""
        for matrix, originals in zip(self.matrices, self.stacked_from):
            if matrix.shape[0] > 1:
                for i, original in enumerate(originals):
                    original.copy_(matrix[i])


def split_bucket(gradients: list[torch.Tensor], state: PowerSGDState) -> BucketSplit:
    """Decide, per parameter of a bucket, compress (as an n x m matrix, n = its first dim) or not."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    uncompressed = []
    for gradient in gradients:
        matrix = gradient.view(gradient.shape[0], -1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate < n * m:
            by_shape.setdefault(matrix.shape, []).append(matrix)
        else:
            uncompressed.append(gradient)
    matrices, stacked_from = [], []
    for same in by_shape.values():
        groups = [same] if state.batch_tensors_with_same_shape else [[m] for m in same]
        for group in groups:
            matrices.append(group[0].unsqueeze(0) if len(group) == 1 else torch.stack(group))
            stacked_from.append(group)
    ranks = [min(m.shape[1], m.shape[2], state.matrix_approximation_rank) for m in matrices]
    return BucketSplit(matrices, uncompressed, ranks, stacked_from)


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the r columns of each matrix of the batch orthonormal, in place.

    matrices: (b, n, r) with r <= n. As torch 2.14 does it, bit for bit: Gram-Schmidt (column
    i divided by its norm + epsilon, then removed from the columns after it) when r <= 2 or
    in half precision, else torch.linalg.qr's Q written into `matrices`.
    """
    raise NotImplementedError('TODO 4.4: orthonormal columns, bit for bit as the docstring says torch does it; see torch.linalg.vector_norm and torch.linalg.qr')


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future:
    """DDP comm hook: PowerSGD (Vogels et al. 2019), bitwise what torch 2.14's powerSGD_hook
    computes with the same settings. Per compressed matrix M (n x m, this rank's gradient plus
    its error): P = M Q; all-reduce P; orthogonalise P; Q = M^T P; all-reduce Q; Q /= p;
    M <- P Q^T. Uncompressed tensors: one all-reduce of their concatenation, / p.
    A fresh Q holds torch's numbers (randn on the CPU after seeding with
    state.rng.randint(1_000_000_000)) but comes from a private torch.Generator: the hook
    leaves every global generator, CPU and CUDA, as it found it (torch's own hook reseeds
    every CUDA generator, to the same seed on every rank).
    Returns a Future of the bucket's buffer holding the result."""
    group = state.group()
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return allreduce_mean(buffer, group)
    raise NotImplementedError("TODO 4.4: bitwise what torch 2.14's powerSGD_hook returns (error feedback, warm start, its order of operations); see split_bucket")
