"""Negative controls cannot drift (tests/controls.py): each is the reference plus what it names.

Every control loads, replaces only what the reference has, and changes nothing it does not
declare; the splice behaves as one module; the check catches what it is for; and
tools/check_grading.py reports a control that cannot load as BROKEN, never as rejected.
No process group, no world: about 10 s, most of it loading the references (torch).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_grading  # noqa: E402
import controls  # noqa: E402

HEADER = 'EXERCISE = "1.2"\nCAUGHT_BY = ["test_1_2_strategies_equal_dist_all_reduce"]\n'


def _control(tmp_path: Path, body: str, name: str = "a_control") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(f'"""A test\'s control."""\n{HEADER}{body}')
    return path


@pytest.fixture
def fresh(tmp_path):
    """Controls written by a test, removed from sys.modules after it (load caches by file stem)."""
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("_control"):
            del sys.modules[name]


def test_every_negative_control_is_the_reference_plus_what_it_names():
    paths = sorted((ROOT / "tests" / "negative_controls").glob("phase*/*.py"))
    assert len(paths) > 100, "where are the negative controls?"
    found = [problem for path in paths for problem in controls.problems(path)]
    assert not found, "negative controls that are not sound (tests/controls.py says the format):\n  " + \
        "\n  ".join(found)


def test_a_spliced_control_is_one_module_with_the_reference(fresh):
    """The reference's callers meet the replacement (STRATEGIES is built from the module's
    functions), EDITS change one definition's lines, everything else is the reference's code
    from the reference's file, and a traceback shows the line that raised, where it is."""
    import solutions.phase1_data_parallel.allreduce as reference

    path = _control(fresh, 'EDITS = {"_check": [("    if op not in OPS:\\n", "    if op == \'never\':\\n")]}\n'
                           "\n\ndef allreduce_gather_sum(tensor, op='sum'):\n    raise ValueError(_why())\n"
                           "\n\ndef _why():\n    return 'the control'\n")
    if "    if op not in OPS:\n" not in Path(reference.__file__).read_text():
        pytest.skip("allreduce._check changed: pick another line for this test")
    module = controls.load(path)
    assert module.__file__ == str(path) and module.STRATEGIES["gather_sum"] is module.allreduce_gather_sum
    assert module.allreduce_gather_sum is not reference.allreduce_gather_sum
    assert module.allreduce_reduce_broadcast.__globals__ is vars(module)  # a reference function, in the splice
    assert module.allreduce_reduce_broadcast.__code__.co_filename == reference.__file__
    assert controls.same_code(module.allreduce_reduce_broadcast.__code__, reference.allreduce_reduce_broadcast.__code__)
    assert not controls.same_code(module._check.__code__, reference._check.__code__)
    assert "(as a_control.py edits it)" in module._check.__code__.co_filename
    with pytest.raises(ValueError, match="the control") as caught:
        module.STRATEGIES["gather_sum"](None)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert (frames[-1].filename, frames[-1].line) == (str(path), "raise ValueError(_why())")
    assert controls.problems(path) == []


def test_relative_imports_resolve_in_the_reference_package(fresh):
    """pipeline.py imports `from .model_split import ...`: the splice needs no rewrite of it."""
    path = _control(fresh, 'EDITS = {"run_pipeline": [("held.pop((k, j))", "held.pop((j, k))", 2)]}\n')
    path.write_text(path.read_text().replace('"1.2"', '"2.6"').replace("test_1_2_strategies_equal_dist_all_reduce",
                                                                     "test_2_6_matches_one_process"))
    import solutions.phase2_advanced.model_split as model_split

    try:
        module = controls.load(path)
    except controls.ControlError as exc:
        pytest.skip(f"run_pipeline changed: {exc}")
    assert module.Mailbox is model_split.Mailbox


def test_a_package_reference_is_spliced_as_one_module(fresh):
    """2.4's reference is a package (zero/, one file per stage): a control names a definition of any of its
    files, the other files' code meets the replacement (memory.py's zero_state_bytes calls stage1.py's
    partition_parameters), and every other definition is its own file's code; EDITS edit the file that
    defines the name."""
    import solutions.phase2_advanced.zero as reference

    if Path(reference.__file__).name != "__init__.py":
        pytest.skip("2.4's reference is no package")
    folder = Path(reference.__file__).parent
    path = fresh / "a_control.py"
    path.write_text('"""A test\'s control."""\nEXERCISE = "2.4"\nCAUGHT_BY = ["test_2_4_memory_formula"]\n'
                    'EDITS = {"ZeroStage3.reshard": [("resize_(0)", "resize_(1)")]}\n'
                    "\n\ndef partition_parameters(numels, world_size):\n    raise ValueError('the control')\n")
    module = controls.load(path)
    with pytest.raises(ValueError, match="the control"):
        module.zero_state_bytes(1, torch.nn.Linear(2, 2), 2)
    assert module.zero_state_bytes.__code__.co_filename == str(folder / "memory.py")
    assert module.ZeroStage3.reshard.__code__.co_filename == f"{folder / 'stage3.py'} (as a_control.py edits it)"
    assert module.ZeroStage3.unshard.__code__.co_filename == str(folder / "stage3.py")
    assert controls.same_code(module.ZeroStage3.unshard.__code__, reference.ZeroStage3.unshard.__code__)
    assert controls.same_code(module._cast_floats.__code__, reference.flat._cast_floats.__code__)
    assert controls.problems(path) == []


