"""tests/scenarios.py keeps its promises: a scenario that hangs or ends the world fails its own tests
only, with the scenario, the ranks that did not finish it and where each waits; the others are answered."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import common.launch
from common.launch import WorldError, WorldTimeout
from scenarios import ScenarioHang, SharedWorld, run_scenarios

_AGREE_S = 2.0  # shorter than the world's deadline below: a rank that only waits must not end the world at it
_DEADLINE_S = 5.0


def _rank_value() -> float:
    return float(dist.get_rank())


def _raises_while_peer_waits() -> None:
    """Rank 0 raises; rank 1 waits for a message rank 0 was to send."""
    if dist.get_rank() == 0:
        raise ValueError("rank 0 gives up")
    dist.recv(torch.zeros(1), src=0)


def _hangs() -> str:
    """Rank 1 waits for a message nobody sends; rank 0 finishes."""
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1), src=0)
    return "finished"


def _after() -> float:
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return t.item()


def _rank() -> dict:
    return run_scenarios({"before": _rank_value, "raises": _raises_while_peer_waits, "hangs": _hangs,
                          "after": _after}, _AGREE_S)


def test_a_scenario_that_hangs_or_ends_the_world_fails_alone(monkeypatch):
    monkeypatch.setattr(common.launch, "DEFAULT_TIMEOUT_S", _DEADLINE_S)
    world = SharedWorld(_rank, 2)
    assert world.results("before") == [0.0, 1.0]  # answered, though the world ended in a later scenario

    with pytest.raises(WorldError, match="rank 0 gives up") as info:
        world.results("raises")
    assert not isinstance(info.value, WorldTimeout), "a rank that raised ended the world: its error, not a deadline"

    with pytest.raises(ScenarioHang) as info:
        world.results("hangs", what="the hanging scenario", world="the test world", hang_hint="nobody sends")
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("the hanging scenario, in the test world, did not finish within the world's deadline"), \
        first
    assert "rank 1 never finished it; rank 0 finished it and waited for it (nobody sends)" in first, first
    assert "  rank 0: finished this scenario, waiting for the others" in message, message
    assert "  rank 1: " in message and "test_scenarios.py:" in message and "in _hangs" in message, message
    assert "recv" in message, message
    assert set(info.value.stacks) == {1}, "the stacks are those of the ranks still in the scenario"
    assert isinstance(info.value.__cause__, WorldTimeout), "conftest and mutate tell a deadlock by its cause"

    assert world.results("after") == [2.0, 2.0]  # a world run again without the scenarios answered
    with pytest.raises(ScenarioHang):  # the same answer to every later test of the scenario
        world.results("hangs")
