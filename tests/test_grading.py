"""The grading machinery: templates, controls, loading the right code, reporting."""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import compare
import grading
from common.launch import RankFailure, WorldError, WorldTimeout

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


def _test_functions(test_file: Path) -> set[str]:
    """Test functions that test_phaseN.py collects (imported: some are generated, e.g. one per stage)."""
    module = importlib.import_module(test_file.stem)
    return {name for name, value in vars(module).items() if name.startswith("test_") and callable(value)}


def test_negative_controls_are_well_formed():
    per_exercise: dict[str, int] = {}
    for path in sorted((ROOT / "tests" / "negative_controls").glob("phase*/*.py")):
        control = check_grading.read_control(path)
        ex = control["EXERCISE"]
        assert ex in grading.EXERCISES, f"{path.name}: unknown exercise {ex}"
        test_file = ROOT / "tests" / f"test_phase{ex.split('.')[0]}.py"
        tests = _test_functions(test_file)
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


def test_make_template_points_imports_of_other_phases_at_the_learners_own_code():
    source = ('"""Doc: from solutions.phase1_data_parallel.trainer import x is text, not code."""\n'
              "from solutions.phase1_data_parallel.trainer import (\n    sync_gradients,\n)\n"
              "import solutions.phase1_data_parallel.sampler as sampler\n"
              "from .zero import ZeRO\n")
    assert make_templates.make_template(source) == (
        '"""Doc: from solutions.phase1_data_parallel.trainer import x is text, not code."""\n'
        "from phase1_data_parallel.trainer import (\n    sync_gradients,\n)\n"
        "import phase1_data_parallel.sampler as sampler\n"
        "from .zero import ZeRO\n")
    with pytest.raises(make_templates.MarkerError, match="as"):
        make_templates.make_template("import solutions.phase1_data_parallel.trainer\n")
    with pytest.raises(make_templates.MarkerError, match="name the module"):
        make_templates.make_template("from solutions import phase1_data_parallel\n")


def test_a_learner_module_is_graded_with_the_reference_of_every_other_exercise():
    import phase1_data_parallel.sampler as own_phase1  # what a phase-2 template imports: the learner's phase 1

    def helper():  # a function of the learner's phase 1 that the reference does not have
        pass

    helper.__module__ = "phase1_data_parallel.sampler"
    module = types.ModuleType("_learner_phase2_advanced.accumulation")
    module.ShardSampler = own_phase1.ShardSampler  # from phase1_data_parallel.sampler import ShardSampler
    module.sampler = own_phase1  # import phase1_data_parallel.sampler as sampler
    module.sibling = grading.ModuleRef("2.2", "learner", str(ROOT)).load()  # from . import mixed_precision
    module.sibling_class = module.sibling.LossScaler
    module.helper = helper
    module.tensor = torch.zeros(2)  # an instance: never rebound
    grading._use_reference_for_other_exercises(module)
    sampler, mixed_precision = grading.reference("1.1"), grading.reference("2.2")
    assert module.ShardSampler is sampler.ShardSampler and module.sampler is sampler
    assert module.sibling is mixed_precision and module.sibling_class is mixed_precision.LossScaler
    assert module.helper is helper, "a helper the reference lacks stays the learner's"
    assert Path(mixed_precision.__file__) == ROOT / "solutions" / "phase2_advanced" / "mixed_precision.py"


def test_diff_report_names_nan_and_inf_instead_of_crashing():
    nan, inf = float("nan"), float("inf")
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = torch.tensor([[1.0, nan], [nan, 4.0]])
    report = compare.diff_report(got, expected, "grad")
    assert "NaN where a number was expected at 2 of 4 elements" in report and "(0, 1)" in report, report
    assert "got nan, expected 2" in report, report
    report = compare.diff_report(expected, got, "grad")
    assert "a number where NaN was expected at 2 of 4 elements" in report, report
    report = compare.diff_report(torch.tensor([inf, 1.0]), torch.tensor([-inf, 1.0]), "scale")
    assert "an infinity that differs at 1 of 2 elements" in report and "got inf, expected -inf" in report, report
    assert compare.diff_report(got.clone(), got, "same NaNs") is None
    report = compare.diff_report(torch.tensor([nan, 2.5]), torch.tensor([nan, 2.0]), "w")  # NaNs agree, a number not
    assert "max abs diff 0.5 at index (1,)" in report, report


