"""The world launcher keeps its promises: results back, errors named, deadlocks reported, nothing left behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

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
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the rank's process must be gone


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
