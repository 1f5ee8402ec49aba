"""What the benchmark scripts share: one-line flag errors, an optional matplotlib, message
sizes as text, --json/--plot output, and the check that decides whether a learner's
all-reduce is timed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import current_device


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (no usage block) and exits with code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def pyplot_or_none():
    """matplotlib.pyplot on a file-only backend, or None (with an install hint) if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: pip install matplotlib (or pip install -e '.[plot]')")
        return None
    return plt



def save_outputs(result, json_path: str | None, plot_path: str | None = None, plot=None) -> None:
    """The raw numbers as JSON (--json) and the figure (--plot, drawn by `plot(result, path)`),
    each only when asked for."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"raw numbers written to {json_path}")
    if plot_path and plot is not None:
        plot(result, plot_path)


def fmt_size(n: int) -> str:
    """Bytes as text: 4096 -> '4 KiB', 3 << 20 -> '3 MiB', 1000 -> '1000 B'."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def learner_status(all_reduce) -> str:
    """'ok', 'TODO' or 'WRONG RESULT', agreed by all ranks: `all_reduce(x)` (in place) of one
    1027-element tensor (not divisible by small world sizes) checked against dist.all_reduce."""
    x = torch.arange(1027, dtype=torch.float32, device=current_device()) + 1000.0 * dist.get_rank()
    expected = x.clone()
    dist.all_reduce(expected)
    try:
        all_reduce(x)
        code = 0 if torch.allclose(x, expected) else 2
    except NotImplementedError as exc:
        if not str(exc).startswith("TODO"):
            raise
        code = 1
    flag = torch.tensor([code], device=x.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return ("ok", "TODO", "WRONG RESULT")[int(flag.item())]
