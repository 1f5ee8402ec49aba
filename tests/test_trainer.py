"""The production trainer end to end: kills, preemption, bad input, real data formats, recipes.

Each expensive run happens once per session (the _runs cache) and serves several tests.
Runs use the small CNN on the bundled digits, one epoch of 22 steps, a checkpoint every 3
steps, so the whole file takes a couple of minutes on 2 cores; the code path is the one
the default ResNet-18 run takes.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from common.launch import run_world
from common.torchrun import Torchrun, TorchrunError, free_port, multi_node_args, run_agent
from solutions.phase4_production.checkpoint import load_verified
from solutions.phase4_production.trainer.config import FLAGS as OPTIONS
from solutions.phase4_production.trainer.config import RECIPES, TrainConfig, build_parser, load_recipe, parse_config
from solutions.phase4_production.trainer.data import SeededSamples

ROOT = Path(__file__).resolve().parent.parent
MODULE = "solutions.phase4_production.train"
FLAGS = ["--model", "cnn", "--epochs", "1", "--global-batch", "64", "--checkpoint-every", "3", "--progress", "false"]
STEPS = 1437 // 64  # digits: 22 steps per epoch
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
# A fault that never fires but installs the injector's all-reduce hook, as the kill in the
# all-reduce does: the reference of that job must run the same hook (same arithmetic).
HOOK_ONLY = "rank=0,step=9999,phase=allreduce"
FINGERPRINT = re.compile(r"^final weights sha256: ([0-9a-f]{64})$", re.M)
_runs: dict = {}


def launch(out: Path, *extra: str, nproc: int = 2, faults: str = "", timeout: float = 240,
           own_group: bool = False) -> subprocess.CompletedProcess:
    """The trainer without torchrun (it starts its own ranks). Its own deadline (--timeout)
    comes first, so a hung run says where each rank was stuck before the test kills it.
    own_group: a process group of its own, as a shell's job (a fault that signals the whole
    group must not reach pytest)."""
    env = {**os.environ, **ENV, "COURSE_FAULTS": faults}
    return subprocess.run([sys.executable, "-m", MODULE, "--nproc", str(nproc), "--output-dir", str(out), *FLAGS,
                           "--timeout", str(max(timeout - 30, 1)), *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=own_group)


def torchrun(out: Path, *extra: str, faults: str = "", restarts: int = 3, timeout: float = 240) -> tuple[str, int]:
    """One torchrun agent with 2 workers; (its output, its exit code); no process left behind."""
    return run_agent(["--standalone", "--nproc-per-node=2", f"--max-restarts={restarts}", "-m", MODULE,
                      "--output-dir", str(out), *FLAGS, *extra],
                     timeout=timeout, env={**ENV, "COURSE_FAULTS": faults}, cwd=ROOT)


def fingerprint_of(text: str) -> str:
    found = FINGERPRINT.findall(text)
    assert len(found) == 1, f"expected one 'final weights sha256:' line, got {found}:\n{text[-3000:]}"
    return found[0]


def cached(name: str, make):
    """Run `make()` once per session; a failure is raised again for every test that needs it.
    A run whose files a test reads afterwards names its folder in `name`: other modules'
    `base` folders differ, and the cache is shared by every module that imports it."""
    if name not in _runs:
        try:
            _runs[name] = make()
        except BaseException as exc:  # noqa: BLE001
            _runs[name] = exc
    if isinstance(_runs[name], BaseException):
        raise _runs[name]
    return _runs[name]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer")


def _short_run(base: Path) -> tuple[Path, str]:
    """One 3-step run of the default flags per session (checkpoint step 3): its folder and final weights."""
    def make():
        proc = launch(base / "short-run", "--max-steps", "3")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return base / "short-run", fingerprint_of(proc.stdout)
    return cached("short-run", make)


def short_run(base: Path, dest: Path) -> Path:
    """`dest`, a copy of the session's 3-step run (its checkpoint, config and metrics): tests that need
    a short finished run to resume, refuse or read share it instead of training their own. A copy,
    because they write in it."""
    shutil.copytree(_short_run(base)[0], dest, dirs_exist_ok=True)
    return dest


def short_run_fingerprint(base: Path) -> str:
    """The final weights of the session's 3-step run (float32, default flags)."""
    return _short_run(base)[1]


def reference(base: Path, faults: str = "") -> str:
    """Fingerprint of the uninterrupted run (launcher mode)."""
    def make():
        proc = launch(base / f"reference{'-hook' if faults else ''}", faults=faults)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"test accuracy \d+\.\d+% after 1 epochs on 2 ranks", proc.stdout), proc.stdout
        return fingerprint_of(proc.stdout)
    return cached(f"reference{faults}", make)


# ---------------------------------------------------------------- kills, preemption, corruption


def test_trainer_killed_three_times_ends_with_the_same_weights(base):
    """SIGKILL in a backward (attempt 0), in the middle of writing a checkpoint in the
    background writer thread while the loop trains on (attempt 1), and in the all-reduce
    (attempt 2); torchrun restarts the group each time."""
    faults = ";".join(["rank=1,step=4,phase=backward,attempt=0", "rank=0,step=8,phase=save,attempt=1",
                       "rank=1,step=13,phase=allreduce,attempt=2"])
    output, code = torchrun(base / "killed", "--async-checkpoint", "on", faults=faults, restarts=3)
    assert code == 0, output[-4000:]
    # attempt 1 resumes from step 3; the save of step 9 was torn, so attempt 2 resumes from 6
    for attempt, step in ((1, 3), (2, 6), (3, 12)):
        assert f"attempt {attempt}: resuming at step {step} of {STEPS}" in output, output[-4000:]
    assert fingerprint_of(output) == reference(base, HOOK_ONLY), "the killed run ended with other weights"


def test_trainer_fail_at_step_recovers_to_the_same_weights(base):
    output, code = torchrun(base / "fail-at-step", "--fail-at-step", "5", restarts=1)
    assert code == 0, output[-4000:]
    assert "attempt 1: resuming at step 3" in output, output[-4000:]
    assert fingerprint_of(output) == reference(base), "--fail-at-step changed the final weights"
    assert re.search(r"^\[fault injector\] kill at rank=1,step=5", output, re.M), \
        f"the injector's line is not on a line of its own:\n{output[-4000:]}"
    assert "attempt 1 is a planned restart" in output, f"nothing says the kill was planned:\n{output[-4000:]}"


def test_trainer_sigterm_with_loader_workers_saves_at_the_next_step_and_resumes(base):
    """torchrun sends SIGTERM to each worker's whole process group, loader workers included:
    they must not die of it mid-step, the rank stops at the boundary and shuts them down."""
    out = base / "preempted-workers"
    output, _ = torchrun(out, "--workers", "2", faults="rank=0,step=6,phase=forward,action=term", restarts=1)
    assert "preempted at step 7 of 22" in output, output[-4000:]  # the agent itself exits 1 on a signal
    assert "killed by signal" not in output, output[-4000:]
    again = launch(out, "--workers", "2")
    assert "resuming at step 7 of 22" in again.stdout, again.stdout + again.stderr[-3000:]
    assert fingerprint_of(again.stdout) == reference(base)


