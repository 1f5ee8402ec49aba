"""The trainer's command line: `python -m solutions.phase4_production.train [--flags]`.

    main(argv)    parse and check the config (one line on bad input), pick the device, start the
                  ranks (or join torchrun's), run loop.train on each, print the result on rank 0
                  (solutions/phase4_production/train.py is its entry point: python -m ...train)

Errors no restart can fix (a bad flag, a missing dataset, a full disk) are one line and exit 2,
said once per torchrun agent; a collective that timed out (a stuck or dead peer) is one line
and exit 1, which torchrun retries.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch

from common.launch import USER_ERRORS, WorldError, run_or_join
from solutions.phase4_production.hangs import CollectiveTimeout
from solutions.phase4_production.trainer.config import ConfigError, parse_config
from solutions.phase4_production.trainer.environment import device_environment, launch_environment
from solutions.phase4_production.trainer.lifecycle import die_with_parent, fatal_reported, report_fatal, stop_signals
from solutions.phase4_production.trainer.loop import train


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _one_line(kind, code: int, say) -> Iterator[None]:
    """An exception of `kind` (a class or a tuple; also as the cause of a failed world) ends
    the program: `say` gets its one line, and the exit code is `code`."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    try:
        yield
    except (*kinds, WorldError) as exc:
        if isinstance(exc, WorldError):
            causes = [f.exception for f in sorted(exc.failures.values(), key=lambda f: f.when)]
            exc = next((c for c in causes if isinstance(c, kind)), None) or exc
        if not isinstance(exc, kind):
            raise
        say(str(exc) if isinstance(exc, ConfigError) else f"error: {exc}")
        raise SystemExit(code) from None


def default_nproc() -> int:
    """Ranks to start without torchrun: one per GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def choose_training_device(device: str, local_ranks: int) -> None:
    """Check --device against this node (raise ValueError, one line) and pin the backend:
    auto trains on GPUs when the node has them, one per local rank, and refuses fewer GPUs
    than local ranks rather than falling back to the CPU without a word; cpu uses gloo
    even where GPUs are visible."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu":
        os.environ["COURSE_BACKEND"] = "gloo"
    elif device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no GPU is visible to this process (CUDA_VISIBLE_DEVICES? a CPU-only torch?); "
                         "use --device cpu to train on the CPU")
    elif 0 < gpus < local_ranks or (device == "cuda" and gpus < local_ranks):
        raise ValueError(f"{local_ranks} ranks on this node but {gpus} GPU(s) visible: start one rank per GPU "
                         f"(--nproc-per-node={gpus} under torchrun, --nproc {gpus} without), or --device cpu to train "
                         "on the CPU")


def _print_averages(summary: dict) -> None:
    """A line per average evaluated beside the model ("EMA weights (--model-ema): ...")."""
    for name, title in summary.get("averages", {}).items():
        result = summary.get(name)
        if result:
            top5 = f" (top-5 {result['top5']:.2%})" if result.get("top5") is not None else ""
            print(f"{title}: test accuracy {result['accuracy']:.2%}{top5}, test loss {result['test_loss']:.4f}")


def main(argv: list[str] | None = None) -> None:
    under_torchrun = "RANK" in os.environ
    if under_torchrun:
        die_with_parent()  # torchrun starts workers in new sessions: an agent's SIGKILL would orphan us
        if fatal_reported():  # an earlier attempt met an error no restart can fix, and said so
            raise SystemExit(2)
    # bad input, a missing dataset, a full disk: one line, once, exit 2; a stuck peer: one line, exit 1 (retried)
    with _one_line(CollectiveTimeout, code=1, say=_say), _one_line(USER_ERRORS, code=2, say=report_fatal):
        notes = launch_environment()  # a torchrun world that is not whole: one line; leftovers of one dropped
        cfg = parse_config(argv, raise_errors=True)
        if cfg.faults.fail_at_step is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise ValueError("--fail-at-step kills a rank on purpose; run under torchrun with --max-restarts=1 or "
                             "more, which restarts the group (see solutions/phase4_production/README.md)")
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun else cfg.run.nproc or default_nproc()
        choose_training_device(cfg.run.device, nproc)
        notes += device_environment(cfg.run.device, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                    nproc, cfg.run.deterministic)
        for note in notes if os.environ.get("LOCAL_RANK", "0") == "0" else ():  # once per node
            _say(note)
        if cfg.data.decode == "cuda" and (cfg.run.device == "cpu" or not torch.cuda.is_available()):
            raise ValueError("--decode cuda decodes on the GPU (nvjpeg) and this run has none (--device cpu, or no "
                             "GPU visible): use --decode tensor")
        try:  # the launcher forwards SIGTERM and SIGINT to its ranks; a second Ctrl-C stops at once
            summary = run_or_join(train, nproc, args=(cfg,), timeout=cfg.run.timeout, forward_signals=stop_signals())
        except KeyboardInterrupt:
            print(f"\ninterrupted twice: the ranks were stopped without saving; the newest checkpoint in "
                  f"{cfg.run.output_dir}/checkpoints is kept, run the same command to resume", file=sys.stderr)
            raise SystemExit(130) from None
    if summary is None:  # not rank 0 under torchrun
        return
    if summary.get("benchmark_loader"):
        bench = summary["benchmark_loader"]
        print(f"loader: {bench['images_per_s']:.0f} images/s on rank 0 ({bench['all_images_per_s']:.0f} in all on "
              f"{summary['world_size']} ranks), {bench['steps']} steps of {bench['batch']} images per rank "
              f"({bench['seconds']:.1f} s, after {bench['warmup']} warm-up steps)")
        return
    if summary.get("exported"):
        print(f"exported the model weights of step {summary['step']}: {summary['exported']} (a state_dict: "
              "torch.load it, or start a run with --init-from)")
        print(f"weights sha256: {summary['fingerprint']}")
        return
    if summary.get("evaluated"):
        top5 = f" (top-5 {summary['top5']:.2%})" if summary["top5"] is not None else ""
        print(f"evaluated {summary['source']} (step {summary['step']} of {summary['total_steps']}) on "
              f"{summary['world_size']} ranks: test accuracy {summary['accuracy']:.2%}{top5}, "
              f"test loss {summary['test_loss']:.4f}")
        _print_averages(summary)
        print(f"weights sha256: {summary['fingerprint']}")
        return
    if summary["preempted"]:
        print(f"preempted at step {summary['step']} of {summary['total_steps']}: checkpoint saved in "
              f"{summary['output_dir']}/checkpoints; run the same command to resume")
        print(f"weights at step {summary['step']} sha256: {summary['fingerprint']}")
        return
    if summary["step"] < summary["total_steps"]:
        print(f"stopped at step {summary['step']} of {summary['total_steps']} (--max-steps {cfg.run.max_steps}); "
              "run again without it to finish")
    speed = f", {summary['images_per_s']:.0f} images/s" if summary["images_per_s"] else ", nothing left to train"
    print(f"test accuracy {summary['accuracy']:.2%} after {summary['epochs_done']} epochs on "
          f"{summary['world_size']} ranks ({summary['seconds']:.1f} s{speed})")
    _print_averages(summary)
    print(f"final weights sha256: {summary['fingerprint']}")
