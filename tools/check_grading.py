"""Prove the graded tests are honest (CI runs this).

1. On the untouched templates, every graded test must be reported TODO: a test the
   templates pass grades nothing.
2. Every negative control (tests/negative_controls/phaseN/*.py: the reference with one
   mistake learners make) must be rejected: each test it names in CAUGHT_BY must fail
   by an assertion or an exception of the control's code, not as TODO and not by a
   harness error (outcome "error": a rank died without reporting, or the world could
   not even start before its deadline). A control whose bug deadlocks may set
   WORLD_TIMEOUT = <seconds> (the most its tests' worlds need), so that the deliberate
   deadlock is ended sooner than the default 60 s.

    python tools/check_grading.py              # all phases
    python tools/check_grading.py --phase 1    # one phase
    python tools/check_grading.py --phase 2 --only zero_ --no-templates   # some controls only
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
import grading  # noqa: E402
CONTROLS = REPO_ROOT / "tests" / "negative_controls"


def read_control(path: Path) -> dict:
    """EXERCISE, CAUGHT_BY and the docstring of a control, read without importing it."""
    tree = ast.parse(path.read_text())
    found = {"path": path, "doc": (ast.get_docstring(tree) or "").splitlines()[0:1]}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("EXERCISE", "CAUGHT_BY", "WORLD_TIMEOUT"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    if "EXERCISE" not in found or not found.get("CAUGHT_BY"):
        raise SystemExit(f"{path}: a negative control needs EXERCISE = 'x.y' and CAUGHT_BY = [test names]")
    found["doc"] = found["doc"][0] if found["doc"] else path.stem
    return found


def run_pytest(test_file: Path, extra: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Run one pytest session in a subprocess; return {test nodeid: pass|fail|error|todo}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "grades.json"
        cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "--tb=no", "-p", "no:cacheprovider",
               f"--grade-json={report}", *extra]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, **(env or {})))
        if not report.exists():
            raise SystemExit(f"pytest wrote no report for {' '.join(cmd)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(report.read_text())["tests"]


def check_templates(test_file: Path) -> list[str]:
    outcomes = run_pytest(test_file, ["--impl", "learner"])
    graded = {k: v for k, v in outcomes.items() if grading.exercise_of_test(k.split("::")[-1])}
    if not graded:
        return [f"{test_file.name}: no graded test ran"]
    bad = [f"{k}: {v} on the untouched templates (expected todo)" for k, v in graded.items() if v != "todo"]
    print(f"templates: {len(graded) - len(bad)}/{len(graded)} graded tests of {test_file.name} report TODO")
    return bad


def check_control(test_file: Path, control: dict) -> str | None:
    names = control["CAUGHT_BY"]
    started = time.monotonic()
    # A control whose bug deadlocks a world may say how long a world of its tests needs at most
    # (WORLD_TIMEOUT, seconds), so that its deliberate deadlock is not waited out for 60 s.
    env = {"COURSE_WORLD_TIMEOUT": str(control["WORLD_TIMEOUT"])} if "WORLD_TIMEOUT" in control else None
    outcomes = run_pytest(test_file, ["--override", f"{control['EXERCISE']}={control['path']}", "-k", " or ".join(names)],
                          env=env)
    problems, deaths = [], []
    for name in names:
        results = [v for k, v in outcomes.items() if k.split("::")[-1].split("[")[0] == name]
        if "error" in results:
            deaths.append(name)
        if not results:
            problems.append(f"{name} did not run")
        elif "fail" not in results and "error" in results:
            problems.append(f"{name} 'rejected' it only by a harness error (a rank died without reporting, "
                            "or the world could not start in time), not by an assertion: run it again")
        elif "fail" not in results:
            problems.append(f"{name} did not reject it ({', '.join(sorted(set(results)))})")
    verdict = "REJECTED" if not problems else "ACCEPTED"
    seconds = time.monotonic() - started
    print(f"{verdict:9}{control['EXERCISE']} {control['path'].stem} ({seconds:.0f} s): {control['doc']}", flush=True)
    if deaths:
        print(f"{'':9}harness error, not an assertion, in {', '.join(deaths)}: that does not count as rejecting")
    return f"{control['path'].name}: " + "; ".join(problems) if problems else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", type=int, action="append", help="only these phases (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest sessions at once")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="only the controls whose file name contains TEXT (repeatable)")
    parser.add_argument("--no-templates", action="store_true", help="skip the check of the templates")
    args = parser.parse_args(argv)
    os.environ.setdefault("COURSE_WORLD_TIMEOUT", "60")
    templates, controls = [], []
    for test_file in sorted((REPO_ROOT / "tests").glob("test_phase*.py")):
        if not test_file.stem.removeprefix("test_phase").isdigit():
            continue
        phase = int(test_file.stem.removeprefix("test_phase"))
        if args.phase and phase not in args.phase:
            continue
        if not args.no_templates:
            templates.append(test_file)
        controls += [(test_file, read_control(p)) for p in sorted((CONTROLS / f"phase{phase}").glob("*.py"))
                     if not args.only or any(text in p.name for text in args.only)]
    # One pool for every check of every phase, so no slot idles while a slow one ends a phase.
    jobs = [(check_templates, (f,)) for f in templates] + [(check_control, job) for job in controls]
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(lambda job: job[0](*job[1]), jobs):
            failures += result if isinstance(result, list) else [result] if result else []
    if failures:
        print("\nThe graded tests are NOT honest:\n  " + "\n  ".join(failures))
        return 1
    print("\ngrading is honest: templates are all TODO and every negative control is rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