@pytest.mark.parametrize("action", ["term", "int", "term-group"])
def test_the_launcher_forwards_sigterm_and_sigint_to_its_ranks(base, tmp_path, action):
    """`python -m ...train` without torchrun, as `docker stop`, `timeout` or Ctrl-C stop it,
    or `kill -TERM -<pgid>` (term-group: every process of the launcher's group, the fork
    server its ranks came from included, as a shell's `kill %1` sends it):
    the ranks save at the next step boundary, exit 0, and the rerun resumes from there."""
    first = launch(tmp_path, faults=f"rank=1,step=4,phase=forward,action={action}", own_group=True)
    assert first.returncode == 0, f"exit code {first.returncode}:\n{first.stdout}\n{first.stderr[-3000:]}"
    assert "preempted at step 5 of 22" in first.stdout, first.stdout + first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    again = launch(tmp_path)
    assert "resuming at step 5 of 22" in again.stdout, again.stdout + again.stderr[-3000:]
    assert fingerprint_of(again.stdout) == reference(base)


def test_a_rank_stuck_before_a_collective_ends_the_attempt_and_the_job_resumes(base, tmp_path):
    """Rank 1 hangs in the forward of step 7 (alive, never back): rank 0's gradient
    all-reduce times out after --pg-timeout, the attempt ends with one line naming the
    step and the collective, and torchrun's restart resumes to the uninterrupted weights."""
    output, code = run_agent(["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--shutdown-timeout=2",
                              "-m", MODULE, "--output-dir", str(tmp_path), *FLAGS, "--pg-timeout", "3"],
                             timeout=240, env={**ENV, "COURSE_FAULTS": "rank=1,step=6,phase=forward,action=hang"},
                             cwd=ROOT)
    assert code == 0, output[-4000:]
    assert "error: step 7: DDP's gradient all-reduce (in backward) waited more than 3 s" in output, output[-4000:]
    assert "attempt 1: resuming at step 6 of 22" in output, output[-4000:]
    assert fingerprint_of(output) == reference(base)


def _a_stop_flag_nobody_answers() -> str | None:
    """Rank 1 skips the stop agreement of step 8 (it waits in a barrier of another group);
    rank 0's all-reduce, issued through the flight record (4.6's recorder), runs out after
    2 s. Returns rank 0's CollectiveTimeout line."""
    import torch.distributed as dist

    from solutions.phase4_production.hangs import CollectiveTimeout
    from solutions.phase4_production.trainer.flight import FlightRecord
    from solutions.phase4_production.trainer.sync import StopAgreement

    class Preemption:
        requested = False

    flight = FlightRecord(2.0)
    agreement, other = StopAgreement(Preemption(), flight), dist.new_group(backend="gloo")
    flight.step = 6
    agreement.should_stop(7)  # both ranks: collective #0
    line = None
    if dist.get_rank() == 0:
        with pytest.raises(CollectiveTimeout) as caught:
            agreement.should_stop(8)
        line = str(caught.value)
    dist.barrier(group=other)
    return line


def test_a_collective_that_runs_out_is_named_from_the_flight_record():
    """The trainer names a timeout from its flight record (flight.py), not from the error's
    text: the step, the entry (who waited), and the collective as 4.6's recorder numbered it."""
    line = run_world(_a_stop_flag_nobody_answers, 2, timeout=120)[0]
    assert line.startswith("step 7: the stop-flag all-reduce (StopAgreement, on a gloo group), collective #1 "
                           "(all_reduce int32[1]) of group [0, 1], waited more than 2 s"), line


def test_a_full_disk_is_one_line_naming_the_folder_and_keeps_the_last_checkpoint(tmp_path):
    proc = launch(tmp_path, faults="rank=0,step=5,phase=save,action=enospc")  # the save of step 6 fails
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[fault injector]"))
    _one_line_error(proc, "cannot write the checkpoint of step 6", "no space left on the device", str(tmp_path))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000000003.pt"], f"a failed save left {names}"


def test_why_a_write_failed_is_read_from_the_errno_or_the_folder(tmp_path, monkeypatch):
    """torch.save reports a write cut short by a full disk as "unexpected pos": the folder
    itself then says why."""
    import errno as errnos

    from solutions.phase4_production.trainer.run_folder import why_unwritable

    assert why_unwritable(tmp_path, OSError(errnos.EROFS, "x")) == "the file system is read-only"
    assert why_unwritable(tmp_path, RuntimeError("boom")) is None  # a healthy folder: not a disk problem
    real = os.statvfs(tmp_path)
    full = os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, 0, 0, *real[5:]))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    assert why_unwritable(tmp_path, RuntimeError("unexpected pos 60573824 vs 60573712")) == \
        "no space left on the device"


def test_an_error_no_restart_can_fix_is_printed_once_under_torchrun(tmp_path):
    (tmp_path / "empty").mkdir()
    output, code = torchrun(tmp_path / "run", "--dataset", "cifar10", "--data-root", str(tmp_path / "empty"),
                            restarts=3)
    assert code != 0, output[-3000:]
    said = [line for line in output.splitlines() if "CIFAR-10 not found" in line]
    assert len(said) == 1 and said[0].startswith("error: "), f"said {len(said)} times:\n{output[-4000:]}"
    assert "solutions/phase4_production/" not in output, f"a traceback of the trainer:\n{output[-4000:]}"


def _report_at_once(barrier, said, line: str) -> None:
    from solutions.phase4_production.trainer.lifecycle import report_fatal
    sys.stderr = io.StringIO()
    barrier.wait()
    report_fatal(line)
    said.put(sys.stderr.getvalue().count(line))


