"""Exercise 2.6: pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble), their bubble, and an executor.

Cut the batch into m micro-batches and let the p stages of 2.5 work on different
micro-batches at the same time. A schedule is, for each rank, the ordered list of
its actions ("F", j) = forward of micro-batch j, ("B", j) = its backward:

    GPipe (p=3, m=4): all forwards, then all backwards      idle slots ".."
      stage 0 | F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
      stage 1 | .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
      stage 2 | .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

    1F1B (p=3, m=4): warm-up of p-s-1 forwards, then alternate, then drain
      stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
      stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
      stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

With F and B one time unit each, both take 2(m+p-1) units for 2m of work per stage:

    bubble = idle / all slots = (p-1) / (m+p-1)        -> 0 as m grows

They differ in memory: a stage keeps a micro-batch's activations from its F to its B.
GPipe holds all m at once; 1F1B at most p - s (stage s), whatever m is, provided the
executor lets a micro-batch go after its B: its activations, and the messages it sent
(a sent tensor lives until its delivery is waited for).

Two refinements shrink the bubble further:

  * Interleaved 1F1B (Narayanan et al. 2021): the model is cut into v*p virtual stages
    and rank r holds v of them, r, r+p, ..., r+(v-1)p (round-robin: a micro-batch visits
    every rank v times). Actions name their virtual stage: ("F", j, k), ("B", j, k).
    Each action is 1/v of a stage's work, so the bubble is (p-1)/(v*m+p-1): 1/v of
    1F1B's over the useful time, for v times as many messages.
  * Zero bubble, ZB-H1 (Qi et al. 2023): the backward splits into ("B", j), the gradient
    of the stage's input (the previous stage waits for it), and ("W", j), the gradient
    of its weights (nobody waits for it). W's are delayed to fill the bubble; a
    micro-batch stays in flight until its W. With t_W <= t_F, t_B and m >= p the bubble
    is (p-1)(t_F+t_B-t_W) instead of 1F1B's (p-1)(t_F+t_B+t_W), for at most p
    micro-batches in flight on every stage (1F1B's peak, on stage 0).

Dependencies (what the time grid respects), on virtual stages (the rank, when actions
have no stage): F(k, j) after F(k-1, j); B(k, j) after B(k+1, j) and after F(k, j);
W(k, j) after B(k, j). Messages between two ranks are matched in order, so a rank must
receive from a neighbour in the order that neighbour sends (for GPipe and 1F1B:
neighbouring stages run their forwards, and their backwards, in the same micro-batch
order).

Production: torch.distributed.pipelining (torch >= 2.4: PipelineStage, ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B; ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV in later versions, see guidelines 2.6),
Megatron-LM and DeepSpeed pipelines.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .model_split import Mailbox, PipelineStage

Action = tuple  # ("F" | "B" | "W", microbatch) on the rank's own stage, or (kind, microbatch, virtual stage)
Schedule = list[list[Action]]  # schedule[rank] = that rank's actions, in order
Grid = list[list["Action | None"]]  # grid[time step][rank] = action, or None when idle
KINDS = ("F", "B", "W")


class VirtualStage(PipelineStage):
    """Virtual stage `stage_id` of `num_stages` (a model chunk): the layers
    balanced_ranges(len(layers), num_stages)[stage_id], on rank ranks[stage_id].

    `ranks[k]` is the rank holding virtual stage k (interleaved 1F1B: k % p), so the
    neighbours are on ranks[stage_id - 1] and ranks[stage_id + 1]; everything else is
    2.5's PipelineStage (is_first, is_last, device, forward).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], stage_id: int, num_stages: int, ranks: Sequence[int],
                 device: torch.device | str | None = None):
        if len(ranks) != num_stages:
            raise ValueError(f"ranks must name the rank of each of the {num_stages} virtual stages, got {list(ranks)}")
        super().__init__(layers, stage_id, num_stages, device)
        self.ranks = list(ranks)

    @property
    def prev_rank(self) -> int:
        return self.ranks[self.stage_id - 1]

    @property
    def next_rank(self) -> int:
        return self.ranks[self.stage_id + 1]