def test_a_harness_error_is_told_apart_from_a_failure():
    died = RankFailure(1, "ProcessDied", "rank 1 was killed by signal 6 (SIGABRT) before reporting", "", None, 2.0)
    raised = RankFailure(0, "ValueError", "bad shape", "tb", None, 1.0)
    assert grading.harness_error_of(WorldError("died", {1: died})) == died.message
    assert grading.harness_error_of(WorldError("raised first", {0: raised, 1: died})) is None
    assert grading.harness_error_of(WorldTimeout("deadlock", {}, "")) is None
    assert "did not start" in grading.harness_error_of(WorldTimeout("did not start within 120s", {}, "", (1,)))
    assert grading.harness_error_of(AssertionError("rank 0 differs")) is None
    rows = grading.summarize({"t.py::test_1_2_a": "pass", "t.py::test_1_2_b": "error"})
    assert rows[0]["status"] == "fail" and rows[0]["errors"] == 1 and rows[0]["tests"] == 2, rows
    assert "harness error" in grading.format_table(rows)


_FAKE_TESTS = '''
import pytest
from common.launch import RankFailure, WorldError, WorldTimeout

def test_1_1_rank_died():
    raise WorldError("rank 1 of 2 raised ProcessDied", {1: RankFailure(1, "ProcessDied", "rank 1 was killed by signal 6", "", None, 1.0)})

def test_1_1_rank_raised():
    raise WorldError("rank 0 of 2 raised ValueError", {0: RankFailure(0, "ValueError", "bad", "tb", None, 1.0)})

def test_1_1_asserts():
    assert 1 == 2, "rank 0 differs"

@pytest.mark.parametrize("world_size", [2, 3])
def test_1_1_deadlocks(world_size):
    raise WorldTimeout("world of 2 ranks did not finish", {}, "")

@pytest.mark.parametrize("world_size", [2, 3])
def test_1_1_slow_start(world_size):
    raise WorldTimeout("world of 2 ranks did not start within 120s: ranks [1] had not reached the code", {}, "", (1,))
'''


def test_the_report_tells_a_harness_death_from_a_failure_and_short_circuits_a_deadlock(tmp_path):
    (tmp_path / "test_fake.py").write_text(_FAKE_TESTS)
    report = tmp_path / "grades.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", str(tmp_path / "test_fake.py"), "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), f"--grade-json={report}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    outcomes = {k.split("::")[-1]: v for k, v in json.loads(report.read_text())["tests"].items()}
    assert outcomes == {"test_1_1_rank_died": "error", "test_1_1_rank_raised": "fail", "test_1_1_asserts": "fail",
                        "test_1_1_deadlocks[2]": "fail", "test_1_1_deadlocks[3]": "fail",
                        "test_1_1_slow_start[2]": "error", "test_1_1_slow_start[3]": "error"}, proc.stdout[-3000:]
    assert "HARNESS ERROR" in proc.stdout and "killed by signal 6" in proc.stdout, proc.stdout[-3000:]
    assert "not run: test_1_1_deadlocks[2] deadlocked" in proc.stdout, proc.stdout[-3000:]
    assert "not run: test_1_1_slow_start" not in proc.stdout, "a world too slow to start is no deadlock"


def test_a_control_rejected_only_by_a_harness_error_is_not_rejected(monkeypatch, capsys):
    control = {"path": Path("wrong_average.py"), "EXERCISE": "1.2", "doc": "averages twice",
               "CAUGHT_BY": ["test_1_2_a", "test_1_2_b"]}
    other = {"path": Path("other.py"), "EXERCISE": "1.2", "doc": "another bug", "CAUGHT_BY": ["test_1_2_a"]}
    report = {"tests": {"tests/test_phase1.py::test_1_2_a[wrong_average-2]": "error",
                        "tests/test_phase1.py::test_1_2_a[wrong_average-3]": "error",
                        "tests/test_phase1.py::test_1_2_b[wrong_average]": "fail",
                        "tests/test_phase1.py::test_1_2_a[other-2]": "fail",
                        "tests/test_phase1.py::test_1_2_a[other-3]": "pass"},
              "durations": {}}
    report["controls"] = {k: "other" if "other" in k else "wrong_average" for k in report["tests"]}
    monkeypatch.setattr(check_grading, "run_pytest", lambda test_file, extra, timeout=900: report)
    problems = check_grading.check_controls(ROOT / "tests" / "test_phase1.py", [control, other])
    out = capsys.readouterr().out
    assert len(problems) == 1, problems
    assert "test_1_2_a" in problems[0] and "harness" in problems[0] and "test_1_2_b" not in problems[0], problems
    assert "ACCEPTED" in out and "harness error, not an assertion, in test_1_2_a" in out, out
    assert "REJECTED 1.2 other" in out, out