def test_ranks_meeting_the_same_error_at_once_say_it_once(tmp_path, monkeypatch):
    """Every rank of a node meets a missing dataset in the same millisecond: whichever reads
    the first one's marker must find its whole line there, not a file still being written."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    line = "error: the same line on every rank " + "x" * 4000
    for trial in range(12):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"trial{trial}")
        barrier, said = ctx.Barrier(8), ctx.Queue()
        ranks = [ctx.Process(target=_report_at_once, args=(barrier, said, line)) for _ in range(8)]
        for rank in ranks:
            rank.start()
        counts = [said.get(timeout=60) for _ in ranks]
        for rank in ranks:
            rank.join(timeout=60)
        assert sum(counts) == 1, f"trial {trial}: 8 ranks said the line {sum(counts)} times"


def test_a_preemption_at_an_epoch_end_saves_before_evaluating(tmp_path):
    """The grace period does not wait for a pass over the test set: the stop flag is read
    first, and the skipped evaluation runs when the run resumes."""
    first = launch(tmp_path, "--epochs", "2", faults="rank=0,step=21,phase=forward,action=term")
    assert "preempted at step 22 of 44" in first.stdout, first.stdout + first.stderr[-3000:]
    events = [json.loads(line)["event"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "eval" not in events, f"the preempted run evaluated before leaving: {events}"
    again = launch(tmp_path, "--epochs", "2", "--max-steps", "22")
    assert "resuming at step 22 of 44" in again.stdout and "epoch 0: test accuracy" in again.stdout, \
        again.stdout + again.stderr[-3000:]


def test_the_stop_flag_checked_every_n_steps_stops_at_the_next_check(base, tmp_path):
    """--stop-check-every 4: the signal of step 5 is acted on at step 8, the next check."""
    first = launch(tmp_path, "--stop-check-every", "4", faults="rank=1,step=4,phase=forward,action=term")
    assert first.returncode == 0 and "preempted at step 8 of 22" in first.stdout, first.stdout + first.stderr[-3000:]
    again = launch(tmp_path)
    assert "resuming at step 8 of 22" in again.stdout, again.stdout + again.stderr[-3000:]
    assert fingerprint_of(again.stdout) == reference(base)


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_second_ctrl_c_stops_the_launcher_at_once(base, tmp_path, writer):
    """The first SIGINT asks for a save at the next boundary; a second one, during that save,
    stops everything at once: exit 130, one line, no process left. Written in the training
    thread, the interrupted save never lands; written in the background, it may have landed
    before the kill: either way every checkpoint on disk is complete, and the rerun ends on
    the uninterrupted run's weights."""
    faults = "rank=0,step=4,phase=forward,action=int;rank=0,step=4,phase=save,action=int"
    first = launch(tmp_path, "--async-checkpoint", "on" if writer == "async" else "off", faults=faults)
    assert first.returncode == 130, f"exit code {first.returncode}:\n{first.stdout}\n{first.stderr[-3000:]}"
    assert "interrupted twice" in first.stderr and "Traceback" not in first.stderr, first.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    landed = ["step_000000003.pt"] if writer == "sync" else ["step_000000003.pt", "step_000000005.pt"]
    assert saved in (["step_000000003.pt"], landed), saved
    for path in (tmp_path / "checkpoints").glob("step_*.pt"):
        load_verified(path)  # complete: a CorruptCheckpoint would fail the test
    again = launch(tmp_path)
    resumed = int(saved[-1][5:14])
    assert f"resuming at step {resumed} of 22" in again.stdout, again.stdout + again.stderr[-3000:]
    assert fingerprint_of(again.stdout) == reference(base)


def test_no_worker_outlives_a_sigkilled_torchrun_agent(base, tmp_path):
    """An agent SIGKILLed (OOM killer, a container runtime losing its main process) cannot
    stop its workers, which run in sessions of their own: they must end by themselves,
    without writing, and a relaunch resumes and ends on the uninterrupted run's weights."""
    out = tmp_path / "orphaned"
    with Torchrun(timeout=240, env={**ENV, "COURSE_FAULTS": "rank=0,step=7,phase=forward,action=kill-launcher"},
                  cwd=ROOT) as job:
        agent = job.start(["--standalone", "--nproc-per-node=2", "--max-restarts=0", "-m", MODULE,
                           "--output-dir", str(out), *FLAGS, "--workers", "1"])
        agent.proc.wait(timeout=200)
        gone_by = time.monotonic() + 5.0
        while job.processes() and time.monotonic() < gone_by:  # polled: the deadline is the promise
            time.sleep(0.05)
        left = job.processes()
        assert not left, f"processes {left} of the job outlived its SIGKILLed agent by 5 s:\n{agent.tail()}"
    assert "final weights" not in agent.output, agent.output[-3000:]
    assert max(p.name for p in (out / "checkpoints").glob("step_*.pt")) == "step_000000006.pt", \
        f"an orphaned worker wrote a checkpoint:\n{agent.output[-3000:]}"
    output, code = torchrun(out, restarts=0)
    assert code == 0 and "resuming at step 6 of 22" in output, output[-4000:]
    assert fingerprint_of(output) == reference(base)


def test_trainer_sigterm_saves_at_the_next_step_and_resumes(base):
    out = base / "preempted"
    output, _ = torchrun(out, faults="rank=0,step=6,phase=forward,action=term", restarts=1)
    assert "preempted at step 7 of 22" in output, output[-4000:]
    assert (out / "checkpoints" / "step_000000007.pt").is_file(), sorted((out / "checkpoints").iterdir())
    again = launch(out)  # the same run, restarted (here without torchrun)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at step 7 of 22" in again.stdout, again.stdout
    assert fingerprint_of(again.stdout) == reference(base)


def test_trainer_skips_a_corrupt_checkpoint(base):
    reference(base)
    folder = base / "reference" / "checkpoints"
    newest = max(folder.glob("step_*.pt"))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc = launch(base / "reference")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert newest.name in proc.stderr and "skipping checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert "resuming at step 21 of 22" in proc.stdout, proc.stdout
    assert fingerprint_of(proc.stdout) == reference(base)
    assert (folder / f"{newest.name}.corrupt").is_file(), "the corrupt checkpoint was not kept aside"


def test_trainer_sets_aside_whatever_else_is_named_like_a_checkpoint(base, tmp_path):
    """Folders, links to nothing, files of other formats (and, for a non-root user, files it
    may not read) under a checkpoint's name: one warning each, the newest valid one is used."""
    assert launch(tmp_path, "--max-steps", "6").returncode == 0  # step_3, step_6
    folder = tmp_path / "checkpoints"
    (folder / "step_000000099.pt").mkdir()
    (folder / "step_000000098.pt").symlink_to(tmp_path / "nowhere")
    (folder / "step_000000097.pt").write_text("not a checkpoint\n")
    strays = ["step_000000099.pt", "step_000000098.pt", "step_000000097.pt"]
    if os.geteuid() != 0:  # root may read anything
        (folder / "step_000000096.pt").write_bytes((folder / "step_000000006.pt").read_bytes())
        (folder / "step_000000096.pt").chmod(0)
        strays.append("step_000000096.pt")
    proc = launch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at step 6 of 22" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    for name in strays:
        assert name in proc.stderr, f"nothing said about {name}:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert fingerprint_of(proc.stdout) == reference(base)
    assert (folder / "step_000000099.pt.unusable").is_dir(), sorted(p.name for p in folder.iterdir())


def test_a_loss_that_becomes_nan_stops_the_run_and_is_never_saved(tmp_path):
    proc = launch(tmp_path, "--model", "mlp", "--lr", "100", "--reference-batch", "1", "--checkpoint-every", "1")
    _one_line_error(proc, "became", "at step", "last good state")
    step = int(re.search(r"at step (\d+)", proc.stderr).group(1))
    saved = sorted((tmp_path / "checkpoints").glob("step_*.pt"))
    assert saved and int(saved[-1].stem.split("_")[1]) < step, (step, [p.name for p in saved])
    for path in saved:
        state = load_verified(path)
        assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point()), \
            f"{path.name} holds NaN or infinite weights"


