"""Exercise 2.6: pipeline schedules (GPipe, 1F1B), their bubble, and an executor.

Cut the batch into m micro-batches and let the p stages of 2.5 work on different
micro-batches at the same time. A schedule is, for each stage, the ordered list of
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

Dependencies (what the time grid respects): F(s, j) after F(s-1, j); B(s, j) after
B(s+1, j) and after F(s, j). Messages between neighbours are matched in order, so
neighbouring stages must run their forwards (and their backwards) in the same
micro-batch order.

Production: torch.distributed.pipelining (torch >= 2.4: PipelineStage, ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B; zero-bubble schedules in later versions, see
guidelines 2.6), Megatron-LM and DeepSpeed pipelines.
"""

from __future__ import annotations

from typing import Callable

import torch

from .model_split import Mailbox, PipelineStage

Action = tuple[str, int]  # ("F", microbatch) or ("B", microbatch)
Schedule = list[list[Action]]  # schedule[stage] = that stage's actions, in order
Grid = list[list["Action | None"]]  # grid[time step][stage] = action, or None when idle


def _check_settings(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_actions(actions: list[Action], where: str = "stage") -> int:
    """Every micro-batch 0..m-1 exactly once as F and once as B, each F before its B. Returns m."""
    forwards = [j for kind, j in actions if kind == "F"]
    backwards = [j for kind, j in actions if kind == "B"]
    m = len(forwards)
    if len(backwards) + m != len(actions):
        raise ValueError(f"{where}: actions must be ('F', j) or ('B', j), got {actions}")
    if sorted(forwards) != list(range(m)) or sorted(backwards) != list(range(m)):
        raise ValueError(f"{where}: every micro-batch 0..{m - 1} needs exactly one F and one B, got {actions}")
    if any(actions.index(("B", j)) < actions.index(("F", j)) for j in range(m)):
        raise ValueError(f"{where}: a micro-batch's B comes before its F in {actions}")
    return m


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: on every stage F0..F(m-1), then all the backwards.

    Either order of the backwards is correct: reverse, B(m-1)..B0, as the GPipe paper
    draws it, or forward, B0..B(m-1), as torch's ScheduleGPipe runs it (the same bubble,
    memory and gradients); every stage must use the same one (messages pair in order).
    Raises ValueError unless both arguments are integers >= 1.
    """
    # EXERCISE 2.6: validate with _check_settings; every stage runs all its forwards, then all its backwards (the GPipe picture in the module docstring)
    _check_settings(num_stages, num_microbatches)
    forwards = [("F", j) for j in range(num_microbatches)]
    backwards = [("B", j) for j in reversed(range(num_microbatches))]
    return [forwards + backwards for _ in range(num_stages)]
    # END EXERCISE


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: stage s runs w = min(p-s-1, m) warm-up forwards, then pairs (F, B) while
    forwards remain, then the remaining backwards; micro-batches in order 0..m-1.

    m < p is allowed: the warm-up is capped at m and the first stages degenerate to
    GPipe (all forwards, then all backwards); the bubble is (p-1)/(m+p-1) either way.
    (torch's Schedule1F1B rejects m < p, since 1F1B then saves no memory.)
    Raises ValueError unless both arguments are integers >= 1.
    """
    # EXERCISE 2.6: validate with _check_settings; each stage's list as the docstring says: warm-up, one F one B, drain (the 1F1B picture in the module docstring; guidelines 2.6, "Stuck?")
    _check_settings(num_stages, num_microbatches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [("F", j) for j in range(warmup)]
        for j in range(num_microbatches - warmup):
            actions += [("F", warmup + j), ("B", j)]
        actions += [("B", j) for j in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule
    # END EXERCISE


def time_grid(schedule: Schedule) -> Grid:
    """Lay the schedule out on a global clock: every action takes one step and starts at the
    first step where its dependencies finished at earlier steps (F(s,j) after F(s-1,j);
    B(s,j) after B(s+1,j) and F(s,j)); each stage runs its actions in list order.

    Returns grid[t][s] = the action stage s runs at step t, or None (idle); the schedule is
    left unchanged. Works for any schedule, not only the two above (any micro-batch order,
    any interleaving). Raises ValueError if the actions are malformed (per stage: every
    micro-batch 0..m-1 exactly once as ("F", j) and once as ("B", j), F before B) or the
    schedule deadlocks (no stage can move).
    """
    # EXERCISE 2.6: validate each stage with _check_actions, then simulate the clock the docstring describes, one step at a time; ValueError when no stage can move but work remains (guidelines 2.6, "Stuck?")
    for stage, actions in enumerate(schedule):
        _check_actions(actions, f"stage {stage}")
    num_stages = len(schedule)
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> step
    position = [0] * num_stages
    grid: Grid = []
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        t = len(grid)
        row: list[Action | None] = [None] * num_stages
        for s in range(num_stages):
            if position[s] == len(schedule[s]):
                continue
            kind, j = schedule[s][position[s]]
            needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs += [("F", s, j)] + ([("B", s + 1, j)] if s < num_stages - 1 else [])
            if all(finished.get(need, t) < t for need in needs):
                row[s] = (kind, j)
        if not any(row):
            waiting = [f"stage {s} on {schedule[s][position[s]]}" for s in range(num_stages)
                       if position[s] < len(schedule[s])]
            raise ValueError(f"schedule deadlocks at step {t}: " + ", ".join(waiting))
        for s, action in enumerate(row):
            if action is not None:
                finished[(action[0], s, action[1])] = t
                position[s] += 1
        grid.append(row)
    return grid
    # END EXERCISE


def bubble_fraction(grid: Grid) -> float:
    """Idle slots / all slots (time steps x stages) of a time grid."""
    # EXERCISE 2.6: the share of idle cells (None) among all cells of the grid
    slots = len(grid) * len(grid[0])
    return sum(action is None for row in grid for action in row) / slots
    # END EXERCISE


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches whose F has run and whose B has not, over one stage's actions
    (any valid list, in any micro-batch order; the list is left unchanged)."""
    # EXERCISE 2.6: the high-water mark of forwards not yet matched by their backward, walking the list in order
    count = peak = 0
    for kind, _ in actions:
        count += 1 if kind == "F" else -1
        peak = max(peak, count)
    return peak
    # END EXERCISE


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split along dim 0 into num_microbatches equal, consecutive chunks.

    Equal sizes make the mean of the micro-batch mean losses equal the batch mean loss;
    raises ValueError unless num_microbatches is an integer >= 1 that divides len(batch).
    The batch is left unchanged.
    """
    # EXERCISE 2.6: ValueError unless num_microbatches is an integer >= 1 that divides len(batch); then m equal consecutive views along dim 0 (torch.Tensor.chunk)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if len(batch) % num_microbatches:
        raise ValueError(f"a batch of {len(batch)} does not split into {num_microbatches} equal micro-batches: "
                         "choose a divisor of the batch size")
    return list(batch.chunk(num_microbatches))
    # END EXERCISE


def run_pipeline(actions: list[Action], stage: PipelineStage, microbatch_inputs: list[torch.Tensor] | None,
                 microbatch_targets: list[torch.Tensor] | None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Run this stage's `actions` (its row of a schedule); every rank calls it with its own row.

    microbatch_inputs: the m input micro-batches on the first stage (None elsewhere);
    microbatch_targets: the m target micro-batches on the last stage (None elsewhere).
    Any valid row runs (not only GPipe's and 1F1B's, in any micro-batch order): ("F", j)
    takes microbatch_inputs[j] and microbatch_targets[j], ("B", j) is the backward of that F.
    Each micro-batch's loss is divided by m before its backward, so the gradients
    accumulated in .grad equal those of the mean loss over the whole batch.
    Sends leave before the next computation (the neighbour never starves), and what a
    micro-batch needs is let go once its backward is done and its messages delivered:
    a stage holds the micro-batches in flight, as the schedule says (max_in_flight), not m.
    Returns the batch loss (mean over micro-batches, detached) on the last stage, None elsewhere.
    """
    num_microbatches = _check_actions(actions, f"stage {stage.stage_id}")
    # EXERCISE 2.6: walk the actions with 2.5's Mailbox: receive what an action needs, post the queued sends before computing, compute, queue its sends; wait for each send's Delivery once it is sure to have arrived so nothing outlives its micro-batch; flush at the end (guidelines 2.6, "Stuck?")
    box, device = Mailbox(), stage.device
    held = {}  # j -> (input, output) of F(j), kept until B(j)
    losses, total = {}, []  # last stage: j -> loss(j) / m until B(j); the detached losses
    sent = {}  # j -> Delivery of F(j)'s activation: it surely arrived once dL/d(activation) came back
    grad_sent = None  # Delivery of the last input gradient sent back (one in flight, as torch's Schedule1F1B)

    def forward(j: int) -> None:  # a function: its locals die with it, so no micro-batch outlives its B
        if stage.is_first:
            x = microbatch_inputs[j].to(device)
        else:
            x = box.recv_activation(stage.prev_rank, device).requires_grad_()
        box.post()  # sends queued by the previous action leave now if this one received nothing
        out = stage(x)
        if stage.is_last:
            losses[j] = loss_fn(out, microbatch_targets[j].to(device)) / num_microbatches
        else:
            sent[j] = box.send_activation(out.detach(), stage.next_rank)
        held[j] = (x, out)

    def backward(j: int) -> None:
        nonlocal grad_sent
        x, out = held.pop(j)
        if stage.is_last:
            box.post()
            loss = losses.pop(j)
            loss.backward()
            total.append(loss.detach())
        else:
            grad = box.recv(torch.empty_like(out), stage.next_rank)  # posts the queued sends too
            sent.pop(j).wait()  # returns at once: the gradient proves the activation arrived
            out.backward(grad)
        if not stage.is_first:
            if grad_sent is not None:
                grad_sent.wait()
            grad_sent = box.send(x.grad, stage.prev_rank)

    for kind, j in actions:
        if kind == "F":
            forward(j)
        else:
            backward(j)
    box.flush()
    return torch.stack(total).sum() if stage.is_last else None
    # END EXERCISE
