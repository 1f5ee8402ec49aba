"""The world launcher keeps its promises: results back, errors named, deadlocks reported, nothing left behind."""

from __future__ import annotations

import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import common.launch
import common.launch
from common.launch import WorldError, WorldTimeout, run_world


def _rank_info(offset: int):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def test_results_come_back_in_rank_order():
    results = run_world(_rank_info, 3, args=(10,))
    assert [r[:3] for r in results] == [(r, 3, 33.0) for r in range(3)]
    assert all(r[3] == "1" and r[4] == 1 for r in results), f"each rank must run single-threaded: {results}"


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("the thing rank one looked for")
    dist.barrier()  # rank 0 waits for rank 1, which is gone


def test_a_raising_rank_fails_the_world_with_its_traceback():
    with pytest.raises(WorldError) as info:
        run_world(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 raised KeyError"), message
    assert "_raise_on_rank_one" in message and "the thing rank one looked for" in message
    assert not isinstance(info.value, WorldTimeout), "a raising rank must not be reported as a timeout"


class _WhoLoads(Dataset):
    """Item i is (i, pid of the process that loaded it): shows which worker ran."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor(i), torch.tensor(os.getpid())


def _shard_loader():
    indices = list(range(dist.get_rank(), 16, dist.get_world_size()))
    return DataLoader(torch.utils.data.Subset(_WhoLoads(), indices), batch_size=2, num_workers=2)


def _load_with_workers():
    items, pids = [], set()
    for values, loaded_by in _shard_loader():
        items += values.tolist()
        pids.update(loaded_by.tolist())
    return items, sorted(pids), os.getpid()


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its new parent, is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _gone_soon(pids, within_s: float = 10.0) -> list[int]:
    """The pids still alive after `within_s` (a killed process needs a moment to be reaped)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_a_rank_can_use_a_loader_with_worker_processes():
    results = run_world(_load_with_workers, 2, timeout=120)
    for rank, (items, worker_pids, rank_pid) in enumerate(results):
        assert items == list(range(rank, 16, 2)), f"rank {rank} loaded {items}"
        assert len(worker_pids) == 2 and rank_pid not in worker_pids, f"rank {rank}: loaded by {worker_pids}"
    left = _gone_soon([pid for _, worker_pids, _ in results for pid in worker_pids])
    assert not left, f"loader workers {left} outlived the world"


def _deadlock(pid_dir: str):
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    buffer = torch.zeros(4)
    dist.recv(buffer, src=1 - dist.get_rank())  # both ranks receive first: nobody sends


def test_a_deadlock_reports_every_rank_and_leaves_no_process(tmp_path):
    with pytest.raises(WorldTimeout) as info:
        run_world(_deadlock, 2, args=(str(tmp_path),), timeout=8)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank}: " in message and "test_launch.py:" in message and "in _deadlock" in message, message
    assert "recv" in message, message
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not _gone_soon(pids), "a rank outlived the world"


_DUMP = """Current thread 0x00007f41b31ccb80 (most recent call first):
  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 3433 in recv
  File "/repo/tests/phase3/test_x.py", line 253 in wait
  File "/repo/phase3_multi_node/parameter_server.py", line 175 in serve
  File "/repo/tests/phase3/test_x.py", line 311 in _scenario
  File "/repo/common/launch.py", line 496 in _rank_main
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
""".replace("/repo/common/launch.py", common.launch.__file__)


def test_a_stuck_frame_is_the_codes_own_frame_past_the_harness():
    """The line named is the innermost one outside torch; with a harness predicate (a test's wrapper around
    a torch call, its scenario), the code's own, unless the harness is all there is."""
    describe = common.launch.describe_stuck_frame
    assert describe(_DUMP) == "/repo/tests/phase3/test_x.py:253 in wait (waiting inside distributed_c10d.py:recv)"
    in_tests = lambda filename: "/tests/" in filename  # noqa: E731
    assert describe(_DUMP, in_tests) == \
        "/repo/phase3_multi_node/parameter_server.py:175 in serve (waiting inside distributed_c10d.py:recv)"
    assert describe(_DUMP, lambda filename: "/repo/" in filename and "launch" not in filename) == \
        "/repo/tests/phase3/test_x.py:253 in wait (waiting inside distributed_c10d.py:recv)"


def test_a_world_waiting_for_its_deadline_says_it_is_alive(tmp_path, monkeypatch):
    """A learner watching a deadlocked test is told, every HEARTBEAT_S, that the run is alive
    and when the deadline will say where each rank waits."""
    lines: list[str] = []
    monkeypatch.setattr(common.launch, "heartbeat", lines.append)
    monkeypatch.setattr(common.launch, "HEARTBEAT_S", 1.0)
    with pytest.raises(WorldTimeout):
        run_world(_deadlock, 2, args=(str(tmp_path),), timeout=4)
    assert lines and all("ranks [0, 1] still running" in line and "deadline" in line for line in lines), lines


def _loading_when_peer_raises(pid_dir: str):
    """Rank 1 holds a loader with two live workers and blocks; then rank 0 raises."""
    if dist.get_rank() == 1:
        batches = iter(_shard_loader())
        workers = {int(next(batches)[1][0]), int(next(batches)[1][0])}  # both workers are up, and stay up
        Path(pid_dir, "pids").write_text(" ".join(map(str, [os.getpid(), *workers])))
        dist.barrier()
        dist.recv(torch.zeros(1), src=0)  # never sent: the parent must kill this rank, and its workers
    dist.barrier()
    raise ValueError("rank 0 gives up")