def test_trainer_keeps_its_new_checkpoints_when_every_old_one_is_corrupt(base, tmp_path):
    """keep-last-k must not count corrupt files: they would outrank, and prune, every new save."""
    assert launch(tmp_path, "--max-steps", "12").returncode == 0  # keeps steps 6, 9, 12
    for path in (tmp_path / "checkpoints").glob("step_*.pt"):
        path.write_bytes(path.read_bytes()[:1000])
    second = launch(tmp_path, "--max-steps", "5")
    assert second.returncode == 0 and "starting at step 0 of 22" in second.stdout, second.stdout + second.stderr[-3000:]
    third = launch(tmp_path)
    assert "resuming at step 5 of 22" in third.stdout, third.stdout + third.stderr[-3000:]
    assert fingerprint_of(third.stdout) == reference(base)
    assert len(list((tmp_path / "checkpoints").glob("step_*.pt.corrupt"))) == 3, "a corrupt checkpoint was lost"


# ---------------------------------------------------------------- the output folder on a cluster


def _lease(folder: Path, **record) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".writer").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                "run_id": "another-job", "since": time.time(), **record}))


def test_a_second_trainer_on_a_live_output_dir_is_refused_in_one_line(base, tmp_path):
    short_run(base, tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    _lease(tmp_path)  # a live writer: this very test process
    _one_line_error(launch(tmp_path), "in use by another run", "another-job", "--output-dir")
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == before
    assert json.loads((tmp_path / ".writer").read_text())["run_id"] == "another-job", "the live lease was taken"


def test_a_stale_writer_lease_is_taken_over_with_a_message(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lease(tmp_path / "dead-pid", pid=int(dead.stdout))  # this host, its process gone
    _lease(tmp_path / "silent-host", host="another-node")
    os.utime(tmp_path / "silent-host" / ".writer", (time.time() - 3600, time.time() - 3600))  # no heartbeat for 1 h
    for folder, why in ((tmp_path / "dead-pid", "its process is gone"), (tmp_path / "silent-host", "no heartbeat")):
        proc = launch(folder, "--max-steps", "2")
        assert proc.returncode == 0 and why in proc.stderr and "took over" in proc.stderr, proc.stderr[-3000:]
        assert not (folder / ".writer").exists(), "the lease outlived the run that held it"
    _lease(tmp_path / "live-host", host="another-node")  # another node, heartbeat fresh: alive
    _one_line_error(launch(tmp_path / "live-host"), "in use by another run", "another-node")


def test_an_output_dir_that_one_node_cannot_see_is_reported_in_one_line(tmp_path):
    """Two torchrun agents (two "nodes" on this host) whose relative --output-dir resolves
    to different folders, as a path off the shared file system would on one node."""
    port, outputs = free_port(), []
    for node in range(2):
        (tmp_path / f"node{node}").mkdir()
    with contextlib.ExitStack() as stack:
        jobs = [stack.enter_context(Torchrun(timeout=120, env=ENV, cwd=tmp_path / f"node{node}")) for node in range(2)]
        for job in jobs:
            job.start(multi_node_args(2, 1, port, "not-shared") + ["-m", MODULE, "--output-dir", "run", *FLAGS])
        for job in jobs:
            with contextlib.suppress(TorchrunError):
                job.wait()
            outputs.append(job.agents[0].output)
    errors = [line for text in outputs for line in text.splitlines() if line.startswith("error:")]
    assert errors and all("is not shared by every node" in line for line in errors), "\n".join(outputs)[-4000:]
    assert not list((tmp_path / "node0").glob("run/checkpoints/*")) + list((tmp_path / "node1").glob("run/checkpoints/*"))


def test_changed_hyperparameters_on_resume_are_refused_or_applied_as_asked(base, tmp_path):
    short_run(base, tmp_path)
    refused = launch(tmp_path, "--lr", "0.05", "--weight-decay", "0.001")
    _one_line_error(refused, "--lr 0.02 -> 0.05", "--weight-decay 0.0005 -> 0.001", "--apply-changes")
    _one_line_error(launch(tmp_path, "--optimizer", "adamw", "--apply-changes"), "--optimizer", "cannot change")
    applied = launch(tmp_path, "--lr", "0.05", "--weight-decay", "0.001", "--epochs", "2", "--apply-changes",
                     "--max-steps", "5", "--log-every", "5")
    assert applied.returncode == 0 and "applying changed hyperparameters at step 3" in applied.stdout, \
        applied.stdout + applied.stderr[-3000:]
    state = load_verified(tmp_path / "checkpoints" / "step_000000005.pt")
    groups = state["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 0.001 and groups[0]["initial_lr"] == pytest.approx(0.05), groups[0]
    assert state["progress"]["config"]["lr"] == 0.05, "the checkpoint does not record the config it was trained with"
    assert len(list((tmp_path / "configs").glob("*.json"))) == 2, "one config file per start that ran (refused: none)"


def test_evaluate_only_and_init_from(tmp_path):
    """--evaluate reads the newest checkpoint and writes nothing; --init-from starts a new run
    from a checkpoint's (or a state_dict's) weights: the same weights, the same accuracy."""
    assert launch(tmp_path / "a", "--max-steps", "6").returncode == 0
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "a").rglob("*"))
    first = launch(tmp_path / "a", "--evaluate")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "a").rglob("*")) == before, \
        "--evaluate wrote in the output folder"
    found = re.search(r"^evaluated \S+step_000000006.pt \(step 6 of 22\) on 2 ranks: test accuracy (\S+)%", first.stdout,
                      re.M)
    assert found, first.stdout
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000000006.pt"
    torch.save(load_verified(checkpoint)["model"], tmp_path / "weights.pt")  # a plain state_dict, as torchvision's
    for source in (checkpoint, tmp_path / "weights.pt"):
        other = launch(tmp_path / "b", "--init-from", str(source), "--evaluate")
        assert f"test accuracy {found.group(1)}%" in other.stdout, other.stdout + other.stderr[-2000:]
        assert fingerprint_of(other.stdout.replace("weights sha256", "final weights sha256")) == \
            fingerprint_of(first.stdout.replace("weights sha256", "final weights sha256"))
    _one_line_error(launch(tmp_path / "c", "--init-from", str(tmp_path / "weights.pt"), "--model", "mlp"),
                    "--init-from", "does not fit")
    _one_line_error(launch(tmp_path / "c", "--sync-bn"), "--sync-bn", "GPUs only")


