"""The grading machinery: templates, controls, loading the right code, reporting."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
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


def _skip_on_a_learners_checkout(check: str) -> None:
    """A check that the repository is pristine means nothing on a checkout where a learner has
    written exercises (and its advice, regenerate the templates, would erase their work): it
    skips there, saying why, unless CI=true or COURSE_REQUIRE_PRISTINE=1 (CI runs it always)."""
    learner = make_templates.templates_with_learner_code()
    if learner and not grading.pristine_checks_required():
        pytest.skip(f"{check}: skipped, the exercise regions of {', '.join(learner)} hold your code "
                    "(a check for CI and contributors; CI=true or COURSE_REQUIRE_PRISTINE=1 runs it)")


def test_templates_are_regenerated_from_solutions():
    _skip_on_a_learners_checkout("templates regenerated from the solutions")
    stale = [str(dst.relative_to(ROOT)) for src, dst in make_templates.template_pairs()
             if not dst.exists() or dst.read_text() != make_templates.make_template(src.read_text())]
    assert not stale, f"run `python tools/make_templates.py`: stale templates {stale}"


def _pristine_checkout(root: Path, phases: tuple[str, ...] = ("phase1_data_parallel",)) -> Path:
    """Write the untouched templates of `phases` under `root`, generated from the solutions:
    tests of the grading machinery grade these, never the learner's own files."""
    for src, dst in make_templates.template_pairs():
        if dst.parent.name in phases:
            target = root / dst.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(make_templates.make_template(src.read_text()))
    return root


def _copy_of_the_repository(root: Path) -> Path:
    """The repository's files without the venv, git and outputs (a few MB): for tests that
    change templates, so the real ones are never touched."""
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
    shutil.copytree(ROOT, root, ignore=ignore)
    for src, dst in make_templates.template_pairs():  # exactly what the generator writes, to start from
        (root / dst.relative_to(ROOT)).write_text(make_templates.make_template(src.read_text()))
    return root


def test_make_templates_never_overwrites_learner_code_without_force(tmp_path, capsys):
    root = _copy_of_the_repository(tmp_path / "repo")
    allreduce, ring = root / "phase1_data_parallel" / "allreduce.py", root / "phase3_multi_node" / "ring.py"
    stale = root / "phase1_data_parallel" / "sampler.py"  # stale outside its exercise regions: no learner code
    solved = allreduce.read_text().replace('    raise NotImplementedError("TODO 1.2:', "    my_work = 1\n"
                                           '    raise NotImplementedError("TODO 1.2:', 1)
    assert solved != allreduce.read_text()
    allreduce.write_text(solved)
    ring.write_text(ring.read_text().replace("raise NotImplementedError(", "return tensor  # mine\n    "
                                             "raise NotImplementedError(", 1))
    stale.write_text("# an old header\n" + stale.read_text())
    assert make_templates.templates_with_learner_code(root) == {
        "phase1_data_parallel/allreduce.py": ["1.2"], "phase3_multi_node/ring.py": ["3.1"]}

    assert make_templates.main([], root=root) == 1
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1, err
    assert "phase1_data_parallel/allreduce.py (1.2)" in err and "phase3_multi_node/ring.py (3.1)" in err, err
    assert "--force" in err and "nothing was written" in err, err
    assert allreduce.read_text() == solved and stale.read_text().startswith("# an old header"), "wrote anyway"

    assert make_templates.main(["--force"], root=root) == 0
    out, err = capsys.readouterr()
    backups = sorted(p.relative_to(root).as_posix() for p in root.glob("phase*/*.bak-*"))
    assert [b.split(".bak-")[0] for b in backups] == ["phase1_data_parallel/allreduce.py",
                                                       "phase3_multi_node/ring.py"], backups
    assert f"kept your version of phase1_data_parallel/allreduce.py as {backups[0]}" in out, out
    assert (root / backups[0]).read_text() == solved, "the copy must hold the learner's code"
    assert make_templates.templates_with_learner_code(root) == {}
    assert make_templates.main(["--check"], root=root) == 0


def test_a_reworded_hint_is_no_learner_code():
    template = "def f():\n    raise NotImplementedError('TODO 9.9: add one')\n"
    assert make_templates.learner_regions(template, template.replace("add one", "add 1")) == []
    assert make_templates.learner_regions(template, "def f():\n    return 1\n") == ["9.9"]
    assert make_templates.learner_regions(template, "# header\n" + template) == []


