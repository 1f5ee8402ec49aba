"""What the training loop reads back from the device, and when: nothing, on most steps.

A GPU runs the kernels a step queued while the host queues the next step's; every value
read back to the host (a loss printed, a clock read after torch.cuda.synchronize, a flag
.item()'d) makes the host wait until the device has caught up, and the queue runs dry. The
loop reads at most once per logged step, and never on the others:

    LossWatch        the step's loss and "has any loss been NaN or infinite, since when"
                     stay on the device (a few elementwise kernels per step); read() costs
                     one copy to the host, at a log line, a save and the end of the run
    DeferredTimer    4.5's StepTimer, unchanged, except that stop() keeps the step's marks
                     (CUDA events on a GPU) instead of reading them: collect() reads every
                     kept step at once after one Event.synchronize on the newest mark, on
                     the steps that are logged or straggler-reported (the window's every
                     step still counts, as StragglerDetector expects)
    StopAgreement    the ranks' "has anyone been asked to stop" (4.2's PreemptionHandler
                     records the signal) agreed with an all-reduce of a CPU tensor over a
                     gloo group of its own: a host collective, never a device
                     synchronisation, so it can run at every step (--stop-check-every 1)
                     with the same answer, at the same step, as before; issued through the
                     flight record (flight.py: 4.6's recorder, its wait bounded)

What still synchronises, by design: logged steps (the loss, the timer, memory statistics),
checkpoints (the weights' finiteness, the copy to the host), evaluations, the end; and, on
GPUs without bf16, torch's fp16 GradScaler, whose step() reads found_inf (torch 2.14.1,
GradScaler._maybe_opt_step) unless the optimizer is fused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phase4_production.monitoring import StepTimer
from phase4_production.trainer.flight import FlightRecord


class LossWatch:
    """The loss of each step, kept on the device; read() at the steps that need its value."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last: torch.Tensor | None = None
        self.first_bad = torch.full((), -1.0, dtype=torch.float64, device=device)  # step of the first NaN/inf
        self.bad_value = torch.zeros((), dtype=torch.float64, device=device)       # that loss

    def add(self, loss: torch.Tensor, step: int) -> None:
        """The mean loss of step `step` (1-based), a 0-d tensor on the device."""
        self.last = loss.detach()
        newly = ~torch.isfinite(self.last) & (self.first_bad < 0)
        self.first_bad = torch.where(newly, float(step), self.first_bad)
        self.bad_value = torch.where(newly, self.last.double(), self.bad_value)

    def read(self) -> tuple[float, int | None, float]:
        """(the last step's loss, the first step whose loss was not finite or None, its loss):
        one device-to-host copy."""
        last = self.last.double() if self.last is not None else torch.zeros((), dtype=torch.float64,
                                                                            device=self.device)
        value, first, bad = torch.stack([last, self.first_bad, self.bad_value]).tolist()
        return value, (int(first) if first >= 0 else None), bad


class DeferredTimer(StepTimer):
    """StepTimer (4.5) whose stop() returns nothing and reads no mark: the step's marks are
    kept until collect() reads them all, after waiting for the newest one (on CUDA one
    Event.synchronize; every earlier mark of the stream is then complete too). On the CPU
    the marks are perf_counter readings, and collect() only does the arithmetic. The times
    are StepTimer.stop()'s, step by step."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(device)
        self.pending: list[tuple] = []

    def stop(self, samples: int = 0) -> None:  # type: ignore[override]
        if self._begin is None:
            raise RuntimeError("StepTimer.stop() without start()")
        self.pending.append((self._begin, self._spans, self._mark(), samples))
        self._begin = None

    def collect(self) -> list[dict[str, float]]:
        """The times of every step stopped since the last collect(), oldest first."""
        if not self.pending:
            return []
        if self.on_cuda:
            self.pending[-1][2].synchronize()
        out = []
        for begin, spans, end, samples in self.pending:
            step = self._seconds(begin, end)
            times = {name: 0.0 for name in self.phases}
            for name, first, last in spans:
                times[name] += self._seconds(first, last)
            times["other"] = step - sum(times[name] for name in self.phases)
            times.update(step=step, samples=samples, samples_per_s=samples / step if step > 0 else 0.0)
            out.append(times)
        self.pending = []
        return out


class StopAgreement:
    """Whether any rank has seen a stop signal, the same answer on every rank: 4.2's
    PreemptionHandler.should_stop, but all-reducing a CPU tensor over a gloo group of its own
    (created here, collectively, its timeout the flight record's limit), so that the agreement
    never waits for the device. With one rank: this rank's flag. Checked every `every` steps
    (--stop-check-every) and wherever the caller says it is due."""

    WHAT = "the stop-flag all-reduce (StopAgreement, on a gloo group)"

    def __init__(self, preemption, flight: FlightRecord, every: int = 1):
        self.preemption, self.flight, self.every = preemption, flight, every
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = flight.new_group(backend="gloo")

    def should_stop(self, step: int = 0, due: bool = True) -> bool:
        """At step boundary `step`: False without a check (not due, and not a multiple of
        `every`); else the agreement, collective over the gloo group (every rank calls it at
        the same steps)."""
        if not due and step % self.every:
            return False
        flag = torch.tensor([1 if self.preemption.requested else 0], dtype=torch.int32)
        if self.group is not None:
            with self.flight.waiting(self.WHAT):
                self.flight.issue(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.numpy()[0])  # a CPU tensor: numpy() refuses device tensors, so this never syncs one
