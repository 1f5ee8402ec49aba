"""The trainer's read-only modes: functions over a built run (or its inputs); nothing is trained,
and nothing is written in --output-dir.

    benchmark_loader(inputs, steps, ...)   --benchmark-loader N: the input pipeline alone, images/s
    export_weights(run)                    --export FILE: the newest checkpoint's model weights as one
                                           plain state_dict
    evaluate_only(run)                     --evaluate: the newest checkpoint (or --init-from's weights)
                                           on the test set, and its averages (the --model-ema average)

Each returns the summary the command line prints (cli.py), and runs inside an entry of the
flight record named after it ("--benchmark-loader", "--export", "--evaluate"), so that a wait
that runs out says where it was.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from phase4_production.trainer.build import Run
from phase4_production.trainer.data import Inputs
from phase4_production.trainer.device_stage import measure_loader
from phase4_production.trainer.flight import FlightRecord
from phase4_production.trainer.run_folder import cannot_write, replace_whole, why_unwritable


def benchmark_loader(inputs: Inputs, steps: int, device: torch.device, world: int, flight: FlightRecord) -> dict:
    """images/s of the training batches alone (device_stage.measure_loader): no model is built."""
    with flight.waiting("the loader benchmark's all-reduce", at="--benchmark-loader"):
        return {"benchmark_loader": measure_loader(inputs.train, steps, device), "world_size": world}


def export_weights(run: Run) -> dict:
    """--export: the model's full state_dict (gathered from the shards under fsdp) written by
    rank 0 to the file with torch.save, atomically (a temporary file renamed). Collective.
    ValueError (one line) with no checkpoint."""
    path, source = run.cfg.run.export, run.source
    with run.flight.waiting("the exported weights' gather", at="--export"):
        if source is None:
            raise ValueError("--export: no checkpoint in --output-dir to export (train first, or point --output-dir "
                             "at a run)")
        state = run.strategy.full_state_dict()
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                replace_whole(path, lambda tmp: torch.save(state, tmp))
            except (OSError, RuntimeError) as exc:  # a full disk (torch.save's "unexpected pos"), a folder there
                if isinstance(exc, RuntimeError) and why_unwritable(Path(path).parent, exc) is None:
                    raise
                raise cannot_write(path, exc) from None
        return {"exported": f"{source} -> {path}", "step": run.start, "world_size": run.world,
                "fingerprint": run.strategy.fingerprint()}


def evaluate_only(run: Run) -> dict:
    """--evaluate: the weights the run holds now (its newest checkpoint's, else --init-from's,
    else the initial ones) on the test set; the averages too where a checkpoint holds them."""
    with run.flight.waiting("the evaluation's all-reduce", at="--evaluate"):
        results = run.evaluator.results(averages=run.resumed)  # the run's averages, as its epoch ends evaluate them
        return {"evaluated": True, "step": run.start, "total_steps": run.total_steps, "world_size": run.world,
                **results, "fingerprint": run.strategy.fingerprint(), "averages": run.evaluator.titles,
                "source": f"{run.source}" if run.resumed else run.cfg.model.init_from or "the initial weights"}