_FAKE_CONTROL_TESTS = '''
import pytest
import common.launch
from common.launch import WorldTimeout

def test_1_1_names(grade):
    assert "bad" not in grade("1.1").path().name

def test_1_1_other(grade):
    assert grade("1.2").path().name == "allreduce.py", "only 1.1 is replaced"

@pytest.mark.parametrize("world_size", [2, 3])
def test_1_1_deadlocks(world_size, grade):
    if "slow" in grade("1.1").path().name:
        raise WorldTimeout("world of 2 ranks did not finish", {}, "")

def test_1_1_deadline(grade):
    assert common.launch.DEFAULT_TIMEOUT_S == 7

def test_1_1_never_named(grade):
    assert False
'''


def test_controls_run_each_named_test_once_per_control(tmp_path):
    """`pytest --controls`: one session, each test against each control naming it, and a
    deadlock of one control does not cut short another's tests."""
    (tmp_path / "test_fake.py").write_text(_FAKE_CONTROL_TESTS)
    for name in ("bad_slow", "good"):
        (tmp_path / f"{name}.py").write_text("")
    spec = [{"name": "bad_slow", "exercise": "1.1", "path": str(tmp_path / "bad_slow.py"), "world_timeout": 7,
             "caught_by": ["test_1_1_names", "test_1_1_other", "test_1_1_deadlocks", "test_1_1_deadline"]},
            {"name": "good", "exercise": "1.1", "path": str(tmp_path / "good.py"),
             "caught_by": ["test_1_1_names", "test_1_1_deadlocks", "test_1_1_deadline"]}]
    (tmp_path / "controls.json").write_text(json.dumps(spec))
    report = tmp_path / "grades.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", str(tmp_path / "test_fake.py"), "-q",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), f"--grade-json={report}",
                           f"--controls={tmp_path / 'controls.json'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    got = json.loads(report.read_text())
    outcomes = {k.split("::")[-1]: v for k, v in got["tests"].items()}
    assert outcomes == {"test_1_1_names[bad_slow]": "fail", "test_1_1_names[good]": "pass",
                        "test_1_1_other[bad_slow]": "pass",
                        "test_1_1_deadlocks[bad_slow-2]": "fail", "test_1_1_deadlocks[bad_slow-3]": "fail",
                        "test_1_1_deadlocks[good-2]": "pass", "test_1_1_deadlocks[good-3]": "pass",
                        "test_1_1_deadline[bad_slow]": "pass", "test_1_1_deadline[good]": "fail"}, proc.stdout[-3000:]
    assert {k.split("::")[-1]: v for k, v in got["controls"].items()}["test_1_1_names[good]"] == "good"
    assert "not run: test_1_1_deadlocks[bad_slow-2] deadlocked" in proc.stdout, proc.stdout[-3000:]


def test_templates_that_import_another_phase_are_graded_with_its_reference():
    modules = {(ex.phase, ex.module): ex.id for ex in grading.EXERCISES.values()}
    for _, template in make_templates.template_pairs():
        exercise = modules.get((template.parent.name, template.stem))
        imports = [node for node in ast.walk(ast.parse(template.read_text()))
                   if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("phase")]
        if exercise is None or not imports:
            continue
        module = grading.ModuleRef(exercise, "learner", str(ROOT)).load()
        for node in imports:
            reference = importlib.import_module(f"solutions.{node.module}")
            for alias in node.names:
                bound = getattr(module, alias.asname or alias.name)
                assert bound is getattr(reference, alias.name), (
                    f"{template.relative_to(ROOT)}: {alias.name} from the learner's {node.module} is graded, "
                    "not the reference's")