def test_pristine_checks_skip_on_a_learners_checkout_and_run_in_ci(tmp_path):
    """On a copy of the repository whose 1.2 holds code, the pristine checks skip saying why;
    with CI=true the same checks run and fail (so CI still catches a real drift)."""
    root = _copy_of_the_repository(tmp_path / "repo")
    allreduce = root / "phase1_data_parallel" / "allreduce.py"
    allreduce.write_text(allreduce.read_text().replace('raise NotImplementedError("TODO 1.2:',
                                                       'return tensor\n    raise NotImplementedError("TODO 1.2:', 1))
    checks = ["tests/test_grading.py::test_templates_are_regenerated_from_solutions",
              "tests/test_repo.py::test_allreduce_benchmark_compares_learner_reference_and_torch"]
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "COURSE_REQUIRE_PRISTINE")}
    env["COLUMNS"] = "400"  # skip reasons whole
    run = [sys.executable, "-m", "pytest", *checks, "-q", "-rs", "-p", "no:cacheprovider"]
    learner = subprocess.run(run, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert learner.returncode == 0, learner.stdout[-3000:]
    assert "phase1_data_parallel/allreduce.py hold your code" in learner.stdout, learner.stdout[-3000:]
    ci = subprocess.run([*run, "-x"], cwd=root, capture_output=True, text=True, timeout=300, env={**env, "CI": "true"})
    assert ci.returncode == 1 and "stale templates ['phase1_data_parallel/allreduce.py']" in ci.stdout, \
        ci.stdout[-3000:]


def test_make_template_replaces_exercise_bodies():
    source = "def f(x):\n    '''doc'''\n    # EXERCISE 9.9: add one\n    y = x + 1\n    return y\n    # END EXERCISE\n"
    assert make_templates.make_template(source) == (
        "def f(x):\n    '''doc'''\n    raise NotImplementedError('TODO 9.9: add one')\n")


def test_every_hint_is_within_the_cap():
    """make_templates --check names a hint longer than HINT_CAP characters (its file and line; trailing blanks
    do not count), so the rest of it goes to the guidelines' "Stuck?" section; every solution's hints are within it."""
    cap = make_templates.HINT_CAP
    source = (f"def f():\n    # EXERCISE 9.9: {'x' * cap}   \n    pass\n    # END EXERCISE\n"
              f"    # EXERCISE 9.9: {'y' * (cap + 1)}\n    pass\n    # END EXERCISE\n")
    found = make_templates.long_hints(source, "f.py")
    assert len(found) == 1 and found[0].startswith("f.py:5: ") and f"has {cap + 1} characters" in found[0], found
    too_long = [line for src, _ in make_templates.template_pairs()
                for line in make_templates.long_hints(src.read_text(), src.relative_to(ROOT).as_posix())]
    assert not too_long, "hints over the cap (move the detail to the guidelines' Stuck? section):\n" + \
        "\n".join(too_long)


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
    learner = set() if grading.pristine_checks_required() else set(make_templates.templates_with_learner_code())
    for src, dst in make_templates.template_pairs():
        if dst.relative_to(ROOT).as_posix() not in learner:  # a learner may add helpers of their own
            assert _public_api(dst) == _public_api(src), f"{dst.relative_to(ROOT)} and its solution differ in API"


def test_every_exercise_has_markers_and_every_marker_an_exercise():
    marked = {}
    for src, _ in make_templates.template_pairs():
        module = src.relative_to(ROOT / "solutions").parts[1].removesuffix(".py")  # a package's files: its name
        for ex in make_templates.exercise_ids(src.read_text()):
            marked.setdefault(ex, []).append(module)
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
    _pristine_checkout(tmp_path)
    shutil.copy(ROOT / "solutions" / "phase1_data_parallel" / "comm_bench.py", tmp_path / "phase1_data_parallel")
    report = tmp_path / "grades.json"
    proc = subprocess.run([sys.executable, "tests/grade.py", "--checkout", str(tmp_path), "--json", str(report),
                           "-k", "1_3_bandwidths or 1_3_fit or 1_1_bad"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert out.startswith(f"grading the learner checkout {tmp_path}: its phase folders"), out[:500]
    got = json.loads(report.read_text())
    rows = {r["exercise"]: r["status"] for r in got["exercises"]}
    assert rows == {"1.1": "todo", "1.3": "pass"}, (rows, out[-2000:])
    assert set(got) == {"graded", "exercises", "counts", "tests", "durations"}, "no field the docs do not explain"
    assert got["counts"] == {"pass": 1, "fail": 0, "todo": 1}, got["counts"]
    # the console: every test named once, each TODO hint once and whole, the verdict last
    for nodeid in got["tests"]:
        assert out.count(nodeid.split("::")[-1] + "\n") == 1, (nodeid, out[-3000:])
    hint = next(line for line in out.splitlines() if line.strip().startswith("TODO 1.1:")).strip()
    assert out.count(hint) == 1 and hint.endswith(tuple("abcdefghijklmnopqrstuvwxyz)")), out[-3000:]
    assert "YOUR CODE" not in out and "short test summary" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (f"1/2 exercises pass (0 FAIL, 1 TODO), of the tests run (1.1, 1.3: "
                                            f"not all their tests ran); the table and every test's outcome are in "
                                            f"{report}"), out[-1000:]


def test_asking_for_code_that_python_did_not_load_is_an_error(tmp_path):
    with pytest.raises(grading.WrongCodeLoaded):
        grading.ModuleRef("1.1", "solution", str(tmp_path)).load()


def test_todo_is_recognised_directly_and_behind_a_world():
    assert grading.todo_of(NotImplementedError("TODO 1.2: do it")) == "TODO 1.2: do it"
    failure = RankFailure(1, "NotImplementedError", "TODO 1.4: sync", "tb")
    assert grading.todo_of(WorldError("rank 1 raised", {1: failure})) == "TODO 1.4: sync"
    assert grading.todo_of(NotImplementedError("something else")) is None
    assert grading.todo_of(AssertionError("TODO 1.1")) is None


def test_learner_run_reports_todo_without_tracebacks(tmp_path):
    _pristine_checkout(tmp_path)
    proc = subprocess.run([sys.executable, "tests/test_phase1.py", "-k", "1_3_bandwidths or 1_1_bad",
                           f"--learner-root={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert out.startswith("GRADING YOUR CODE"), out[:300]
    assert "TODO 1.3:" in out and "phase1_data_parallel/guidelines.md, section 1.3" in out, out
    assert "Traceback" not in out and "raise NotImplementedError" not in out, out
    assert out.count("TODO 1.1: ") == 1 and "TODO 1.1, as above" in out, "each hint in full once"
    assert proc.returncode == 1
    # it ends with the table and a verdict counting TODO apart from FAIL; no pytest summary after them
    tail = out[out.rindex("exercise status"):].strip().splitlines()
    assert tail[-1] == "0/2 exercises pass (0 FAIL, 2 TODO), of the tests run (1.1, 1.3: not all their tests " \
                       "ran); next: exercise 1.1, read phase1_data_parallel/guidelines.md, section 1.1", out[-1500:]
    assert "short test summary" not in out and not any(line.startswith("FAILED") for line in tail), out[-1500:]


def test_a_failing_exercise_opens_with_one_line_per_function():
    """A negative control breaks one function of 1.2 (recursive doubling on 3 and 6 ranks): the
    report says the two other strategies are ok, names the broken one, and shows each kind of
    message once across world sizes."""
    control = ROOT / "tests" / "negative_controls" / "phase1" / "allreduce_doubling_drops_extra_ranks.py"
    proc = subprocess.run([sys.executable, "tests/test_phase1.py", "-k", "1_2", f"--override=1.2={control}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    report = out[out.index("1.2 All-reduce strategies from primitives: FAIL"):].splitlines()
    header = re.fullmatch(r"1\.2 All-reduce strategies from primitives: FAIL, (\d+) of (\d+) tests pass", report[0])
    # how many tests 1.2 has is phase 1's business; the control fails exactly the [3] and [6] cases
    assert header and int(header[2]) - int(header[1]) == 2, report[:5]
    functions = [line.split() for line in report[1:4]]
    assert [f[:2] for f in functions] == [["allreduce_reduce_broadcast", "ok"], ["allreduce_gather_sum", "ok"],
                                          ["allreduce_recursive_doubling", "WRONG:"]], report[:5]
    assert report[3].split("WRONG: ", 1)[1].startswith("recursive_doubling("), report[3]
    kinds = [line for line in report if line.startswith("  - ")]
    assert 1 <= len(kinds) <= 3, kinds  # one line per kind of message, not one per case and rank
    assert all("test_1_2_strategies_equal_dist_all_reduce[3, 6]" in line for line in kinds), kinds
    assert out.strip().splitlines()[-1].startswith("0/1 exercises pass (1 FAIL, 0 TODO); next: fix 1.2"), out[-500:]


def test_the_report_puts_the_most_specific_failure_first():
    """A callee's failure comes before its callers' (it is their cause); collapsed messages
    keep their first instance whole."""
    row = {"exercise": "3.1", "title": "Ring", "status": "fail", "passed": 1, "tests": 4}
    caller = "ring_all_reduce(float32, shape (6,), op='sum') on rank {r} of {p}: the whole tensor differs"
    callee = "ring_reduce_scatter(float32, shape (6,), op='sum') on rank {r} of {p}: this rank's own chunk differs"
    records = [{"test": f"test_3_1_x[{p}]", "outcome": "fail", "where": None,
                "lines": [caller.format(r=r, p=p) for r in range(p)] + [callee.format(r=r, p=p) for r in range(p)]}
               for p in (2, 3)] + [{"test": "test_3_1_y", "outcome": "pass", "lines": [], "where": None}]
    lines = grading.exercise_report(row, records)
    assert lines[1].split() == ["ring_neighbours", "ok"], lines
    assert lines[2].startswith("  ring_reduce_scatter  WRONG: ring_reduce_scatter(float32, shape (6,), op='sum') "
                               "on rank 0 of 2"), lines
    assert "fix that first" in lines[4] and lines[4].lstrip().startswith("ring_all_reduce"), lines
    kinds = [line for line in lines if line.startswith("  - ")]
    assert kinds == [f"  - {callee.format(r=0, p=2)}  [5x in test_3_1_x[2, 3]]",
                     f"  - {caller.format(r=0, p=2)}  [5x in test_3_1_x[2, 3]]"], kinds


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


_TODO_SIBLING = '''"""A learner's unfinished 4.1."""


def load_verified(path, map_location="cpu"):
    raise NotImplementedError("TODO 4.1: check the footer before torch.load sees the bytes")
'''

_CALL_TIME_IMPORTS = '''"""A learner's 4.2 that imports 4.1 only inside its functions, when they are called."""


def relative():
    from .checkpoint import load_verified
    return load_verified


def absolute():
    from phase4_production.checkpoint import load_verified
    return load_verified


def sibling_module():
    from . import checkpoint
    return checkpoint


def dotted():
    import phase4_production.checkpoint
    return phase4_production.checkpoint.load_verified


def itself():
    from . import recovery
    from phase4_production.recovery import itself as again
    return recovery, again


def resume(path):
    from .checkpoint import load_verified
    return load_verified(path)
'''

_PROBE = '''"""What a learner's module gets from its call-time imports, in this process and in a rank."""
import json
import sys

import grading
from common.launch import run_world


def look(ref):
    mod = ref.load()
    reference = grading.reference("4.1")
    recovery, again = mod.itself()
    return {"file": mod.__file__,
            "relative": mod.relative() is reference.load_verified,
            "absolute": mod.absolute() is reference.load_verified,
            "sibling_module": mod.sibling_module() is reference,
            "dotted": mod.dotted() is reference.load_verified,
            "itself": recovery is mod and again is mod.itself,
            "resume": mod.resume(sys.argv[2])}


if __name__ == "__main__":
    ref = grading.ModuleRef("4.2", "learner", sys.argv[1])
    from grading_probe import look as rank_look  # importable by the ranks
    print(json.dumps({"here": look(ref), "rank": run_world(rank_look, 1, args=(ref,))[0]}))
'''


def test_a_learner_module_gets_the_reference_from_call_time_imports(tmp_path):
    """An import that a learner's function runs when called (`from .checkpoint import
    load_verified` inside resume, or the absolute `from phase4_production.checkpoint import
    ...`) gets the reference of the other exercise, never the learner's unfinished one, in
    the grading process and in a rank; an import of the module itself stays the learner's."""
    checkout = tmp_path / "checkout"
    (checkout / "phase4_production").mkdir(parents=True)
    (checkout / "phase4_production" / "__init__.py").write_text("")
    (checkout / "phase4_production" / "checkpoint.py").write_text(_TODO_SIBLING)
    (checkout / "phase4_production" / "recovery.py").write_text(_CALL_TIME_IMPORTS)
    (tmp_path / "grading_probe.py").write_text(_PROBE)
    saved = tmp_path / "state.pt"
    grading.reference("4.1").atomic_save({"step": 3}, saved)
    path = os.pathsep.join([str(checkout), str(tmp_path), str(ROOT), str(ROOT / "tests")])
    proc = subprocess.run([sys.executable, str(tmp_path / "grading_probe.py"), str(checkout), str(saved)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for where, seen in got.items():
        assert seen.pop("file") == str(checkout / "phase4_production" / "recovery.py"), (where, seen)
        assert seen == {"relative": True, "absolute": True, "sibling_module": True, "dotted": True, "itself": True,
                        "resume": {"step": 3}}, (where, seen)


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

@pytest.mark.parametrize("case", [1, 2, 3])
def test_1_1_cases(case, grade):
    assert not ("bad" in grade("1.1").path().name and case == 2)

def test_1_1_never_named(grade):
    assert False
'''


def test_controls_run_each_named_test_once_per_control(tmp_path):
    """`pytest --controls`: one session, each test against each control naming it, and a
    deadlock of one control does not cut short another's tests. One case of a test that
    rejects a control is enough: that test's later cases skip for it, not for the others."""
    (tmp_path / "test_fake.py").write_text(_FAKE_CONTROL_TESTS)
    for name in ("bad_slow", "good"):
        (tmp_path / f"{name}.py").write_text("")
    spec = [{"name": "bad_slow", "exercise": "1.1", "path": str(tmp_path / "bad_slow.py"), "world_timeout": 7,
             "caught_by": ["test_1_1_names", "test_1_1_other", "test_1_1_deadlocks", "test_1_1_deadline",
                           "test_1_1_cases"]},
            {"name": "good", "exercise": "1.1", "path": str(tmp_path / "good.py"),
             "caught_by": ["test_1_1_names", "test_1_1_deadlocks", "test_1_1_deadline", "test_1_1_cases"]}]
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
                        "test_1_1_deadline[bad_slow]": "pass", "test_1_1_deadline[good]": "fail",
                        "test_1_1_cases[bad_slow-1]": "pass", "test_1_1_cases[bad_slow-2]": "fail",
                        "test_1_1_cases[good-1]": "pass", "test_1_1_cases[good-2]": "pass",
                        "test_1_1_cases[good-3]": "pass"}, proc.stdout[-3000:]
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


def test_two_digit_exercise_ids_parse_sort_and_select_alone():
    """2.10 after 2.9: its tests are its own (test_2_10_... is not 2.1's), the table sorts it after 2.9 (not
    after 2.1), markers and TODOs parse it, and the command that reruns 2.1 alone does not select 2.10's tests
    (pytest's -k is a substring match: `-k 2_1` would)."""
    assert grading.exercise_of_test("test_2_10_route_top_k[4]") == "2.10"
    assert grading.exercise_of_test("test_2_1_scaled_loss") == "2.1"
    rows = grading.summarize({"t::test_2_10_a": "pass", "t::test_2_9_a": "pass", "t::test_2_1_a": "pass",
                              "t::test_2_2_a": "pass"})
    assert [r["exercise"] for r in rows] == ["2.1", "2.2", "2.9", "2.10"]
    source = "def f():\n    # EXERCISE 2.10: a hint\n    return 1\n    # END EXERCISE\n"
    assert make_templates.exercise_ids(source) == {"2.10"}
    assert "TODO 2.10: a hint" in make_templates.make_template(source)
    assert make_templates.STUB.match('    raise NotImplementedError("TODO 2.10: a hint")')["id"] == "2.10"
    names = _test_functions(ROOT / "tests" / "test_phase2.py")
    for exercise in [ex for ex in grading.EXERCISES if ex.startswith("2.")]:
        keyword = grading._rerun(exercise).rsplit(" -k ", 1)[1]
        selected = {name for name in names if keyword in name}  # pytest -k on a plain word: a substring of the name
        mine = {name for name in names if grading.exercise_of_test(name) == exercise}
        assert mine and selected - {n for n in selected if not grading.exercise_of_test(n)} == mine, (
            f"{grading._rerun(exercise)} selects {sorted(selected - mine)} too")
    assert grading._rerun("2.1").endswith("-k test_2_1_") and grading._rerun("2.4").endswith("-k 2_4")


# ---------------------------------------------------------------- what a run covers, by part (issue 37)

_PARTS_TESTS = '''
import pytest

@pytest.mark.part("stage 1")
def test_1_1_trains_stage1():
    pass

@pytest.mark.part("stage 1")
def test_1_1_saves_memory_stage1():
    pass

@pytest.mark.part("stage 2")
@pytest.mark.parametrize("world", [2, 3])
def test_1_1_trains_stage2(world):
    raise NotImplementedError("TODO 1.1: stage 2")

def test_1_1_refuses_bad_arguments():
    pass

def test_1_1_where_it_can_run():
    pytest.skip("needs another platform")

def test_1_2_other_exercise():
    pass
'''


def _run_fake(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """pytest with the course's conftest on _PARTS_TESTS, as the learner's runner: (stdout, the JSON report)."""
    (tmp_path / "test_parts.py").write_text(_PARTS_TESTS)
    report = tmp_path / "grades.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", str(tmp_path / "test_parts.py"), "-q",
                           "-rN", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "--course-runner=learner",
                           f"--grade-json={report}", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    return proc.stdout, json.loads(report.read_text())


def test_a_filtered_run_says_what_it_left_out_and_shows_each_part(tmp_path):
    """-k that selects one part of an exercise: its row passes, says how many of its tests ran, shows each
    part (stage 1 PASS, stage 2 and the unmarked tests not run), and the closing line sends the learner to
    the whole exercise instead of saying "all done". Unfiltered: each part's own status, and the row
    complete (a test skipped on this platform is not missing)."""
    out, got = _run_fake(tmp_path, "-k", "stage1")
    rows = {r["exercise"]: r for r in got["exercises"]}
    assert set(rows) == {"1.1"} and rows["1.1"]["status"] == "pass", out[-2000:]
    row = rows["1.1"]
    assert (row["tests"], row["collected"], row["complete"]) == (2, 6, False), row
    assert [(p["part"], p["status"], p["tests"], p["collected"]) for p in row["parts"]] == [
        ("stage 1", "pass", 2, 2), ("stage 2", "not run", 0, 2), ("shared", "not run", 0, 2)], row["parts"]
    table = out[out.rindex("exercise status"):]
    assert "2 of 6 of its tests selected" in table and "not its verdict" in table, table
    last = out.strip().splitlines()[-1]
    assert "all done" not in last and "1/1 exercises pass" in last and "not all its tests ran" in last, last
    assert "-k " in last and "1_1" in last, last

    out, got = _run_fake(tmp_path)  # a test that skips (another platform's) is no test left out
    rows = {r["exercise"]: r for r in got["exercises"]}
    assert rows["1.1"]["complete"] and rows["1.1"]["status"] == "todo", rows
    assert [(p["part"], p["status"], p["passed"], p["tests"]) for p in rows["1.1"]["parts"]] == [
        ("stage 1", "pass", 2, 2), ("stage 2", "todo", 0, 2), ("shared", "pass", 1, 1)], rows["1.1"]["parts"]
    assert "parts" not in rows["1.2"] and rows["1.2"]["status"] == "pass", rows["1.2"]
    table = out[out.rindex("exercise status"):].splitlines()
    assert [line.split()[:3] for line in table if line.startswith("           ")][:3] == [
        ["stage", "1", "PASS"], ["stage", "2", "TODO"], ["shared", "PASS", "1/1"]], table

    # in two processes (pytest -n 2, as CI runs the suite) the same rows: each worker's results merged
    out_n2, got_n2 = _run_fake(tmp_path, "-n", "2")
    assert got_n2["exercises"] == got["exercises"], out_n2[-2000:]
    assert out_n2[out_n2.rindex("exercise status"):] == out[out.rindex("exercise status"):], out_n2[-2000:]

    rows = grading.summarize({"t.py::test_1_2_other_exercise": "pass"},
                             {"t.py::test_1_1_a": {"part": None, "selected": False},
                              "t.py::test_1_2_other_exercise": {"part": None, "selected": True}})
    closing = grading.verdict(rows, left_out=grading.left_out({"t.py::test_1_1_a": {}}, {}))
    assert "all done" not in closing and "(1.1) did not run" in closing, closing


_PLANTED_4_6 = {  # function -> (the reference's text, the bug planted in its place)
    "_first_divergence": ('waiting = [r for r in sorted(holders) if holders[r]["state"] != "completed"]',
                          "waiting = [r for r in sorted(holders)]"),
    "diagnose": ('        if d["rank"] in by_rank:\n            raise ValueError(f"two dumps of rank {d[\'rank\']}")\n',
                 ""),
}


@pytest.mark.parametrize("planted", sorted(_PLANTED_4_6))
def test_the_report_names_the_function_a_bug_was_planted_in(tmp_path, planted):
    """One bug planted in one function of a copy of 4.6's reference (diagnose refuses no duplicate dump;
    _first_divergence counts every holder as waiting): 4.6's diagnose tests, run in this process as
    conftest.py runs them, give a report whose line for the planted function is WRONG and whose line for
    the other is not: the tests ask your _first_divergence apart (tests/phase4/test_4_6_hangs.py, _whose)."""
    import phase4.test_4_6_hangs as tests_4_6

    old, new = _PLANTED_4_6[planted]
    source = (ROOT / "solutions" / "phase4_production" / "hangs.py").read_text()
    assert source.count(old) == 1, f"hangs.py changed: update _PLANTED_4_6[{planted!r}]"
    path = tmp_path / f"planted_{planted.strip('_')}.py"
    path.write_text(source.replace(old, new))
    ref = grading.ModuleRef("4.6", "file", str(path))
    records = []
    for name in ("test_4_6_diagnose_names_who_diverged_and_where", "test_4_6_diagnose_refuses_incomplete_dumps",
                 "test_4_6_diagnose_agrees_with_the_contract_on_random_dumps"):
        try:
            getattr(tests_4_6, name)(lambda exercise: ref)
        except AssertionError as exc:
            records.append(grading.failure_record(name, "fail", exc, "4.6"))
        else:
            records.append(grading.failure_record(name, "pass", None, "4.6"))
    row = {"exercise": "4.6", "title": "Hung collectives", "status": "fail", "tests": len(records),
           "passed": sum(r["outcome"] == "pass" for r in records), "complete": True}
    lines = {line.split()[0]: line.split(None, 1)[1] for line in grading.exercise_report(row, records)[1:6]}
    other = next(name for name in _PLANTED_4_6 if name != planted)
    assert lines[planted].startswith("WRONG:"), (planted, lines)
    assert not lines[other].startswith("WRONG"), (planted, lines)
    assert not any(lines[m].startswith("WRONG") for m in lines if m.startswith("CollectiveRecorder")), lines


def test_blame_takes_a_line_at_its_word():
    """How a failure line is attributed: a line that opens with a function blames it alone; a method
    named inside a line ("dump() must ...") or an exception in it blames it or its class's other
    methods; a class names all its methods; a header or test name blames the function and its callees;
    nothing: cannot tell."""
    functions = grading.graded_functions("4.6")
    record = {"test": "test_4_6_x", "where": None, "header": ""}
    assert grading.blame("_first_divergence(group [0, 1], ...) returns x", record, functions) == \
        ("_first_divergence", ("_first_divergence",))
    fn, suspects = grading.blame("rank 0: after one more collective, dump() gives ...", record, functions)
    assert fn == "CollectiveRecorder.dump" and set(suspects) == {
        "CollectiveRecorder.__init__", "CollectiveRecorder.__call__", "CollectiveRecorder.dump"}, suspects
    assert grading.blame("CollectiveRecorder's dumps, group [0, 1]: ...", record, functions)[0] is None
    fn, suspects = grading.blame("a line", {**record, "test": "test_4_6_diagnose_x"}, functions)
    assert (fn, suspects) == ("diagnose", ("diagnose", "_first_divergence")), (fn, suspects)
    assert grading.blame("a line", record, functions) == (None, ())
    # a TODO is the function whose region's hint it is
    hint = next(f for f in functions if f.name == "_first_divergence").hints[0]
    assert grading._todo_function(f"TODO 4.6: {hint}", "test_4_6_x", functions) == "_first_divergence"


def _ring_planted_deadlock_rank(ref: grading.ModuleRef) -> None:
    """Both ranks run the planted ring_all_reduce; rank 1, whose planted ring_all_gather returns at once,
    moves on into the REFERENCE's ring_all_reduce (on a second group, so that its messages meet none of
    rank 0's), where it waits too: a rank in code that is not graded."""
    import torch.distributed as dist

    planted, reference = ref.load(), grading.reference("3.1")
    elsewhere = dist.new_group([0, 1])
    planted.ring_all_reduce(torch.ones(4))
    reference.ring_all_reduce(torch.ones(4), group=elsewhere)


def test_a_deadlock_is_reported_in_the_function_it_was_planted_in(tmp_path, monkeypatch):
    """A deadlock planted in ring_all_gather (3.1; rank 1 never passes its chunks on): rank 0 waits inside
    the planted ring_all_gather (called by ring_all_reduce), rank 1 has moved on into the reference's
    ring_all_reduce, whose file has the same name. The report calls ring_all_gather WRONG and nothing
    else: a rank's innermost frame of the graded file is where it waits (not its outermost, the caller),
    and a rank in the reference is no evidence. Without the graded file's path (only its name to go
    by), the two ranks disagree and the report cannot tell: it names no function wrongly."""
    import common.launch

    source = (ROOT / "solutions" / "phase3_multi_node" / "ring.py").read_text()
    anchor = "    rank, size, previous, following = ring_neighbours(group)\n    chunks = torch.tensor_split(tensor.view(-1), size)\n    for step in range(size - 1):\n        send_recv(chunks[(rank - step) % size], following"
    assert source.count(anchor) == 1, "ring.py's ring_all_gather changed: update this test's anchor"
    planted = tmp_path / "ring.py"  # the learner's file name, as the reference's
    planted.write_text(source.replace(anchor, anchor.replace(
        "ring_neighbours(group)\n", "ring_neighbours(group)\n    if rank == 1:\n        return tensor\n", 1)))
    ref = grading.ModuleRef("3.1", "file", str(planted))
    monkeypatch.setattr(common.launch, "DEFAULT_TIMEOUT_S", 5.0)
    with pytest.raises(WorldTimeout) as info:
        common.launch.run_world(_ring_planted_deadlock_rank, 2, args=(ref,))
    record = grading.failure_record("test_3_1_all_reduce", "fail", info.value, "3.1", graded=planted)
    assert record["where"] == "ring_all_gather" and record["waiting"] == ("ring_all_gather",), record
    row = {"exercise": "3.1", "title": "Ring", "status": "fail", "tests": 1, "passed": 0, "complete": True}
    report = grading.exercise_report(row, [record])
    lines = {line.split()[0]: line.split(None, 1)[1] for line in report[1:5]}
    assert lines["ring_all_gather"].startswith("WRONG"), report
    assert not any(lines[f].startswith("WRONG") for f in lines if f != "ring_all_gather"), report
    by_name = grading.failure_record("test_3_1_all_reduce", "fail", info.value, "3.1")  # the file's name only
    assert by_name["where"] is None and set(by_name["waiting"]) == {"ring_all_gather", "ring_reduce_scatter"}, by_name
    lines = {line.split()[0]: line.split(None, 1)[1] for line in grading.exercise_report(row, [by_name])[1:5]}
    assert not any(status.startswith("WRONG") for status in lines.values()), lines
    assert lines["ring_all_gather"].startswith("cannot tell: a deadlock (below) has ranks waiting here"), lines


def _dump(*frames: tuple[str, int, str]) -> str:
    """A rank's faulthandler dump (most recent call first) whose main thread is in `frames`, innermost first."""
    body = "".join(f'  File "{file}", line {line} in {func}\n' for file, line, func in frames)
    return ("Thread 0x00007f01 (most recent call first):\n  File \"/x/common/launch.py\", line 450 in "
            "_exit_when_orphaned\n\nCurrent thread 0x00007f02 (most recent call first):\n" + body +
            f'  File "{ROOT / "common" / "launch.py"}", line 508 in _rank_main\n')


def test_a_deadlock_whose_ranks_wait_in_different_functions_names_none():
    """3.4's servers wait in serve for a DONE to complete a round, its workers in run_worker for the reply
    (the bug may be on either side): the report says it cannot tell, naming both, and calls neither
    WRONG, though a rank's line reads "in run_worker"; a rank that finished is no evidence."""
    graded = ROOT / "phase3_multi_node" / "parameter_server.py"
    test = str(ROOT / "tests" / "phase3" / "test_3_4_parameter_server.py")
    stacks = {0: _dump((test, 257, "wait"), (str(graded), 191, "serve"), (test, 300, "_unequal_scenario")),
              2: _dump((str(ROOT / "tests" / "scenarios.py"), 80, "run_scenarios")),
              3: _dump((str(graded), 302, "pull"), (str(graded), 316, "run_worker"), (test, 319, "_unequal_scenario"))}
    exc = WorldTimeout("world of 5 ranks did not finish within 20s (a deadlock?).\nWhere each rank was waiting "
                       f"(innermost frame outside torch):\n  rank 0: {graded}:191 in serve (waiting inside "
                       f"distributed_c10d.py:recv)\n  rank 2: finished its work\n  rank 3: {graded}:316 in run_worker",
                       stacks, "")
    record = grading.failure_record("test_3_4_done_completes_a_round", "fail", exc, "3.4", graded=graded)
    assert record["where"] is None and record["waiting"] == ("ParameterServer.serve", "run_worker"), record
    row = {"exercise": "3.4", "title": "PS", "status": "fail", "tests": 1, "passed": 0, "complete": True}
    report = grading.exercise_report(row, [record])
    status = {line.split()[0]: line.split(None, 1)[1] for line in report[1:8]}
    assert not any(s.startswith("WRONG") for s in status.values()), report
    assert status["run_worker"] == "cannot tell: a deadlock (below) has ranks waiting here and in " \
                                   "ParameterServer.serve", report
    assert status["ParameterServer.serve"].startswith("cannot tell: a deadlock (below) has ranks waiting here"), report


def test_the_gathered_once_control_is_named_in_its_report_and_its_stage():
    """The negative control whose _pre_backward gathers on every output's gradient (2.4, stage 3), graded
    as a learner's run filtered to the two stage-3 tests that count the all-gathers: the report calls
    _pre_backward WRONG, the table shows stage 3 failing and stages 1 and 2 not run, and says the run
    is no verdict on all of 2.4."""
    control = ROOT / "tests" / "negative_controls" / "phase2" / "zero_stage3_gathers_for_every_output.py"
    proc = subprocess.run([sys.executable, "tests/test_phase2.py", "-k",
                           "test_2_4_unit_returning_a_tuple_stage3 or test_2_4_two_forwards_then_one_backward_stage3",
                           f"--override=2.4={control}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    report = out[out.index("2.4 ZeRO-style sharding: FAIL"):].splitlines()
    line = next(x for x in report if x.split()[:1] == ["ZeroStage3._pre_backward"])
    assert line.split(None, 1)[1].startswith("WRONG: _pre_backward gathers a unit that is whole already"), line
    assert not any(x.split()[1:2] == ["WRONG:"] for x in report[1:16] if x.split()[:1] != ["ZeroStage3._pre_backward"])
    table = out[out.rindex("exercise status"):].splitlines()
    parts = [x.split() for x in table if x.startswith("           ")]
    stage3 = next((x for x in parts if x[:6] == ["stage", "3", "FAIL", "0/2", "(2", "of"] and x[7:] == ["run)"]),
                  None)  # "stage 3 FAIL 0/2 (2 of N run)": N, however many tests stage 3 has, is more than 2
    assert stage3 is not None and int(stage3[6]) > 2, table
    assert any(x[:6] == ["stage", "1", "NOT", "RUN", "0", "of"] and int(x[6]) > 0 and x[7:] == ["run"]
               for x in parts), table
    assert "not its verdict" in "\n".join(table) and "all done" not in table[-1], table


_HIDE_AND_RUN = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
script = sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script,hidden", [("tests/test_phase1.py", "pytest"), ("tests/grade.py", "pytest"),
                                           ("tests/test_phase2.py", "torch,numpy")])
def test_grading_without_its_dependencies_says_the_install_command(script, hidden):
    """pytest (or torch) not installed: the learner's and the instructor's runners print one line, the
    command that installs the course into this Python, and exit 2; no ModuleNotFoundError traceback."""
    proc = subprocess.run([sys.executable, "-c", _HIDE_AND_RUN, hidden, script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"cannot grade: {hidden.replace(',', ', ')} ") and grading.install_command() in lines[0], \
        lines[0]
    assert proc.stdout == "", proc.stdout[-2000:]