def _check_settings(*values: int, names: tuple[str, ...] = ("num_stages", "num_microbatches", "num_chunks")) -> None:
    for name, value in zip(names, values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _normalise(actions: list[Action], stage: int | None, where: str) -> list[tuple[str, int, int | None]]:
    """Each action as (kind, microbatch, virtual stage); `stage` stands for a missing third element."""
    out = []
    for action in actions:
        ok = isinstance(action, (tuple, list)) and len(action) in (2, 3) and action[0] in KINDS
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in action[1:])
        if not ok or (len(action) == 3 and action[2] < 0):
            raise ValueError(f"{where}: actions are (kind, microbatch) or (kind, microbatch, virtual stage >= 0), "
                             f"kind in {KINDS}; got {action!r}")
        out.append((action[0], action[1], action[2] if len(action) == 3 else stage))
    return out


def _check_actions(actions: list[Action], where: str = "stage", stage: int | None = None) -> int:
    """Per virtual stage of the list: every micro-batch 0..m-1 exactly once as F and once as B, F before B,
    and at most one W, after its B; the same m for every stage of the list. Returns m."""
    listed = _normalise(actions, stage, where)
    position = {}
    for i, (kind, j, k) in enumerate(listed):
        if (kind, j, k) in position:
            raise ValueError(f"{where}: {actions[i]} appears twice in {actions}")
        position[(kind, j, k)] = i
    counts = set()
    for k in dict.fromkeys(k for _, _, k in listed):
        forwards = sorted(j for kind, j, kk in listed if kind == "F" and kk == k)
        backwards = sorted(j for kind, j, kk in listed if kind == "B" and kk == k)
        weights = [j for kind, j, kk in listed if kind == "W" and kk == k]
        m = len(forwards)
        on = "" if k is None or k == stage else f" (virtual stage {k})"
        if forwards != list(range(m)) or backwards != list(range(m)):
            raise ValueError(f"{where}{on}: every micro-batch 0..{m - 1} needs exactly one F and one B, got {actions}")
        if any(position[("B", j, k)] < position[("F", j, k)] for j in range(m)):
            raise ValueError(f"{where}{on}: a micro-batch's B comes before its F in {actions}")
        if any(("B", j, k) not in position or position[("W", j, k)] < position[("B", j, k)] for j in weights):
            raise ValueError(f"{where}{on}: a W comes before its B (or has none) in {actions}")
        counts.add(m)
    if len(counts) > 1:
        raise ValueError(f"{where}: its virtual stages disagree on the number of micro-batches: {actions}")
    return counts.pop() if counts else 0


def _check_schedule(schedule: Schedule, costs: dict[str, int] | None = None) -> tuple[list, dict[str, int]]:
    """Validate every rank's list (_check_actions), each virtual stage on one rank only, and the costs
    (positive integers for F, B, W, 1 where not given). Returns the actions as (kind, j, stage) per rank
    (a rank's stage where an action names none) and the costs."""
    steps = {kind: 1 for kind in KINDS}
    for kind, cost in (costs or {}).items():
        if kind not in KINDS or isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
            raise ValueError(f"costs map F, B, W to integers >= 1 (time steps), got {costs!r}")
        steps[kind] = cost
    rows, owner = [], {}
    for rank, actions in enumerate(schedule):
        _check_actions(actions, f"rank {rank}", rank)
        rows.append(_normalise(actions, rank, f"rank {rank}"))
        for _, _, k in rows[-1]:
            if owner.setdefault(k, rank) != rank:
                raise ValueError(f"virtual stage {k} appears on ranks {owner[k]} and {rank}: a stage lives on one rank")
    return rows, steps


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: on every stage F0..F(m-1), then all the backwards.

    Either order of the backwards is correct: reverse, B(m-1)..B0, as the GPipe paper
    draws it, or forward, B0..B(m-1), as torch's ScheduleGPipe runs it (the same bubble,
    memory and gradients); every stage must use the same one (messages pair in order).
    Raises ValueError unless both arguments are integers >= 1.
    """
    raise NotImplementedError("TODO 2.6: validate with _check_settings; every stage runs all its forwards, then all its backwards (the docstring's GPipe picture)")


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: stage s runs w = min(p-s-1, m) warm-up forwards, then pairs (F, B) while
    forwards remain, then the remaining backwards; micro-batches in order 0..m-1.

    m < p is allowed: the warm-up is capped at m and the first stages degenerate to
    GPipe (all forwards, then all backwards); the bubble is (p-1)/(m+p-1) either way.
    (torch's Schedule1F1B rejects m < p, since 1F1B then saves no memory.)
    Raises ValueError unless both arguments are integers >= 1.
    """
    raise NotImplementedError("TODO 2.6: validate with _check_settings; each stage's list: warm-up, one F one B, drain (the 1F1B picture in the module docstring)")


