"""What rank 0 shows and records while the trainer runs.

    RunReport(options, rank, ...)   built with the run (options: the config's report section);
                                    shows and records nothing until opened
      .open(done, config, lines)    at the start of training (never in a read-only mode): the
                                    metrics file (+ TensorBoard), the config files, the opening
                                    lines; on a terminal a tqdm bar, in a log file (stdout/stderr
                                    not a terminal, as under SLURM or Kubernetes) one plain line
                                    every --log-every steps, never a carriage return
      .step(...)                    metrics.jsonl "train" records (+ TensorBoard train/...), on the
                                    logged steps (the only ones whose loss and times are read)
      .epoch(record, labels)        "eval" records: top-1, top-5, loss; "eval_<name>" records: the
                                    same for each average evaluated beside the model ("eval_ema":
                                    the --model-ema average)
      .checkpoint(...)              "checkpoint" records: the loop's wait, the write's seconds, bytes
      .say(line)                    a line that does not break the bar
      .close(step, summary)         the "summary" record

Every record carries the attempt (TORCHELASTIC_RESTART_COUNT), so the records of a run
that torchrun restarted can be told apart. metrics.jsonl holds each step once, in order: a
start that resumes at step N first moves the records of earlier attempts after N (steps that a
kill lost and this start trains again) and any line a kill cut short to metrics.superseded.jsonl
(nothing is lost), then says so in a "resume" record; TensorBoard hides the same steps of
earlier attempts (torch's SummaryWriter purge_step). config.json is replaced whole (a
temporary file renamed). A write that fails (a full disk, a file that is a folder) is one line
naming the file (run_folder.cannot_write). Throughput is per rank (one GPU) and for the
whole job; MFU is reported where the GPU's peak is known (monitoring.peak_flops).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from phase4_production.monitoring import MetricsWriter, memory_stats, mfu, peak_flops
from phase4_production.trainer.run_folder import cannot_write, replace_whole


class RunReport:
    """Rank 0's bar or log lines and its metrics, once opened; until then, and on the other
    ranks, every method does nothing. `total`: the step this run stops at; `folder`: the
    output folder (metrics.jsonl, tensorboard/, config.json, configs/)."""

    def __init__(self, options, rank: int, attempt: int, total: int, world: int, device: torch.device,
                 folder: str | Path, flops_per_sample: float | None = None):
        self.options, self.rank, self.folder = options, rank, Path(folder)
        self.active = False
        self.metrics: MetricsWriter | None = None
        self.attempt, self.total, self.world = attempt, total, world
        self.every, self.device = options.log_every, device
        self.peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.flops_per_sample = flops_per_sample
        self.started, self.done_at_start = time.perf_counter(), 0
        self.bar = None
        self.lines = False

    def open(self, done: int, config: dict, lines: list[str]) -> None:
        """Start reporting a run that has `done` steps behind it: on rank 0 the metrics writer
        (TensorBoard when installed, or a warning when --tensorboard asks for it and it is not),
        `config` written to config.json (the latest start's) and configs/<time>-attempt<N>-pid<P>.json
        (every start's), `lines` printed, then the bar or the plain lines."""
        installed = importlib.util.find_spec("tensorboard") is not None
        if self.options.tensorboard and not installed and self.rank == 0:
            print("warning: --tensorboard: the tensorboard package is not installed (pip install -e "
                  "\".[tensorboard]\"); metrics go to metrics.jsonl only", file=sys.stderr, flush=True)
        if self.rank != 0:
            return
        board = self.folder / "tensorboard" if self.options.tensorboard is not False and installed else None
        path = self.folder / "metrics.jsonl"
        try:
            superseded = supersede(path, done)
            if board is not None and board.is_dir():  # earlier attempts wrote there: hide their steps after `done`
                from torch.utils.tensorboard import SummaryWriter

                SummaryWriter(str(board), purge_step=done + 1).close()
            self.metrics = MetricsWriter(path, self.rank, board)
            resolved = json.dumps(config, indent=2) + "\n"
            path = self.folder / "config.json"  # the latest start's; configs/ keeps every attempt's
            replace_whole(path, lambda tmp: tmp.write_text(resolved))
            path = self.folder / "configs"
            path.mkdir(exist_ok=True)
            path = path / f"{time.strftime('%Y%m%d-%H%M%S')}-attempt{self.attempt}-pid{os.getpid()}.json"
            path.write_text(resolved)
        except OSError as exc:
            raise cannot_write(path, exc) from None
        if done or superseded:
            self.write(done, event="resume", superseded=superseded)
        for line in lines:
            print(line, flush=True)
        self.active, self.started, self.done_at_start = True, time.perf_counter(), done
        self.lines = self.options.progress and not sys.stderr.isatty()  # a log file: plain lines
        if self.options.progress and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=done, unit="step", dynamic_ncols=True, desc="train")

    def write(self, step: int, **fields) -> None:
        if self.metrics is not None:
            try:
                self.metrics.write(step, attempt=self.attempt, **fields)
            except OSError as exc:  # a full disk
                raise cannot_write(self.metrics.path, exc) from None

    def say(self, line: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def step(self, step: int, loss: float | None, lr: float, times: dict | None, report: dict | None) -> None:
        """Every step: the bar moves, a straggler report is recorded; on a logged step (loss
        and times given) also the "train" record and the plain log line."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if report and report["stragglers"]:
            slow = ", ".join(f"rank {s['rank']} on {s['host']} ({s['score']:.2f}x median, {s['phase']})"
                             for s in report["stragglers"])
            self.write(step, event="straggler", stragglers=report["stragglers"], scores=report["scores"])
            self.say(f"straggler at step {step}: {slow}")
        if loss is None or times is None:
            return
        per_rank = times["samples_per_s"]
        utilisation = mfu(per_rank, self.flops_per_sample, self.peak) if self.peak and self.flops_per_sample else None
        self.write(step, event="train", loss=loss, lr=lr,
                   **{f"{k}_s": v for k, v in times.items() if k not in ("samples", "samples_per_s")},
                   samples_per_s=per_rank, global_samples_per_s=report["samples_per_s"] if report else None,
                   mfu=utilisation, **memory_stats(self.device))
        if self.lines:
            elapsed = time.perf_counter() - self.started
            rate = (step - self.done_at_start) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - step) / rate if rate > 0 else float("nan")
            extra = f", MFU {utilisation:.0%}" if utilisation is not None else ""
            # the loader's share: the time this rank waited for its next batch; near 0 when it keeps up
            loader = f", loader {times['data'] / times['step']:.0%} of the step" if times.get("step") else ""
            print(f"step {step}/{self.total}: loss {loss:.4f}, lr {lr:.4g}, {per_rank:.0f} images/s per rank "
                  f"({per_rank * self.world:.0f} in all){extra}{loader}, eta {_duration(eta)}", flush=True)

    def epoch(self, record: dict, labels: dict[str, str] | None = None) -> None:
        """An epoch's evaluation: `record` holds the model's results and, under the names of
        `labels` ({name: label}), those of the averages evaluated beside it."""
        if not self.active:
            return
        labels = labels or {}
        self.write(record["step"], event="eval", **{k: v for k, v in record.items() if k != "step" and k not in labels})
        top5 = f" (top-5 {record['top5']:.2%})" if record.get("top5") is not None else ""
        self.say(f"epoch {record['epoch']}: test accuracy {record['accuracy']:.2%}{top5}, "
                 f"test loss {record['test_loss']:.3f}")
        for name, label in labels.items():
            result = record.get(name)
            if result is None:
                continue
            self.write(record["step"], event=f"eval_{name}", epoch=record["epoch"], **result)
            top5 = f" (top-5 {result['top5']:.2%})" if result.get("top5") is not None else ""
            self.say(f"epoch {record['epoch']}: {label} test accuracy {result['accuracy']:.2%}{top5}, "
                     f"test loss {result['test_loss']:.3f}")

    def checkpoint(self, step: int, seconds: float, size: int, write_seconds: float | None = None) -> None:
        """seconds: what the training loop waited for the save; write_seconds: the write itself
        (in a background thread with --async-checkpoint, the same as seconds without)."""
        self.write(step, event="checkpoint", seconds=seconds, bytes=size,
                   write_seconds=seconds if write_seconds is None else write_seconds)

    def close(self, step: int, summary: dict) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.write(step, event="summary", **{k: v for k, v in summary.items()
                                                 if k not in ("history", "step", "averages")})
            self.metrics.close()


def supersede(path: Path, done: int) -> int:
    """Before a start that trains on from step `done` appends to the metrics file `path`: its
    records after `done` (written by attempts that a kill ended after that step) and lines that
    are not whole records (a kill in the middle of a write) move to metrics.superseded.jsonl
    (appended; a cut line as {"event": "torn", "text": ...}); `path` is replaced whole. Returns
    how many lines moved."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith("\n") else None
            whole = isinstance(record, dict) and isinstance(record.get("step"), int)
        except ValueError:
            whole = False
        if not whole:
            moved.append(json.dumps({"event": "torn", "text": line.rstrip("\n")}) + "\n")
        elif record["step"] > done:
            moved.append(line)
        else:
            keep.append(line)
    if moved:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.writelines(moved)
            f.flush()
            os.fsync(f.fileno())
        replace_whole(path, lambda tmp: tmp.write_text("".join(keep)))
    return len(moved)


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
