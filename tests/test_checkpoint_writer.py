"""The trainer's background checkpoint writer (solutions/phase4_production/trainer/checkpoint_writer.py).

In one process, no world: what a background write must keep from 4.1 (a file only once
complete, the state as it was at submit), and what it adds (errors raised at the next call,
one write in flight, every finished write reported once, in order).
"""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from solutions.phase4_production.checkpoint import CheckpointManager, load_verified
from solutions.phase4_production.trainer.checkpoint_writer import BackgroundWriter, cpu_snapshot
from solutions.phase4_production.recovery import Fault, FaultInjector


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 4), value)}, "progress": {"history": [value], "step": int(value)}}


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_file_holds_the_state_as_it_was_at_submit(tmp_path, asynchronous):
    done = []
    writer = BackgroundWriter(CheckpointManager(tmp_path, keep=5), asynchronous=asynchronous, on_done=done.append)
    state = _state(1.0)
    with writer:
        writer.submit(1, state)
        state["model"]["w"].add_(100.0)  # the next optimizer step changes the live tensors in place
        state["progress"]["history"].append(2.0)  # and the loop appends to its lists
        writer.submit(2, _state(2.0))
    saved = load_verified(tmp_path / "step_000000001.pt")
    assert torch.equal(saved["model"]["w"], torch.full((4, 4), 1.0)), "the write saw a change made after submit"
    assert saved["progress"]["history"] == [1.0]
    assert [r.step for r in done] == [1, 2] and all(r.path is not None and r.error is None for r in done), done
    assert all(r.stall_s >= 0 and r.write_s > 0 for r in done), done


def test_a_failed_background_write_is_raised_at_the_next_call_and_names_its_step(tmp_path):
    faults = FaultInjector([Fault(rank=0, step=4, phase="save", action="enospc")])
    done = []
    writer = BackgroundWriter(CheckpointManager(tmp_path, keep=5), faults, on_done=done.append)
    faults.begin_step(4)
    writer.submit(5, _state(5.0))
    faults.begin_step(5)  # the loop goes on while the write fails
    with pytest.raises(OSError) as failed:
        writer.submit(6, _state(6.0))
    assert failed.value.errno == errno.ENOSPC and writer.failed_step == 5
    assert not list(tmp_path.glob("step_*.pt")), "a failed write must leave no checkpoint"
    assert [(r.step, r.path) for r in done] == [(5, None)], done
    writer.close()  # nothing in flight: the refused submit wrote nothing
    assert len(done) == 1


def test_a_fault_fires_for_the_step_whose_checkpoint_is_written_not_the_loops_current_step(tmp_path):
    """The writer thread runs while the loop has moved on: the save fault of step 4 must tear
    the checkpoint of step 4's end, whatever step the loop is in when the thread writes."""
    faults = FaultInjector([Fault(rank=0, step=4, phase="save", action="enospc")])
    gate = threading.Event()
    manager = CheckpointManager(tmp_path, keep=5)
    real_save = manager.save

    def late_save(step, state):  # the thread starts writing only once the loop is at step 7
        gate.wait(timeout=30)
        return real_save(step, state)

    manager.save = late_save
    writer = BackgroundWriter(manager, faults)
    faults.begin_step(4)
    writer.submit(5, _state(5.0))
    faults.begin_step(7)
    gate.set()
    with pytest.raises(OSError):
        writer.wait()
    faults.begin_step(8)
    writer.submit(9, _state(9.0))  # not due: written
    writer.wait()
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_000000009.pt"]


def test_close_after_an_error_finishes_the_write_in_flight(tmp_path):
    done = []
    writer = BackgroundWriter(CheckpointManager(tmp_path, keep=5), on_done=done.append)
    with pytest.raises(RuntimeError, match="the loop failed"):
        with writer:
            writer.submit(3, _state(3.0))
            raise RuntimeError("the loop failed")
    assert load_verified(tmp_path / "step_000000003.pt")["progress"]["step"] == 3
    assert [r.step for r in done] == [3]


def test_a_snapshot_shares_no_storage_with_the_state():
    shared = torch.arange(6.0)
    state = {"a": shared, "b": [shared[:3], (shared, 1)], "n": {"x": 1}}
    copy = cpu_snapshot(state)
    shared.mul_(0)
    assert torch.equal(copy["a"], torch.arange(6.0)) and torch.equal(copy["b"][0], torch.arange(3.0))
    assert isinstance(copy["b"][1], tuple) and copy["n"] == {"x": 1} and copy["n"] is not state["n"]