@pytest.mark.parametrize("body, expected", [
    ('EDITS = {"_check": [("no such text", "x")]}\n',
     "does not load: EDITS['_check']: 'no such text' occurs 0 times in the reference's _check (expected 1): "
     "the reference changed; update the control"),
    ("def allreduce_gather_summ(tensor, op='sum'):\n    return tensor\n",
     "adds allreduce_gather_summ, which the reference lacks and no replacement uses"),
    ("class Nowhere:\n    pass\n", "adds Nowhere, which the reference lacks"),
    ('EDITS = {"no_such_function": [("a", "b")]}\n', "EDITS names 'no_such_function', which the reference"),
    ("import torch\n\n\ndef _finish(tensor, op):\n    if op == 'avg':\n        tensor /= 3\n    return tensor\n",
     "imports torch, a name the reference binds itself"),
    ("for x in []:\n    pass\n", "a control holds its header, imports and definitions"),
])
def test_the_check_names_what_is_wrong_with_a_spliced_control(fresh, body, expected):
    found = controls.problems(_control(fresh, body))
    assert any(expected in problem for problem in found), found


def test_a_replacement_that_is_the_reference_is_named(fresh):
    import solutions.phase1_data_parallel.allreduce as reference
    import inspect

    found = controls.problems(_control(fresh, "import torch.distributed as dist\n\n\n" +
                                       inspect.getsource(reference._finish)))
    assert any("replaces _finish with the reference's own (docstrings aside): drop it" in p for p in found), found


@pytest.mark.parametrize("body, expected", [
    ("from solutions.phase1_data_parallel import allreduce as _reference\n"
     "from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403\n"
     "from solutions.phase1_data_parallel.allreduce import allreduce_gather_sum as allreduce_recursive_doubling\n",
     "changes allreduce_recursive_doubling, which it does not declare"),
    ("from solutions.phase1_data_parallel import allreduce as _reference\n"
     "from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403\n"
     "_reference.OPS = ()\n", "patches the reference module"),
    ("from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403\n"
     "from solutions.phase1_data_parallel import allreduce as _reference\n"
     "exec(compile('x = 1', _reference.__file__, 'exec'))\n", "splices source text itself"),
    ("from solutions.phase1_data_parallel.sampler import *  # noqa: F401,F403\n",
     "not from its reference solutions.phase1_data_parallel.allreduce alone"),
])
def test_the_check_names_what_is_wrong_with_an_override_control(fresh, body, expected):
    """The older spelling (`import *`, then overrides) is held to the same: it may change only
    what it defines, never patch the reference module or splice text itself."""
    found = controls.problems(_control(fresh, body))
    assert any(expected in problem for problem in found), found


def test_a_control_that_cannot_load_is_broken_not_rejected(fresh, monkeypatch, capsys):
    """check_grading once counted a control whose load failed (its text no longer in the
    reference) as REJECTED: every test it names failed. Now it is BROKEN, it runs no test, and
    the check fails."""
    (fresh / "phase1").mkdir()
    _control(fresh / "phase1", 'EDITS = {"_check": [("text the reference lost", "x")]}\n', "allreduce_stale")
    monkeypatch.setattr(check_grading, "CONTROLS", fresh)

    def no_pytest(*args, **kwargs):
        raise AssertionError("a broken control was run")

    monkeypatch.setattr(check_grading, "run_pytest", no_pytest)
    assert check_grading.main(["--phase", "1", "--no-templates"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN   1.2 allreduce_stale.py: does not load: EDITS['_check']" in out, out
    assert "REJECTED" not in out and "NOT honest" in out, out


def test_checking_a_control_that_patches_its_reference_leaves_the_reference_as_it_was(fresh):
    """The check finds the patch in the control's source and never runs it: run, it patched the reference
    module of the pytest process, and a later graded test saw `OPS = ()` (CI: test_allreduce_rejects_bad_op)."""
    import solutions.phase1_data_parallel.allreduce as reference

    before = reference.OPS
    found = controls.problems(_control(fresh, "from solutions.phase1_data_parallel import allreduce as _reference\n"
                                              "from solutions.phase1_data_parallel.allreduce import *  # noqa: F401,F403\n"
                                              "_reference.OPS = ()\n"))
    assert any("patches the reference module" in p for p in found) and reference.OPS is before, found
