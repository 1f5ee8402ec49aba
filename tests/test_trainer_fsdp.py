"""The trainer under --parallel fsdp (torch's fully_shard, sharded DCP checkpoints), end to end:
the same weights as ddp, kills and resumes under torchrun, other world sizes, the other
--parallel's checkpoints, --export. Same small runs as tests/test_trainer.py (the small CNN
on the digits, one epoch of 22 steps, a checkpoint every 3 steps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from test_trainer import (ALL_REGULARISERS, EMA_LINE, STEPS, _one_line_error, cached, fingerprint_of, launch,
                          regularised_reference, short_run, torchrun)

FSDP = ("--parallel", "fsdp")
ACCURACY = re.compile(r"test accuracy (\d+\.\d+)% after 1 epochs on (\d) ranks")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer-fsdp")


def fsdp_reference(base: Path) -> str:
    def make():
        proc = launch(base / "fsdp-reference", *FSDP)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout
    return cached("fsdp-reference", make)


def ddp_reference(base: Path) -> str:
    def make():
        proc = launch(base / "ddp-reference")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout
    return cached("ddp-reference-plain", make)


def test_fsdp_on_two_ranks_ends_with_the_weights_of_ddp(base):
    """On 2 ranks a sum of two gradients is the same float in either order (a + b == b + a),
    so reduce-scatter then all-gather (FSDP) and all-reduce (DDP) give the same bits: the
    sharded run must end on DDP's weights exactly, and so on its accuracy."""
    fsdp, ddp = fsdp_reference(base), ddp_reference(base)
    assert fingerprint_of(fsdp) == fingerprint_of(ddp), \
        f"fsdp and ddp ended on other weights:\n{fsdp[-1500:]}\n{ddp[-1500:]}"
    assert ACCURACY.search(fsdp).group(1) == ACCURACY.search(ddp).group(1)


def test_fsdp_writes_one_committed_folder_of_shards_per_checkpoint(base):
    fsdp_reference(base)
    folder = base / "fsdp-reference" / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step_000000018", "step_000000021", f"step_{STEPS:09d}"], names  # keep 3, no .tmp left
    files = sorted(p.name for p in (folder / f"step_{STEPS:09d}").iterdir())
    assert files == [".metadata", "COMMITTED", "__0_0.distcp", "__1_0.distcp", "extra.pt"], files


def test_fsdp_killed_three_times_under_torchrun_ends_with_the_same_weights(base):
    """SIGKILL in a backward (attempt 0), as a save begins writing its shards (attempt 1), and
    as the backward that reduce-scatters begins (attempt 2); torchrun restarts the group."""
    faults = ";".join(["rank=1,step=4,phase=backward,attempt=0", "rank=0,step=8,phase=save,attempt=1",
                       "rank=1,step=13,phase=allreduce,attempt=2"])
    output, code = torchrun(base / "fsdp-killed", *FSDP, faults=faults, restarts=3)
    assert code == 0, output[-4000:]
    for attempt, step in ((1, 3), (2, 6), (3, 12)):
        assert f"attempt {attempt}: resuming at step {step} of {STEPS}" in output, output[-4000:]
    assert fingerprint_of(output) == fingerprint_of(fsdp_reference(base)), "the killed run ended with other weights"
    leftovers = [p.name for p in (base / "fsdp-killed" / "checkpoints").iterdir() if not p.name.startswith("step_")]
    assert leftovers == [], f"a torn save was left behind after the run finished: {leftovers}"


@pytest.mark.parametrize("world", [1, 3])
def test_an_fsdp_run_of_2_ranks_resumes_on_another_world_size(base, tmp_path, world):
    """Resharded from 2 ranks to 1 or 3 at step 7, the run trains on (the same samples, the same
    global batch, split otherwise) and ends near the accuracy of the run never resized."""
    first = launch(tmp_path, *FSDP, "--max-steps", "7")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = launch(tmp_path, *FSDP, nproc=world)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert f"rank 0 of {world} on cpu, attempt 0: resuming at step 7 of {STEPS}" in rest.stdout, rest.stdout
    found, whole = ACCURACY.search(rest.stdout), ACCURACY.search(fsdp_reference(base))
    assert found and int(found.group(2)) == world, rest.stdout
    assert abs(float(found.group(1)) - float(whole.group(1))) <= 3.0, \
        f"resharded to {world} rank(s): {found.group(0)}; never resized: {whole.group(0)}"


