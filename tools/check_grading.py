"""Prove the graded tests are honest (CI runs this).

1. On the untouched templates, every graded test must be reported TODO: a test the
   templates pass grades nothing.
2. Every negative control must be sound, then rejected. A control (tests/negative_controls/
   phaseN/*.py) is the reference with one mistake learners make, written as the reference
   plus named replacements spliced in at load time (tests/controls.py has the whole format):

       \"\"\"One line: the mistake (this run prints it).\"\"\"
       EXERCISE = "4.1"
       CAUGHT_BY = ["test_4_1_failed_save_keeps_previous_checkpoint"]
       EDITS = {"CheckpointManager.save": [(old_lines, new_lines)]}   # lines of one definition
       def capture_rng(): ...        # a function of the reference, replaced
       class ZeroStage3:             # a class of the reference: these methods replaced
           def _pre_backward(self, unit): ...

   Everything it does not name IS the reference (its callers of a replaced function meet
   the replacement), so a control cannot drift from it. (The older spelling, `from <the
   reference> import *` and overrides, still loads, under the same check.) Sound: the
   control loads, what it replaces or edits exists in the reference and differs from it,
   and the loaded module's functions and methods are the reference's outside the names it
   declares. A control that is not sound is BROKEN (not run; the check fails): one that
   cannot load would fail every test it names and look rejected.
   Rejected: each test it names in CAUGHT_BY must fail
   by an assertion or an exception of the control's code, not as TODO and not by a
   harness error (outcome "error": a rank died without reporting, or the world could
   not even start before its deadline). A control whose bug deadlocks may set
   WORLD_TIMEOUT = <seconds> (the most its tests' worlds need), so that the deliberate
   deadlock is ended sooner than the default 60 s. The controls of a few exercises of one
   phase share one pytest session (`pytest --controls`), each test running once per
   control that names it (one rejecting case is enough: a parametrized test's later cases
   skip for a control an earlier one rejected).

    python tools/check_grading.py              # all phases
    python tools/check_grading.py --phase 1    # one phase
    python tools/check_grading.py --phase 2 --only zero_ --no-templates   # some controls only
    python tools/check_grading.py --phase 2 --only 2.4    # one exercise: its controls, its tests on the templates
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
import controls as negative_controls  # noqa: E402
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


def run_pytest(test_file: Path, extra: list[str], timeout: float = 900) -> dict:
    """Run one pytest session in a subprocess; return its --grade-json report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "grades.json"
        cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "--tb=no", "-p", "no:cacheprovider",
               f"--grade-json={report}", *extra]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if not report.exists():
            raise SystemExit(f"pytest wrote no report for {' '.join(cmd)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(report.read_text())


def check_templates(test_file: Path, exercises: list[str] | None = None) -> list[str]:
    """Every graded test of `test_file` (only those of `exercises`, if given) reports TODO on the templates."""
    only = ["-k", " or ".join(f"test_{ex.replace('.', '_')}_" for ex in exercises)] if exercises else []
    outcomes = run_pytest(test_file, ["--impl", "learner", *only])["tests"]
    graded = {k: v for k, v in outcomes.items() if grading.exercise_of_test(k.split("::")[-1])
              and (not exercises or grading.exercise_of_test(k.split("::")[-1]) in exercises)}
    if not graded:
        return [f"{test_file.name}: no graded test ran"]
    bad = [f"{k}: {v} on the untouched templates (expected todo)" for k, v in graded.items() if v != "todo"]
    print(f"templates: {len(graded) - len(bad)}/{len(graded)} graded tests of {test_file.name} report TODO")
    return bad


def check_splices(controls: list[dict]) -> tuple[list[str], set[str]]:
    """Each control loads, replaces only what its reference has, and changes nothing it does not
    name (tests/controls.py); a control that fails this is BROKEN: it is not run, and the check fails.
    (A control that cannot load would otherwise fail every test it names, and count as rejected.)"""
    failures, broken = [], set()
    for control in controls:
        for problem in negative_controls.problems(control["path"]):
            print(f"{'BROKEN':9}{control['EXERCISE']} {problem}", flush=True)
            failures.append(problem)
            broken.add(control["path"].name)
    return failures, broken


def check_controls(test_file: Path, controls: list[dict]) -> list[str]:
    """Run these controls (of one phase) in one pytest session (one `import torch`, one
    forkserver), each test of its CAUGHT_BY against it; return the problems found."""
    spec = [{"name": c["path"].stem, "exercise": c["EXERCISE"], "path": str(c["path"]),
             "caught_by": c["CAUGHT_BY"], "world_timeout": c.get("WORLD_TIMEOUT")} for c in controls]
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "controls.json"
        listing.write_text(json.dumps(spec))
        report = run_pytest(test_file, [f"--controls={listing}"], timeout=600 + 180 * len(controls))
    return [problem for control in controls if (problem := _verdict(control, report))]


def _verdict(control: dict, report: dict) -> str | None:
    """Print whether this control was rejected; return the problem if it was not."""
    mine = {k: v for k, v in report["tests"].items() if report.get("controls", {}).get(k) == control["path"].stem}
    problems, deaths = [], []
    for name in control["CAUGHT_BY"]:
        results = [v for k, v in mine.items() if k.split("::")[-1].split("[")[0] == name]
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
    seconds = sum(report.get("durations", {}).get(k, 0.0) for k in mine)
    print(f"{verdict:9}{control['EXERCISE']} {control['path'].stem} ({seconds:.0f} s): {control['doc']}", flush=True)
    if deaths:
        print(f"{'':9}harness error, not an assertion, in {', '.join(deaths)}: that does not count as rejecting")
    return f"{control['path'].name}: " + "; ".join(problems) if problems else None


SESSION_CONTROLS = 40  # controls per pytest session at most (an exercise with more has one of its own)


def _sessions(by_exercise: dict[tuple[Path, str], list[dict]]) -> list[tuple[Path, list[dict]]]:
    """The exercises of each test file, in order, packed into sessions of at most SESSION_CONTROLS
    controls (27 sessions of one exercise each cost CI a minute of starting up)."""
    sessions: list[tuple[Path, list[dict]]] = []
    for (test_file, _), group in by_exercise.items():
        if sessions and sessions[-1][0] == test_file and len(sessions[-1][1]) + len(group) <= SESSION_CONTROLS:
            sessions[-1][1].extend(group)
        else:
            sessions.append((test_file, list(group)))
    return sessions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", type=int, action="append", help="only these phases (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest sessions at once")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="only the controls whose file name contains TEXT, or whose exercise is TEXT (an "
                             "exercise id such as 2.4 also limits the template check to its tests); repeatable")
    parser.add_argument("--no-templates", action="store_true", help="skip the check of the templates")
    args = parser.parse_args(argv)
    os.environ.setdefault("COURSE_WORLD_TIMEOUT", "60")
    templates, controls = [], []
    exercises = [text for text in args.only or [] if text in grading.EXERCISES]
    for test_file in sorted((REPO_ROOT / "tests").glob("test_phase*.py")):
        if not test_file.stem.removeprefix("test_phase").isdigit():
            continue
        phase = int(test_file.stem.removeprefix("test_phase"))
        if args.phase and phase not in args.phase:
            continue
        if not args.no_templates and (not exercises or any(ex.split(".")[0] == str(phase) for ex in exercises)):
            templates.append(test_file)
        read = [read_control(p) for p in sorted((CONTROLS / f"phase{phase}").glob("*.py"))]
        controls += [(test_file, c) for c in read
                     if not args.only or any(text in c["path"].name or text == c["EXERCISE"] for text in args.only)]
    # Sessions of whole exercises' controls, up to SESSION_CONTROLS each (a session's start,
    # `import torch` and its fork server, costs more than many a control), the largest first;
    # one pool for every check of every phase, so no slot idles while a slow one ends a phase.
    failures, broken = check_splices([control for _, control in controls])
    by_exercise: dict[tuple[Path, str], list[dict]] = {}
    for test_file, control in controls:
        if control["path"].name not in broken:  # a control that does not load rejects nothing
            by_exercise.setdefault((test_file, control["EXERCISE"]), []).append(control)
    sessions = _sessions(by_exercise)
    jobs = [(check_controls, (test_file, group)) for test_file, group in sorted(sessions, key=lambda s: -len(s[1]))]
    jobs += [(check_templates, (f, exercises)) for f in templates]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(lambda job: job[0](*job[1]), jobs):
            failures += result
    if failures:
        print("\nThe graded tests are NOT honest:\n  " + "\n  ".join(failures))
        return 1
    print("\ngrading is honest: templates are all TODO and every negative control is sound and rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