def interleaved_schedule(num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): the model cut into v*p virtual stages, rank r holding the
    v = num_chunks stages r, r+p, ..., r+(v-1)p (round-robin); actions ("F", j, k), ("B", j, k).

    Rank r's i-th forward (i = 0..v*m-1) is micro-batch (i // (p*v))*p + i % p on its chunk
    (i // p) % v: p micro-batches through chunk 0, the same p through chunk 1, ..., then the next
    p. Its backwards go in the same order with the chunks reversed (chunk v-1 first). Warm-up of
    w = min(2(p-r-1) + (v-1)p, v*m) forwards, then pairs (F, B) while forwards remain, then the
    remaining backwards. v = 1 is 1F1B (warm-up p-r-1), with its actions naming their stage.
    Bubble (p-1)/(v*m+p-1); at most min(2(p-r-1) + (v-1)p + 1, v*m) chunks' activations in flight
    on rank r (v = 1: 1F1B's min(p-r, m)).
    Raises ValueError unless all three are integers >= 1 and m is a multiple of p.
    """
    raise NotImplementedError("TODO 2.6: validate (m a multiple of p); per rank: forward order, backward order, warm-up as the docstring says, then 1F1B's pairs")


def zero_bubble_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with every backward split into ("B", j), the input gradient, and ("W", j), the
    weight gradient, each W delayed to fill the bubble.

    Stage s runs 1F1B's forwards and B's in 1F1B's order (warm-up min(p-s-1, m), then pairs, then the
    remaining B's), and W(j) right after B(j+s): its first s backwards run without a W, and the W's
    left run at the end, in order. A micro-batch is in flight from its F to its W: at most p on every
    stage (1F1B's peak, on stage 0). With t_W <= t_F, t_B and m >= p, the time grid takes
    m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W) steps (1F1B with B+W fused: (m+p-1)(t_F+t_B+t_W)).
    Raises ValueError unless both arguments are integers >= 1.
    """
    raise NotImplementedError('TODO 2.6: validate; 1F1B\'s F and B per stage, each W(j) right after B(j+s), the W\'s left at the end (guidelines 2.6, "Stuck?")')


def time_grid(schedule: Schedule, costs: dict[str, int] | None = None) -> Grid:
    """Lay the schedule out on a global clock. schedule[r] is rank r's actions in order: ("F", j),
    ("B", j), ("W", j) on stage r, or (kind, j, k) on virtual stage k (a rank may hold several).

    An action takes costs[kind] consecutive steps (integers >= 1; 1 for a kind not given) and
    starts at the first step where its rank is free and its dependencies have finished:
    F(k,j) after F(k-1,j); B(k,j) after B(k+1,j) and F(k,j); W(k,j) after B(k,j). The stages are
    0..S-1, S at least the number of ranks (the last one's B needs no B after it).
    Returns grid[t][r] = the action rank r runs at step t (in each step it takes), or None (idle);
    the schedule is left unchanged. Works for any schedule (any order, any placement of the
    virtual stages). Raises ValueError if an action is malformed (per rank and virtual stage:
    every micro-batch 0..m-1 once as F and once as B, F before B, at most one W after its B), a
    virtual stage is on two ranks, a cost is not an integer >= 1, or the schedule deadlocks (no
    rank can move).
    """
    raise NotImplementedError('TODO 2.6: validate (_check_schedule); tick a clock: a free rank starts its next action once its needs are done; stuck: ValueError')


def bubble_fraction(grid: Grid) -> float:
    """Idle slots / all slots (time steps x ranks) of a time grid."""
    raise NotImplementedError('TODO 2.6: the share of idle cells (None) among all cells of the grid')


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of (virtual stage, micro-batch) pairs whose activations one rank holds at once over its
    actions: from the F to the W of that pair when the list has one, else to its B. Each chunk of a rank
    counts apart. Any valid list, in any order; the list is left unchanged."""
    raise NotImplementedError('TODO 2.6: the high-water mark of forwards not yet released (by their W if the list has one, else by their B), in list order')


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split along dim 0 into num_microbatches equal, consecutive chunks.

    Equal sizes make the mean of the micro-batch mean losses equal the batch mean loss;
    raises ValueError unless num_microbatches is an integer >= 1 that divides len(batch).
    The batch is left unchanged.
    """
    raise NotImplementedError('TODO 2.6: ValueError unless num_microbatches is an int >= 1 dividing len(batch); then m equal dim-0 views; see torch.Tensor.chunk')


def _stages_and_actions(stage: PipelineStage | Sequence[PipelineStage], actions: list[Action]) -> tuple[dict, list]:
    """{virtual stage id: its module} of this rank, and the actions as (kind, j, stage id)."""
    stages = [stage] if isinstance(stage, torch.nn.Module) else list(stage)
    by_id = {s.stage_id: s for s in stages}
    if not stages or len(by_id) != len(stages):
        raise ValueError(f"run_pipeline needs this rank's stages, each once; got stage ids {[s.stage_id for s in stages]}")
    only = stages[0].stage_id if len(stages) == 1 else None
    listed = _normalise(actions, only, f"stage {only}" if only is not None else "this rank")
    if any(k not in by_id for _, _, k in listed):
        raise ValueError(f"the actions name virtual stages {sorted({k for _, _, k in listed} - set(by_id), key=str)} "
                         f"that this rank does not hold (it holds {sorted(by_id)}); (kind, j) needs exactly one stage")
    return by_id, listed


def run_pipeline(actions: list[Action], stage: PipelineStage | Sequence[PipelineStage],
                 microbatch_inputs: list[torch.Tensor] | None, microbatch_targets: list[torch.Tensor] | None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Run this rank's `actions` (its row of a schedule); every rank calls it with its own row.

    stage: this rank's PipelineStage, or the list of the virtual stages it holds (VirtualStage,
    whose prev_rank / next_rank say where the neighbouring stages live; actions (kind, j, k) name
    one of them, (kind, j) the only one). microbatch_inputs: the m input micro-batches on the rank
    holding the first stage (None elsewhere); microbatch_targets: the m targets on the rank holding
    the last stage (None elsewhere). Any valid row runs (any order, any placement): ("F", j) takes
    microbatch_inputs[j] and microbatch_targets[j]; ("B", j) is the backward of that F: the whole
    backward, or, when a ("W", j) of the same stage follows, only the gradient of the stage's
    input (sent on at once), ("W", j) then accumulating the weight gradients into .grad. Two
    neighbouring stages on the same rank hand over the activation and its gradient without a
    message. Each micro-batch's loss is divided by m before its backward, so the gradients
    accumulated in .grad equal those of the mean loss over the whole batch.
    Sends leave before the next computation (the neighbour never starves), and what a
    micro-batch needs is let go once its backward (its W, when split) is done and its messages
    delivered: a rank holds the micro-batches in flight, as the schedule says (max_in_flight), not m.
    Returns the batch loss (mean over micro-batches, detached) on the rank holding the last stage,
    None elsewhere.
    """
    stages, listed = _stages_and_actions(stage, actions)
    first = next(iter(stages))
    num_microbatches = _check_actions(actions, f"stage {first}" if len(stages) == 1 else "this rank", first)
    raise NotImplementedError("TODO 2.6: walk the actions with 2.5's Mailbox: receive, post queued sends, compute, queue sends; split: B makes dL/dx, W the rest")