def test_a_failing_world_leaves_no_rank_and_no_loader_worker_behind(tmp_path):
    with pytest.raises(WorldError, match="rank 0 gives up"):
        run_world(_loading_when_peer_raises, 2, args=(str(tmp_path),), timeout=120)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3, f"rank 1 and its two loader workers: {pids}"
    assert not _gone_soon(pids), "rank 1 or one of its loader workers outlived the world"


def test_a_world_too_slow_to_start_is_not_called_a_deadlock(monkeypatch):
    monkeypatch.setattr(common.launch, "START_TIMEOUT_S", 0.0)  # no rank can have joined the group yet
    with pytest.raises(WorldTimeout) as info:
        run_world(_rank_info, 2, args=(0,), timeout=60)
    assert info.value.not_started == (0, 1), str(info.value)
    first_line = str(info.value).splitlines()[0]
    assert "did not start within" in first_line and "deadlock" not in first_line, first_line


def _deliver_then_abort():
    # Runs when the rank leaves, after its result was delivered: a crash in teardown.
    multiprocessing.util.Finalize(None, os.abort, exitpriority=100)
    t = torch.ones(3)
    dist.all_reduce(t)
    return t.tolist()


def test_a_rank_that_crashes_after_delivering_its_result_does_not_fail_the_world():
    with pytest.warns(RuntimeWarning, match=r"rank \d delivered its result, then was killed by signal 6"):
        results = run_world(_deliver_then_abort, 2, timeout=120)
    assert results == [[2.0, 2.0, 2.0]] * 2


def _die_without_reporting():
    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()


def test_a_rank_that_dies_before_reporting_is_named_with_the_signal():
    with pytest.raises(WorldError) as info:
        run_world(_die_without_reporting, 2, timeout=120)
    cause = min(info.value.failures.values(), key=lambda f: f.when)
    assert cause.exc_type == "ProcessDied" and cause.rank == 1, info.value.failures
    assert "rank 1 was killed by signal 6 (SIGABRT) before reporting" in str(info.value), str(info.value)
    assert "in _die_without_reporting" in str(info.value), str(info.value)


_ORPHANED_WORLD = """
import sys
sys.path[:0] = {paths!r}
from common.launch import run_world
from test_launch import _wait_forever_with_workers
run_world(_wait_forever_with_workers, 2, args=({pid_dir!r},), timeout=300)
"""


def _wait_forever_with_workers(pid_dir: str):
    rank = dist.get_rank()
    batches = iter(_shard_loader())
    workers = {int(next(batches)[1][0]), int(next(batches)[1][0])}  # both workers are up, and stay up
    Path(pid_dir, f"{rank}.tmp").write_text(" ".join(map(str, [os.getpid(), *workers])))
    os.replace(Path(pid_dir, f"{rank}.tmp"), Path(pid_dir, f"{rank}.pid"))  # whole, or not there yet
    dist.recv(torch.zeros(1), src=1 - rank)  # nobody sends


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
def test_no_process_outlives_a_killed_parent(tmp_path):
    script = _ORPHANED_WORLD.format(paths=[str(Path(__file__).parent), str(Path(__file__).parent.parent)],
                                    pid_dir=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 240
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < end and parent.poll() is None:
            time.sleep(0.2)
        pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
        assert len(pids) == 6, f"the world did not start: {pids}"
    finally:
        parent.send_signal(signal.SIGKILL)  # no finally, no atexit: the ranks are on their own
        parent.wait()
    assert not _gone_soon(pids), "a rank or a loader worker outlived its killed parent"


def test_two_worlds_at_once_never_collide():
    results, errors = {}, []

    def run(key):
        try:
            results[key] = run_world(_rank_info, 2, args=(key,))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[100][0][2] == 201.0 and results[200][0][2] == 401.0


def test_bad_calls_fail_before_starting_anything():
    with pytest.raises(ValueError, match="world_size"):
        run_world(_rank_info, 0)

    def local():
        pass

    with pytest.raises(ValueError, match="module-level"):
        run_world(local, 2)


_STUCK_WORKER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("worker started", flush=True)
with open({pid_file!r} + ".tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.replace({pid_file!r} + ".tmp", {pid_file!r})
time.sleep(600)
"""


def test_a_torchrun_job_past_its_deadline_is_killed_whole(tmp_path):
    """torchrun's workers (and what they start) live in sessions of their own: the job
    must still kill every one of them, and say what each agent printed."""
    from common.torchrun import Torchrun, TorchrunTimeout

    script, pid_file = tmp_path / "stuck.py", tmp_path / "pids"
    script.write_text(_STUCK_WORKER.format(pid_file=str(pid_file)))
    with Torchrun(timeout=120) as job:
        agent = job.start(["--standalone", "--nproc-per-node=1", str(script)])
        end = time.monotonic() + 110
        while not pid_file.exists() and time.monotonic() < end and agent.returncode is None:
            time.sleep(0.1)
        assert pid_file.exists(), f"the worker did not start:\n{agent.tail()}"
        pids = [agent.proc.pid, *map(int, pid_file.read_text().split())]
        with pytest.raises(TorchrunTimeout) as info:
            job.wait(timeout=0.5)  # its deadline, from now
        assert "worker started" in str(info.value), str(info.value)
        assert not job.processes(), f"processes {job.processes()} outlived the job"
    assert not _gone_soon(pids), f"agent, worker or the worker's child outlived the job: {pids}"
