"""Instructor's command: grade a learner's checkout, write the exercise table as JSON.

    python tests/grade.py --checkout /path/to/learner/repo --json grades.json [pytest args]

The tests, the harness and the reference come from THIS repository; only the learner's
phase folders (phase1_data_parallel/, ...) are taken from the checkout, so a learner
cannot change how they are graded.

The console lists every graded test once, by exercise (PASS / FAIL / TODO / ERROR, a
failure's first line, each TODO hint once), then a report of each failing exercise, the
exercise table and a one-line verdict. The JSON file holds:

    graded      which code was graded, from where
    exercises   one row per exercise: status (pass / fail / todo), tests passed, failed,
                todo, errors (harness errors: a rank died outside the graded code; no
                verdict, run again), and the guidelines section; how much of it ran
                (collected, selected, not_run, uncollected test functions, complete: false
                when pytest args left some of its tests out); for an exercise in parts,
                parts: the same counts and status per part (tests/grading.py)
    counts      exercises by status: {"pass": n, "fail": n, "todo": n}
    tests       every test's outcome, {test id: "pass" | "fail" | "todo" | "error"}
    durations   every test's seconds, {test id: seconds}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]  # grading.py, however this file is run
import grading  # noqa: E402  (standard library only: it can say what to install)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=str(HERE.parent), help="learner's repository (default: this one)")
    parser.add_argument("--json", default="grades.json", help="where to write the table (default: grades.json)")
    args, pytest_args = parser.parse_known_args(argv)
    grading.require_dependencies()
    import pytest
    checkout = Path(args.checkout).resolve()
    if not (checkout / "phase1_data_parallel").is_dir():
        parser.error(f"{checkout} has no phase1_data_parallel/ folder: is it a checkout of this course?")
    tests = sorted(str(p) for p in HERE.glob("test_phase*.py"))
    # --tb=no, -rN: the listing of tests and the exercise reports (conftest.py) say it all, once
    code = pytest.main([*tests, "--impl", "learner", f"--learner-root={checkout}", f"--grade-json={args.json}",
                        "--course-runner=instructor", "-q", "--tb=no", "-rN", "-p", "no:cacheprovider", *pytest_args])
    return 0 if code in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) else int(code)


if __name__ == "__main__":
    sys.exit(main())
