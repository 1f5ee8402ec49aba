"""The contract files (tests/phaseN/contract_x_y.py) name the whole public API of their exercise, and only it;
the recorder (tests/contracts.py) sees calls made in the parent and in the ranks of a world. Cheap: no graded
test runs here (tools/check_contracts.py reads what the graded tests recorded)."""

from __future__ import annotations

import importlib
import json

import pytest

import contracts
import grading
from common.launch import run_world

EXERCISES = [ex for ex in grading.EXERCISES if contracts.contract_path(ex).exists()]


def test_every_exercise_of_phases_1_to_4_has_a_contract():
    missing = [ex for ex in grading.EXERCISES if not contracts.contract_path(ex).exists()]
    assert not missing, (f"exercises without a contract file: {missing}; write "
                         f"{contracts.contract_path(missing[0]).relative_to(grading.REPO_ROOT)} (tests/contracts.py)")


@pytest.mark.parametrize("exercise", EXERCISES)
def test_contract_names_the_whole_public_api(exercise):
    """Every public function and method of the exercise's module is a key of CONTRACT (an empty list only
    when IRRELEVANT gives the reason for the whole callable); no key, IRRELEVANT entry or argument named by an
    entry is stale."""
    ex = grading.EXERCISES[exercise]
    module = importlib.import_module(f"solutions.{ex.phase}.{ex.module}")
    contract = contracts.load_contract(exercise)
    public = contracts.public_callables(module)
    problems = [f"{name}: public, but not in CONTRACT" for name in public if name not in contract.api]
    problems += [f"{name}: in CONTRACT, but no public callable of {ex.module}.py" for name in contract.api
                 if name not in public]
    problems += [f"{name}: no entries, and IRRELEVANT gives no reason for it" for name, entries in contract.api.items()
                 if not entries and name not in contract.irrelevant]
    entries = contract.entries()
    problems += [f"IRRELEVANT names {key!r}: no entry or callable of CONTRACT" for key in contract.irrelevant
                 if key not in entries and key not in contract.api]
    problems += [f"IRRELEVANT gives no reason for {key!r}" for key, why in contract.irrelevant.items()
                 if not str(why).strip()]
    problems += [f"CONTRACT has {name!r}, BEFORE has a hook for it but it is no key of CONTRACT"
                 for name in contract.before if name not in contract.api]
    assert not problems, f"{contract.path.name}:\n" + "\n".join(problems)


def _recorded_rank(ref: grading.ModuleRef) -> int:
    mod = ref.load()
    sampler = mod.ShardSampler(range(10), 2, 0, shuffle=False)
    mod.make_loader(range(10), 4, 1, 2)  # make_loader's own ShardSampler is no call of the test's
    return len(list(sampler))


def test_the_recorder_sees_calls_in_ranks_and_not_the_module_calling_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(contracts.ENV, str(tmp_path))
    monkeypatch.setenv(contracts.TEST_ENV, "tests/test_phase1.py::test_1_1_recorder")
    run_world(_recorded_rank, 1, args=(grading.ModuleRef("1.1", "solution", str(grading.REPO_ROOT)),))
    lines = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    seen = {line["entry"] for line in lines}
    assert "ShardSampler.__init__: shuffle=False" in seen and "ShardSampler.__iter__: shuffle=False" in seen, seen
    assert "ShardSampler.__init__: shuffle=True" not in seen, \
        f"make_loader's own ShardSampler(shuffle=True) counted as a call of the test: {seen}"
    assert "make_loader: rank = world_size - 1 > 0" in seen, seen