def test_trainer_resumes_at_another_world_size(tmp_path):
    """3 ranks share the global batch of 64 as 22 + 21 + 21 samples (each loss weighted by its
    share), then the run goes on alone from the same data position."""
    first = launch(tmp_path, "--max-steps", "4", nproc=3)
    assert first.returncode == 0 and "stopped at step 4 of 22" in first.stdout, first.stdout + first.stderr[-2000:]
    assert "rank 0 of 3 on cpu, attempt 0: starting at step 0 of 22 (22 or 21 samples per rank" in first.stdout, \
        first.stdout
    second = launch(tmp_path, nproc=1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "rank 0 of 1 on cpu, attempt 0: resuming at step 4 of 22" in second.stdout, second.stdout
    assert "after 1 epochs on 1 ranks" in second.stdout, second.stdout


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_trainer_mixed_precision_on_cpu_resumes_to_the_same_weights(base, tmp_path, amp):
    """bf16 autocast (CPU's mixed precision), and fp16 with a GradScaler (the path of GPUs
    without bf16): a run stopped and resumed ends with the weights of one never stopped."""
    whole = launch(tmp_path / "whole", "--amp", amp, "--max-steps", "9")
    assert whole.returncode == 0, whole.stderr[-3000:]
    part = launch(tmp_path / "part", "--amp", amp, "--max-steps", "3")
    assert part.returncode == 0, part.stderr[-3000:]
    assert fingerprint_of(part.stdout) != short_run_fingerprint(base), f"--amp {amp} trained in float32"
    rest = launch(tmp_path / "part", "--amp", amp, "--max-steps", "9")
    assert "resuming at step 3 of 22" in rest.stdout, rest.stdout + rest.stderr[-3000:]
    assert fingerprint_of(rest.stdout) == fingerprint_of(whole.stdout), f"--amp {amp}: the resumed run differs"
    if amp == "fp16":
        state = load_verified(max((tmp_path / "part" / "checkpoints").glob("step_*.pt")))
        assert state["scaler"] and state["scaler"]["scale"] > 0, f"the loss scaler is not checkpointed: {state['scaler']}"


def _fp16_steps_around_an_overflow() -> list[bool]:
    """On a 1-rank world: 6 fp16 steps of a Linear under 4.4's top-k hook (compressing from
    step 2); the loss scale is forced so high before step 3 that its gradients overflow,
    then set back to 1. Returns, per step, whether the weights moved and stayed finite."""
    from solutions.phase4_production.compression import TopKState, topk_hook
    from solutions.phase4_production.elastic import plan_batches
    from solutions.phase4_production.monitoring import StepTimer
    from solutions.phase4_production.recovery import FaultInjector
    from solutions.phase4_production.trainer.parallel import DDPStrategy
    from solutions.phase4_production.trainer.step import StepParts, train_step

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    strategy = DDPStrategy(torch.device("cpu")).wrap(model, comm_hook=True)  # DDP on one rank: it holds the hook
    ddp = strategy.net
    state = TopKState(ratio=0.5, start_iter=2)
    ddp.register_comm_hook(state, topk_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    parts = StepParts(ddp, strategy, plan_batches(4, 1, 4), 0, torch.nn.CrossEntropyLoss(),
                      torch.optim.SGD(model.parameters(), lr=0.1), scaler, torch.float16, torch.device("cpu"),
                      compression=state)
    batch = (torch.randn(4, 8), torch.arange(4))
    moved = []
    for step in range(6):
        if step in (3, 4):
            scaler.update(2.0 ** 40 if step == 3 else 1.0)
        before = model.weight.detach().clone()
        timer = StepTimer()
        timer.start()
        train_step(parts, batch, timer, FaultInjector())
        moved.append(not torch.equal(before, model.weight) and bool(model.weight.isfinite().all()))
    return moved


def test_an_fp16_step_the_scaler_skips_does_not_poison_compression():
    """The skipped step's inf reaches the hook's error memory; kept there, it makes every
    later gradient inf and the scaler skips every step from then on (training stalls)."""
    moved = run_world(_fp16_steps_around_an_overflow, 1)[0]
    assert moved == [True, True, True, False, True, True], \
        f"weights updated per step: {moved} (step 3 overflows and must be skipped; the steps after it must train)"


def test_dgc_before_compression_starts_trains_bit_for_bit_like_momentum_sgd(base, tmp_path):
    """--compression dgc moves SGD's nesterov momentum and weight decay from the optimizer into
    the comm hook (4.4, DGC's momentum correction); before --compression-start the hook
    all-reduces and applies them per parameter, so the run is the plain run, bit for bit.
    Momentum left on in the optimizer too (applied twice), or the decay in both, changes
    every step."""
    proc = launch(tmp_path, "--compression", "dgc", "--compression-start", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fingerprint_of(proc.stdout) == reference(base), \
        "--compression dgc without a compressed step trained other weights than plain DDP + SGD(nesterov)"


def test_topk_warmup_lowers_the_fraction_sent_exponentially_from_the_compression_start():
    """DGC's sparsity warm-up as the trainer sets it: a function of the run's step (so a
    resumed run continues it), 0.25 at --compression-start, --topk-ratio after --topk-warmup steps."""
    from solutions.phase4_production.compression import TopKState
    from solutions.phase4_production.trainer.comm import set_sparsity

    cfg = parse_config(["--compression", "dgc", "--topk-ratio", "0.01", "--topk-warmup", "10",
                        "--compression-start", "10"], check_paths=False)
    state = TopKState(ratio=0.01)
    seen = []
    for step in (10, 15, 19, 20, 40):
        set_sparsity(state, cfg.parallel, step)
        seen.append(state.ratio)
    expected = [0.25, 0.05, 0.25 * (0.01 / 0.25) ** 0.9, 0.01, 0.01]
    assert seen == pytest.approx(expected), f"fraction sent at steps 10, 15, 19, 20, 40: {seen}, expected {expected}"


def test_a_slow_rank_in_a_ddp_run_is_named_with_the_phase_it_lost_time_in(tmp_path):
    """DDP all-reduces inside backward: the fast ranks wait there for the slow one, so every
    rank's step takes as long. Only the time before a rank's last gradient is ready tells
    them apart."""
    proc = launch(tmp_path, "--global-batch", "63", "--max-steps", "10", "--straggler-every", "5",
                  nproc=3, faults="rank=2,step=*,phase=data,action=slow,ms=60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    named = [(s["rank"], s["phase"]) for e in events if e["event"] == "straggler" for s in e["stragglers"]]
    assert named == [(2, "data"), (2, "data")], f"stragglers named: {named}"
    assert "straggler at step 5: rank 2" in proc.stdout, proc.stdout[-2000:]


def test_trainer_writes_metrics_traces_and_plain_progress_lines_to_a_log_file(tmp_path):
    """Not a terminal (SLURM's slurm-*.out, a pod's log): a line every --log-every steps,
    never tqdm's carriage returns."""
    proc = launch(tmp_path, "--profile-steps", "2", "--log-every", "5", "--progress", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^step (\d+)/22: loss [0-9.]+, lr [0-9.e-]+, \d+ images/s per rank \(\d+ in all\), "
                       r"loader \d+% of the step, eta \S+$",
                       proc.stdout, re.M)
    assert lines == ["5", "10", "15", "20"], f"expected a plain line every 5 steps:\n{proc.stdout[-2000:]}"
    assert "\r" not in proc.stdout + proc.stderr, "carriage returns in a log file"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_event: dict = {}
    for record in records:
        by_event.setdefault(record.get("event"), []).append(record)
    assert [r["step"] for r in by_event.get("train", [])] == [5, 10, 15, 20], by_event.get("train")
    for key in ("loss", "lr", "data_s", "forward_s", "backward_s", "optimizer_s", "step_s", "samples_per_s",
                "peak_rss_bytes"):
        assert all(isinstance(r.get(key), (int, float)) for r in by_event["train"]), f"train lines lack {key}"
    assert [r["step"] for r in by_event.get("eval", [])] == [STEPS] and 0 <= by_event["eval"][0]["accuracy"] <= 1
    assert by_event["eval"][0]["accuracy"] <= by_event["eval"][0]["top5"] <= 1, by_event["eval"]
    assert all(r.get("attempt") == 0 for r in records), "a record without its attempt"
    saves = by_event.get("checkpoint", [])
    assert [r["step"] for r in saves] == [3, 6, 9, 12, 15, 18, 21, 22], saves
    assert all(r["seconds"] > 0 and r["write_seconds"] > 0 and r["bytes"] > 1000 for r in saves), saves
    assert len(by_event.get("summary", [])) == 1 and by_event["summary"][0]["images_per_s"] > 0
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert [name.split(".")[0] for name in traces] == ["rank0", "rank1"] and all(n.endswith(".json") for n in traces), \
        f"expected one trace per rank: {traces}"


# ---------------------------------------------------------------- bad input: one line, exit 2


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr and len(lines) == 1, f"expected one line:\n{proc.stderr[-3000:]}"
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("flags, needles", [
    (["--model", "resnet9000"], ["--model", "invalid choice"]),
    (["--epochs", "0"], ["--epochs must be >= 1"]),
    (["--seed", "-1"], ["--seed must be in [0, 2**32)"]),
    (["--config", "no_such_recipe.toml"], ["no_such_recipe.toml", "digits_cpu.toml"]),
    (["--fail-at-step", "3"], ["torchrun", "--max-restarts"]),
    (["--compression", "dgc", "--optimizer", "adamw"], ["--compression dgc", "--optimizer adamw"]),
    (["--compression", "dgc", "--grad-clip", "1"], ["--grad-clip", "--compression dgc"]),
])
def test_trainer_rejects_bad_flags_in_one_line(capsys, monkeypatch, flags, needles):
    from solutions.phase4_production.trainer.cli import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(flags)  # fails before any rank starts
    _one_line_error(subprocess.CompletedProcess([], exit_.value.code, "", capsys.readouterr().err), *needles)


# At least one bad value for every option of --help: ranges (NaN and infinity included),
# choices, booleans, kinds of path. "FILE" stands for an existing regular file.
BAD_VALUES = {
    "config": ["no_such_recipe.toml"], "dataset": ["mnist"], "data_root": ["/no/such/folder", "FILE"],
    "image_size": ["4", "abc"], "synthetic_size": ["0"], "workers": ["-1"], "model": ["resnet9000"],
    "channels_last": ["maybe"], "compile": ["maybe"], "epochs": ["0", "1.5"], "global_batch": ["0"],
    "micro_batch": ["0"], "optimizer": ["adam"], "lr": ["inf", "nan", "0", "-0.1"], "reference_batch": ["0"],
    "momentum": ["1.0", "nan"], "weight_decay": ["-0.1", "inf"], "warmup_epochs": ["nan", "-1"],
    "label_smoothing": ["1.5", "-0.1"], "grad_clip": ["-1", "inf"], "amp": ["fp8"], "compression": ["zip"],
    "compression_rank": ["0"], "topk_ratio": ["0", "1.5"], "compression_start": ["-1"], "topk_warmup": ["-1"],
    "seed": ["-1", "4294967296"], "deterministic": ["maybe"], "output_dir": ["FILE", "FILE/below"],
    "checkpoint_every": ["0"], "keep": ["0"], "async_checkpoint": ["maybe"], "fail_at_step": ["-1"], "fail_rank": ["-1"], "log_every": ["0"],
    "straggler_every": ["0"], "straggler_threshold": ["0", "nan"], "profile_steps": ["-1"],
    "tensorboard": ["maybe"], "progress": ["maybe"], "max_steps": ["0"], "device": ["tpu"], "nproc": ["0"],
    "timeout": ["0", "nan", "inf"], "apply_changes": ["maybe"], "pg_timeout": ["0", "nan"],
    "pg_init_timeout": ["-1", "inf"], "loader_timeout": ["0", "nan"], "evaluate": ["maybe"], "sync_bn": ["maybe"],
    "init_from": ["/no/such/file", "FILE/below"], "stop_check_every": ["0"], "parallel": ["zero3"],
    "reshard_after_forward": ["maybe"], "cpu_offload": ["maybe"], "export": ["FILE/below", "/no/such/folder/w.pt"],
    "decode": ["gpu"], "train_crop_size": ["4", "abc", "176"], "val_resize_size": ["0", "232"],
    "val_crop_size": ["-1", "224"], "auto_augment": ["autoaugment"], "random_erase": ["1.5", "nan"],
    "mixup_alpha": ["-0.1", "inf"], "cutmix_alpha": ["nan"], "ra_reps": ["0", "65"], "model_ema": ["maybe"],
    "model_ema_steps": ["0"], "model_ema_decay": ["1.5", "nan"], "norm_weight_decay": ["-1"],
    "bias_weight_decay": ["inf"], "transformer_embedding_decay": ["nan", "2"], "benchmark_loader": ["0"],
}


def test_every_option_refuses_a_bad_value_in_one_line(tmp_path, capsys):
    options = {action.dest for action in build_parser()._actions if action.option_strings and action.dest != "help"}
    assert options == set(BAD_VALUES), f"options without a bad value here: {sorted(options - set(BAD_VALUES))}"
    regular = tmp_path / "a_file"
    regular.write_text("x")
    for name, values in BAD_VALUES.items():
        flag = "--" + name.replace("_", "-")
        for value in values:
            value = value.replace("FILE", str(regular))
            with pytest.raises(SystemExit) as exit_:
                parse_config([flag, value])
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.strip()]
            assert exit_.value.code == 2 and len(lines) == 1 and flag in lines[0], \
                f"{flag} {value}: exit {exit_.value.code}, expected one line naming {flag}:\n{err}"
    recipe = tmp_path / "nan.toml"
    recipe.write_text("lr = nan\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(recipe)])
    assert "--lr" in capsys.readouterr().err, "a recipe's value is not checked like the flag's"


def test_device_refuses_fewer_gpus_than_local_ranks(monkeypatch):
    from solutions.phase4_production.trainer.cli import choose_training_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    with pytest.raises(ValueError, match="2 ranks on this node but 1 GPU"):
        choose_training_device("auto", 2)
    choose_training_device("auto", 1)
    choose_training_device("cpu", 2)
    assert os.environ.get("COURSE_BACKEND") == "gloo", "--device cpu must pin gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no GPU is visible"):
        choose_training_device("cuda", 1)
    choose_training_device("auto", 2)  # a CPU-only node: gloo, as on a laptop


def test_trainer_rejects_a_bad_recipe_key(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('model = "cnn"\nlearning_rate = 0.1\n')
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--config", str(recipe)])
    _one_line_error(subprocess.CompletedProcess([], exit_.value.code, "", capsys.readouterr().err), "learning_rate")


def test_trainer_reports_a_missing_dataset_in_one_line(tmp_path):
    _one_line_error(launch(tmp_path, "--dataset", "cifar10", "--data-root", str(tmp_path / "nowhere")),
                    "--data-root", "is not a folder", "data/README.md")
    (tmp_path / "empty").mkdir()
    _one_line_error(launch(tmp_path, "--dataset", "cifar10", "--data-root", str(tmp_path / "empty")),
                    "CIFAR-10 not found", "data/README.md")


def test_trainer_rejects_more_ranks_than_the_global_batch_has_samples(tmp_path):
    _one_line_error(launch(tmp_path, "--global-batch", "2", nproc=3), "3 ranks cannot share a global batch of 2",
                    "--global-batch")


def test_weight_decay_groups_that_change_mid_run_are_refused_in_one_line(base, tmp_path):
    """The optimizer holds one param group per weight decay: with the defaults the two of
    earlier versions (more than one dimension: --weight-decay; the rest: none), so their
    checkpoints resume; a run resumed with a new --norm-weight-decay would need three, and
    is refused in one line that names the way out."""
    short_run(base, tmp_path)
    path = tmp_path / "checkpoints" / "step_000000003.pt"
    groups = load_verified(path)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0], groups
    _one_line_error(launch(tmp_path, "--norm-weight-decay", "0.01", "--apply-changes"), "other parameter groups",
                    "--norm-weight-decay", "--init-from")
    assert launch(tmp_path / "fresh", "--init-from", str(path), "--max-steps", "1").returncode == 0


def test_trainer_refuses_checkpoints_of_another_model_and_keeps_them(tmp_path):
    first = launch(tmp_path, "--model", "mlp", "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    _one_line_error(launch(tmp_path), "not of this run", "--output-dir")
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    assert after == before, "a refused run changed the checkpoints it refused"


# ---------------------------------------------------------------- regularisers, input pipeline

# Every regulariser on: MixUp and CutMix, RandAugment, random erasing, repeated augmentation,
# the EMA of the weights (updated every 2 steps), label smoothing; loader workers.
ALL_REGULARISERS = ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", "ra", "--random-erase", "0.25",
                    "--ra-reps", "2", "--model-ema", "--model-ema-steps", "2", "--label-smoothing", "0.1",
                    "--workers", "1"]
EMA_LINE = re.compile(r"^EMA weights \(--model-ema\): test accuracy \d+\.\d+%.*$", re.M)


def regularised_reference(base: Path) -> str:
    """The uninterrupted run with every regulariser on (its output)."""
    def make():
        proc = launch(base / "regularised", *ALL_REGULARISERS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout
    return cached(f"regularised in {base}", make)


def test_a_run_with_every_regulariser_on_resumes_bit_identically(base, tmp_path):
    """Every random draw (MixUp/CutMix choice, lambda and box; RandAugment's ops; the erasing
    boxes; the repeated copies' augmentation) is a function of (seed, epoch, step or sample):
    stopped at step 8 and resumed, the run ends on the same weights and the same EMA."""
    whole = regularised_reference(base)
    assert fingerprint_of(whole) != reference(base), "the regularisers changed nothing"
    first = launch(tmp_path, *ALL_REGULARISERS, "--max-steps", "8")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = launch(tmp_path, *ALL_REGULARISERS)
    assert "resuming at step 8 of 22" in rest.stdout, rest.stdout + rest.stderr[-3000:]
    assert fingerprint_of(rest.stdout) == fingerprint_of(whole), "the resumed run trained on other data"
    assert EMA_LINE.search(whole) and EMA_LINE.search(rest.stdout).group(0) == EMA_LINE.search(whole).group(0), \
        "the EMA was not resumed with the run"
    records = [json.loads(line) for line in (base / "regularised" / "metrics.jsonl").read_text().splitlines()]
    ema = [r for r in records if r["event"] == "eval_ema"]
    assert [r["step"] for r in ema] == [STEPS] and 0 <= ema[0]["accuracy"] <= 1, ema
    assert "epoch 0: EMA test accuracy" in whole, whole[-2000:]
    evaluated = launch(base / "regularised", *ALL_REGULARISERS, "--evaluate")
    assert EMA_LINE.search(evaluated.stdout) and \
        EMA_LINE.search(evaluated.stdout).group(0) == EMA_LINE.search(whole).group(0), \
        "--evaluate did not evaluate the checkpoint's EMA as the run did:\n" + evaluated.stdout + evaluated.stderr[-2000:]


def test_a_regularised_run_resumes_at_another_world_size(base, tmp_path):
    """Batch mixing pairs each sample with its predecessor in the global batch, whatever the
    shares: 2 ranks, then 3, then 1, the run finishes (and the mixed pairs stay the same)."""
    for nproc, steps in ((2, "5"), (3, "10")):
        proc = launch(tmp_path, *ALL_REGULARISERS, "--max-steps", steps, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
    last = launch(tmp_path, *ALL_REGULARISERS, nproc=1)
    assert "rank 0 of 1 on cpu, attempt 0: resuming at step 10 of 22" in last.stdout, last.stdout + last.stderr[-2000:]
    assert EMA_LINE.search(last.stdout), last.stdout


def test_imagenet_with_uint8_workers_and_regularisers_resumes_bit_identically(tmp_path):
    """ImageNet layout (JPEG files), --decode tensor and pil, loader workers: a run stopped
    after 3 steps and resumed ends on the weights of one never stopped (CPU)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer_pipeline import _folder

    root = _folder(tmp_path / "data", n=4)
    flags = ["--dataset", "imagenet", "--data-root", str(root), "--model", "resnet18", "--image-size", "32",
             "--train-crop-size", "24", "--val-resize-size", "40", "--global-batch", "4", "--epochs", "2",
             "--workers", "2", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--auto-augment", "ta_wide",
             "--random-erase", "0.5", "--model-ema", "--model-ema-steps", "1"]
    for decode in ("tensor", "pil"):
        whole = launch(tmp_path / f"whole-{decode}", *flags, "--decode", decode)
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert launch(tmp_path / f"part-{decode}", *flags, "--decode", decode, "--max-steps", "3").returncode == 0
        rest = launch(tmp_path / f"part-{decode}", *flags, "--decode", decode)
        assert "resuming at step 3 of 4" in rest.stdout, rest.stdout + rest.stderr[-3000:]
        assert fingerprint_of(rest.stdout) == fingerprint_of(whole.stdout), f"--decode {decode}: the resumed run differs"


def test_benchmark_loader_runs_only_the_input_pipeline(tmp_path):
    proc = launch(tmp_path / "bench", "--benchmark-loader", "4", "--workers", "1", *ALL_REGULARISERS[:8])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^loader: \d+ images/s on rank 0 \(\d+ in all on 2 ranks\), 4 steps of 33 images per rank",
                     proc.stdout, re.M), proc.stdout
    assert not (tmp_path / "bench").exists(), "--benchmark-loader wrote in the output folder"


@pytest.mark.parametrize("flags, needles", [
    (["--decode", "cuda", "--dataset", "imagenet", "--data-root", "/tmp", "--device", "cpu"],
     ["--decode cuda", "--decode tensor"]),
    (["--train-crop-size", "24"], ["--train-crop-size", "--dataset imagenet"]),
    (["--dataset", "imagenet", "--data-root", "/tmp", "--model", "vit_b_16", "--val-crop-size", "192"],
     ["--val-crop-size 192", "--image-size"]),
    (["--ra-reps", "65"], ["--ra-reps 65", "--global-batch"]),
    (["--benchmark-loader", "3", "--evaluate"], ["--evaluate", "--benchmark-loader"]),
])
def test_input_options_that_cannot_apply_are_refused_in_one_line(capsys, monkeypatch, tmp_path, flags, needles):
    from solutions.phase4_production.trainer.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--output-dir", str(tmp_path / "out")])
    _one_line_error(subprocess.CompletedProcess([], exit_.value.code, "", capsys.readouterr().err), *needles)


# ---------------------------------------------------------------- real data formats, worker processes


def _tiny_data(root: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_common_data as data_tests  # the tiny real-format writers of the data tests

    (root / "cifar").mkdir(parents=True)
    data_tests._write_cifar(root / "cifar", per_batch=20)
    (root / "folder").mkdir()
    data_tests._write_image_folder(root / "folder")


@pytest.mark.parametrize("dataset, extra", [
    ("cifar10", ["--global-batch", "16", "--workers", "2"]),
    ("imagenet", ["--global-batch", "2", "--image-size", "32", "--workers", "1"]),
])
def test_trainer_reads_real_formats_with_worker_processes(tmp_path, dataset, extra):
    _tiny_data(tmp_path / "data")
    root = tmp_path / "data" / ("cifar" if dataset == "cifar10" else "folder")
    proc = launch(tmp_path / "run", "--dataset", dataset, "--data-root", str(root), "--model", "resnet18",
                  "--max-steps", "2", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"test accuracy \d+\.\d+% after \d+ epochs on 2 ranks", proc.stdout), proc.stdout
    fingerprint_of(proc.stdout)


# ---------------------------------------------------------------- the data pipeline


class _RandomCrop(torch.utils.data.Dataset):
    """Stands in for a dataset with random augmentation: item i draws from torch's global RNG."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(4) + index


def test_seeded_samples_depend_on_seed_epoch_and_index_only(monkeypatch):
    reseeded = []  # torch.manual_seed would also seed every GPU: slow per sample, and it resets their streams
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    samples = SeededSamples(_RandomCrop(), seed=3)
    torch.default_generator.manual_seed(1)
    before = torch.get_rng_state()
    first = samples[(0, 5)]
    assert torch.equal(torch.get_rng_state(), before), "loading a sample moved the caller's RNG stream"
    torch.default_generator.manual_seed(2)
    assert torch.equal(samples[(0, 5)], first), "the same (epoch, index) gave another augmentation"
    assert not torch.equal(samples[(1, 5)], first) and not torch.equal(samples[(0, 6)] - 1, first)
    assert not torch.equal(SeededSamples(_RandomCrop(), seed=4)[(0, 5)], first)
    assert reseeded == [], "a sample reseeded the GPU generators"
    SeededSamples(_RandomCrop(), seed=2**32 - 1)[(10**4, 10**9)]  # the largest seed: no overflow


# ---------------------------------------------------------------- configuration


def test_help_lists_every_option_with_its_default():
    text = build_parser().format_help()
    for name, (_, f) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, f"--help does not list {flag}"
        assert f"(default: {f.default})" in " ".join(text.split()), f"--help does not give the default of {flag}"


def test_every_shipped_recipe_loads_and_flags_override_it():
    recipes = sorted(RECIPES.glob("*.toml"))
    assert len(recipes) >= 5, recipes
    for recipe in recipes:
        TrainConfig.from_flat(load_recipe(recipe)).validate()
    config = parse_config(["--config", "imagenet_resnet50_8gpu.toml", "--epochs", "2", "--data-root", "/x"],
                          check_paths=False)
    assert (config.optim.epochs, config.data.data_root, config.model.name, config.data.global_batch) == \
        (2, "/x", "resnet50", 1024)
    assert parse_config([]) == TrainConfig.from_flat(load_recipe("digits_cpu.toml")), \
        "digits_cpu.toml documents the defaults: keep them equal"


def test_a_recipe_takes_sections_and_flat_keys_alike(tmp_path):
    """A [section] table of fields, the flat keys of earlier recipes, or both: the same config;
    a key in the wrong table, or one option set twice, is one line."""
    sections = tmp_path / "sections.toml"
    sections.write_text('[model]\nname = "cnn"\n\n[optim]\nlr = 0.05\nepochs = 2\n\n[parallel]\nlayout = "fsdp"\n')
    flat = tmp_path / "flat.toml"
    flat.write_text('model = "cnn"\nlr = 0.05\nepochs = 2\nparallel = "fsdp"\n')
    mixed = tmp_path / "mixed.toml"
    mixed.write_text('model = "cnn"\nparallel = "fsdp"\n\n[optim]\nlr = 0.05\nepochs = 2\n')
    configs = [parse_config(["--config", str(p)], check_paths=False) for p in (sections, flat, mixed)]
    assert configs[0] == configs[1] == configs[2], configs
    assert (configs[0].model.name, configs[0].optim.lr, configs[0].parallel.layout) == ("cnn", 0.05, "fsdp")
    assert configs[0].flat()["model"] == "cnn" and configs[0].by_section()["optim"]["lr"] == 0.05
    for text, needle in (('[data]\nlr = 0.1\n', "belongs in [optim]"),
                         ('lr = 0.1\n[optim]\nlr = 0.2\n', "set already")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_recipe(bad)