def test_fsdp_with_every_regulariser_and_its_sharded_ema_resumes_to_the_weights_of_ddp(base, tmp_path):
    """The EMA of a sharded model is the per-shard EMA of its DTensors, saved by every rank
    through DCP beside the model: killed at step 8 (torchrun restarts it) and resumed, the run
    ends on the ddp run's weights and EMA (2 ranks: the same sums, bit for bit)."""
    output, code = torchrun(tmp_path, *FSDP, *ALL_REGULARISERS, faults="rank=1,step=8,phase=backward", restarts=1)
    assert code == 0, output[-4000:]
    assert "attempt 1: resuming at step 6 of 22" in output, output[-4000:]
    ddp = regularised_reference(base)
    assert fingerprint_of(output) == fingerprint_of(ddp), "fsdp with the regularisers ended on other weights"
    assert EMA_LINE.search(output).group(0) == EMA_LINE.search(ddp).group(0), "the sharded EMA differs from ddp's"
    evaluated = launch(tmp_path, *FSDP, *ALL_REGULARISERS, "--evaluate")  # reads the sharded EMA back
    assert EMA_LINE.search(evaluated.stdout) and \
        EMA_LINE.search(evaluated.stdout).group(0) == EMA_LINE.search(ddp).group(0), \
        evaluated.stdout + evaluated.stderr[-2000:]


def test_the_other_parallels_checkpoints_are_refused_in_one_line(base, tmp_path):
    short_run(base, tmp_path / "ddp")
    _one_line_error(launch(tmp_path / "ddp", *FSDP), "--parallel ddp", "--parallel fsdp", "--export")
    # with --channels-last on, the GPU default: fully_shard refuses channels_last (non-contiguous)
    # conv weights, so under fsdp only the inputs may be converted (first H100 run, 2026-11-26)
    fsdp = launch(tmp_path / "fsdp", *FSDP, "--max-steps", "3", "--channels-last", "on")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    _one_line_error(launch(tmp_path / "fsdp"), "--parallel fsdp", "--export", "--init-from")


def test_export_writes_the_sharded_weights_as_one_state_dict_that_starts_a_ddp_run(base, tmp_path):
    from common.models import build_model

    fsdp_reference(base)
    weights = tmp_path / "weights.pt"
    proc = launch(base / "fsdp-reference", *FSDP, "--export", str(weights))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported the model weights of step {STEPS}" in proc.stdout, proc.stdout
    exported = re.search(r"^weights sha256: ([0-9a-f]{64})$", proc.stdout, re.M).group(1)
    assert exported == fingerprint_of(fsdp_reference(base)), "--export wrote other weights than the run ended on"
    state = torch.load(weights, weights_only=True)
    build_model("cnn", (1, 8, 8), 10).load_state_dict(state)  # plain names, every tensor whole
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "a temporary file was left next to it"
    start = launch(tmp_path / "from-export", "--init-from", str(weights), "--evaluate")
    assert start.returncode == 0, start.stderr[-3000:]
    assert f"weights sha256: {exported}" in start.stdout, start.stdout


@pytest.mark.parametrize("flags, needles", [
    (["--parallel", "fsdp", "--compression", "topk"], ["--compression topk", "--parallel fsdp"]),
    (["--parallel", "fsdp", "--async-checkpoint", "on"], ["--async-checkpoint on", "--parallel fsdp"]),
    (["--cpu-offload"], ["--cpu-offload", "--parallel fsdp"]),
    (["--reshard-after-forward", "false"], ["--reshard-after-forward", "--parallel fsdp"]),
    (["--export", "x.pt", "--evaluate"], ["--export", "--evaluate"]),
])
def test_fsdp_options_that_cannot_apply_are_refused_in_one_line(capsys, monkeypatch, flags, needles):
    from solutions.phase4_production.trainer.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    import subprocess

    _one_line_error(subprocess.CompletedProcess([], exit_.value.code, "", capsys.readouterr().err), *needles)


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    _one_line_error(launch(tmp_path / "empty", *FSDP, "--export", str(tmp_path / "w.pt")), "--export",
                    "no checkpoint")


def test_cpu_offload_on_the_cpu_is_one_line(tmp_path):
    _one_line_error(launch(tmp_path, *FSDP, "--cpu-offload"), "--cpu-offload", "leave it off")
