"""The trainer's evaluation: the test set's top-1, top-5 and loss, for the model and for each
average evaluated beside it (the --model-ema average), and the history of the epochs' results.

    evaluator = Evaluator(model, inputs.test, device, dtype, flight, report, sampler)
    evaluator.register("ema", ema.module, "EMA", "--model-ema")   # an average (build.py registers it)
    evaluator.results(averages=True)    # {"accuracy", "top5", "test_loss", "ema": {...} or None}
    evaluator.epoch_end(step)           # at an epoch's end: a history record, reported
    evaluator.catch_up(step)            # the epoch-end evaluation a preemption skipped, if it did
    evaluator.final(step, preempted)    # the run's results: the last epoch's, or evaluated now
    evaluator.progress(), .restore()    # the history, in a checkpoint's progress

Every rank evaluates its slice of the test set and the sums are all-reduced (through the flight
record, 4.6's recorder), so every test sample counts once at any world size. The plain module
is evaluated, never DDP's wrapper: DDP's forward would broadcast buffers, per batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from solutions.phase4_production.trainer.flight import FlightRecord

WHAT = "the evaluation's all-reduce"
METRICS = ("accuracy", "test_loss", "top5")


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, dtype: torch.dtype | None,
             flight: FlightRecord | None = None) -> tuple[float, float, float | None]:
    """(top-1 accuracy, mean loss, top-5 accuracy) over the whole test set: every rank's sums
    all-reduced (through `flight`'s recorder when given). Top-5 is None with fewer than 6
    classes (it would be trivially high)."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # top-1 correct, loss sum, count, top-5 correct
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        sums[2] += len(y)
        sums[3] += (logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]).any(1).sum()
    if dist.is_initialized():
        if flight is not None:
            flight.issue(dist.all_reduce, sums)
        else:
            dist.all_reduce(sums)
    model.train()
    top5 = (sums[3] / sums[2]).item() if logits.shape[1] > 5 else None
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), top5


class Evaluator:
    """The model's evaluation and its averages' (module docstring); `report` shows each epoch's."""

    def __init__(self, model: nn.Module, batches, device: torch.device, dtype: torch.dtype | None,
                 flight: FlightRecord, report, sampler):
        self.model, self.batches, self.device, self.dtype = model, batches, device, dtype
        self.flight, self.report, self.sampler = flight, report, sampler
        self.averages: dict[str, tuple[nn.Module | None, str, str]] = {}  # name -> (module, label, flag)
        self.history: list[dict] = []

    def register(self, name: str, module: nn.Module | None, label: str, flag: str) -> None:
        """Evaluate `module` beside the model under `name` (None: the option `flag` is off; its
        results are then None); reported as "`label` test accuracy", summed up as "`label`
        weights (`flag`)"."""
        self.averages[name] = (module, label, flag)

    @property
    def labels(self) -> dict[str, str]:
        return {name: label for name, (module, label, _) in self.averages.items() if module is not None}

    @property
    def titles(self) -> dict[str, str]:
        """{name: "EMA weights (--model-ema)"}: how the command line names each average's results."""
        return {name: f"{label} weights ({flag})" for name, (_, label, flag) in self.averages.items()}

    def _evaluate(self, module: nn.Module) -> dict:
        return dict(zip(METRICS, evaluate(module, self.batches, self.device, self.dtype, self.flight)))

    def results(self, averages: bool = True) -> dict:
        """{"accuracy", "top5", "test_loss"} of the model, then each average's {"accuracy",
        "test_loss", "top5"} under its name (None when it is off, or with averages=False).
        Collective."""
        model = self._evaluate(self.model)
        out = {"accuracy": model["accuracy"], "top5": model["top5"], "test_loss": model["test_loss"]}
        for name, (module, _, _) in self.averages.items():
            out[name] = self._evaluate(module) if averages and module is not None else None
        return out

    def epoch_end(self, step: int) -> None:
        """The evaluation at the end of the epoch that step `step` ended: a history record, reported."""
        with self.flight.waiting(WHAT):
            results = self.results()
        record = {"epoch": self.sampler.epoch - 1, "step": step, "accuracy": results["accuracy"],
                  "top5": results["top5"], "test_loss": results["test_loss"],
                  **{name: results[name] for name in self.labels}}
        self.history.append(record)
        self.report.epoch(record, self.labels)

    def catch_up(self, step: int) -> None:
        """At the start of an attempt: the evaluation of the epoch that step `step` ended, if a
        preemption at that epoch's end skipped it."""
        if step and self.sampler.consumed == 0 and (not self.history or self.history[-1]["step"] != step):
            with self.flight.waiting(WHAT, at="the evaluation a preemption skipped"):
                self.epoch_end(step)

    def final(self, step: int, preempted: bool) -> dict:
        """The run's results at its end, as results() gives them: None after a preemption (the
        grace period is ticking: leave now), the last epoch's if it ended at `step`, else
        evaluated now (a run stopped mid-epoch by --max-steps)."""
        if preempted:
            return {"accuracy": None, "top5": None, "test_loss": None, **{name: None for name in self.averages}}
        if not self.history or self.history[-1]["step"] != step:
            with self.flight.waiting(WHAT, at="the final evaluation"):
                return self.results()
        last = self.history[-1]
        return {"accuracy": last["accuracy"], "top5": last.get("top5"), "test_loss": last["test_loss"],
                **{name: last.get(name) for name in self.averages}}

    def progress(self) -> dict:
        """The history, for a checkpoint's progress."""
        return {"history": self.history}

    def restore(self, progress: dict) -> None:
        self.history = list(progress.get("history", []))
