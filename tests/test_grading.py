"""The grading machinery: templates, controls, loading the right code, reporting."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import grading
from common.launch import RankFailure, WorldError

sys.path.insert(0, str(grading.REPO_ROOT / "tools"))
import check_grading  # noqa: E402
import make_templates  # noqa: E402

ROOT = grading.REPO_ROOT


def test_templates_are_regenerated_from_solutions():
    stale = [str(dst.relative_to(ROOT)) for src, dst in make_templates.template_pairs()
             if not dst.exists() or dst.read_text() != make_templates.make_template(src.read_text())]
    assert not stale, f"run `python tools/make_templates.py`: stale templates {stale}"


def test_make_template_replaces_exercise_bodies():
    source = "def f(x):\n    '''doc'''\n    # EXERCISE 9.9: add one\n    y = x + 1\n    return y\n    # END EXERCISE\n"
    assert make_templates.make_template(source) == (
        "def f(x):\n    '''doc'''\n    raise NotImplementedError('TODO 9.9: add one')\n")


@pytest.mark.parametrize("source", [
    "# EXERCISE 1.1: a\nx = 1\n",                                  # never closed
    "# END EXERCISE\n",                                            # closed, never opened
    "# EXERCISE 1.1: a\n# EXERCISE 1.2: b\n# END EXERCISE\n",       # nested
])
def test_make_template_rejects_broken_markers(source):
    with pytest.raises(make_templates.MarkerError):
        make_templates.make_template(source)


def _public_api(path: Path) -> dict[str, str]:
    """name -> signature and docstring, for top-level functions, classes and their methods."""
    api = {}
    for node in ast.parse(path.read_text()).body:
        items = [(node.name, node)] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []
        if isinstance(node, ast.ClassDef):
            items += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
        for name, item in items:
            signature = ast.dump(item.args) if isinstance(item, ast.FunctionDef) else ""
            api[name] = signature + (ast.get_docstring(item) or "")
    return api


def test_templates_have_the_public_api_of_their_solutions():
    for src, dst in make_templates.template_pairs():
        assert _public_api(dst) == _public_api(src), f"{dst.relative_to(ROOT)} and its solution differ in API"


def test_every_exercise_has_markers_and_every_marker_an_exercise():
    marked = {}
    for src, _ in make_templates.template_pairs():
        for ex in make_templates.exercise_ids(src.read_text()):
            marked.setdefault(ex, []).append(src.stem)
    for ex_id, ex in grading.EXERCISES.items():
        if (ROOT / "solutions" / ex.phase).is_dir():
            assert ex.module in marked.get(ex_id, []), f"exercise {ex_id} has no EXERCISE marker in {ex.module}.py"
    assert set(marked) <= set(grading.EXERCISES), f"markers for unregistered exercises: {set(marked) - set(grading.EXERCISES)}"


def test_negative_controls_are_well_formed():
    per_exercise: dict[str, int] = {}
    for path in sorted((ROOT / "tests" / "negative_controls").glob("phase*/*.py")):
        control = check_grading.read_control(path)
        ex = control["EXERCISE"]
        assert ex in grading.EXERCISES, f"{path.name}: unknown exercise {ex}"
        test_file = ROOT / "tests" / f"test_phase{ex.split('.')[0]}.py"
        tests = {n.name for n in ast.parse(test_file.read_text()).body if isinstance(n, ast.FunctionDef)}
        for name in control["CAUGHT_BY"]:
            assert name in tests, f"{path.name}: CAUGHT_BY names {name}, which is not in {test_file.name}"
            assert grading.exercise_of_test(name) == ex, f"{path.name}: {name} does not grade exercise {ex}"
        per_exercise[ex] = per_exercise.get(ex, 0) + 1
    for ex_id, ex in grading.EXERCISES.items():
        if (ROOT / "solutions" / ex.phase).is_dir():
            assert per_exercise.get(ex_id, 0) >= 2, f"exercise {ex_id} needs at least two negative controls"


def test_learner_and_solution_code_come_from_their_own_folders():
    learner = grading.ModuleRef("1.1", "learner", str(ROOT)).load()
    solution = grading.ModuleRef("1.1", "solution", str(ROOT)).load()
    assert Path(learner.__file__) == ROOT / "phase1_data_parallel" / "sampler.py"
    assert Path(solution.__file__) == ROOT / "solutions" / "phase1_data_parallel" / "sampler.py"
    trainer = grading.ModuleRef("1.4", "learner", str(ROOT)).load()
    assert trainer.make_loader is solution.make_loader, "other exercises must come from the reference"


def test_a_checkout_elsewhere_is_graded_from_there(tmp_path):
    shutil.copytree(ROOT / "phase1_data_parallel", tmp_path / "phase1_data_parallel")
    shutil.copy(ROOT / "solutions" / "phase1_data_parallel" / "comm_bench.py", tmp_path / "phase1_data_parallel")
    report = tmp_path / "grades.json"
    proc = subprocess.run([sys.executable, "tests/grade.py", "--checkout", str(tmp_path), "--json", str(report),
                           "-k", "1_3_bandwidths or 1_3_fit or 1_1_bad"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith(f"GRADING YOUR CODE: the phase folders of {tmp_path}"), proc.stdout[:500]
    rows = {r["exercise"]: r["status"] for r in json.loads(report.read_text())["exercises"]}
    assert rows == {"1.1": "todo", "1.3": "pass"}, (rows, proc.stdout[-2000:])


def test_asking_for_code_that_python_did_not_load_is_an_error(tmp_path):
    with pytest.raises(grading.WrongCodeLoaded):
        grading.ModuleRef("1.1", "solution", str(tmp_path)).load()


def test_todo_is_recognised_directly_and_behind_a_world():
    assert grading.todo_of(NotImplementedError("TODO 1.2: do it")) == "TODO 1.2: do it"
    failure = RankFailure(1, "NotImplementedError", "TODO 1.4: sync", "tb")
    assert grading.todo_of(WorldError("rank 1 raised", {1: failure})) == "TODO 1.4: sync"
    assert grading.todo_of(NotImplementedError("something else")) is None
    assert grading.todo_of(AssertionError("TODO 1.1")) is None


def test_learner_run_reports_todo_without_tracebacks():
    proc = subprocess.run([sys.executable, "tests/test_phase1.py", "-k", "1_3_bandwidths or 1_1_bad"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert out.startswith("GRADING YOUR CODE"), out[:300]
    assert "TODO 1.3:" in out and "phase1_data_parallel/guidelines.md, section 1.3" in out, out
    assert "Traceback" not in out and "raise NotImplementedError" not in out, out
    assert proc.returncode == 1
