"""What rank 0 shows while the trainer runs: a progress bar, log lines, metrics records."""

from __future__ import annotations

from phase4_production.config import TrainConfig
from phase4_production.monitoring import memory_stats


def progress_bar(cfg: TrainConfig, rank: int, total: int, done: int):
    if rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="step", dynamic_ncols=True, desc="train")


def log_step(metrics, bar, step, loss, scheduler, times, report, device, every) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    if metrics is None:
        return
    if report and report["stragglers"]:
        slow = ", ".join(f"rank {s['rank']} on {s['host']} ({s['score']:.2f}x median, {s['phase']})"
                         for s in report["stragglers"])
        metrics.write(step, event="straggler", stragglers=report["stragglers"], scores=report["scores"])
        (bar.write if bar is not None else print)(f"straggler at step {step}: {slow}")
    if step % every == 0:
        metrics.write(step, event="train", loss=loss, lr=scheduler.get_last_lr()[0],
                      **{f"{k}_s": v for k, v in times.items() if k not in ("samples", "samples_per_s")},
                      samples_per_s=times["samples_per_s"],
                      global_samples_per_s=report["samples_per_s"] if report else None,
                      **memory_stats(device))


def log_epoch(metrics, bar, record: dict) -> None:
    if metrics is None:
        return
    metrics.write(record["step"], event="eval", **{k: v for k, v in record.items() if k != "step"})
    line = f"epoch {record['epoch']}: test accuracy {record['accuracy']:.2%}, test loss {record['test_loss']:.3f}"
    (bar.write if bar is not None else print)(line)
