"""Contract coverage: fail on a documented input, mode or call sequence that no graded test exercised
and that its exercise's contract does not list as irrelevant with a reason (tests/contracts.py).

CI records during its one `pytest` run and checks afterwards, with no second run of the tests:

    COURSE_CONTRACTS=.contract-records pytest
    python tools/check_contracts.py --records .contract-records

By hand, one exercise or phase (runs the graded tests with recording on, then checks):

    python tools/check_contracts.py --run 1.1 2.4
    python tools/check_contracts.py --run --phase 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT)]
import contracts  # noqa: E402
import grading  # noqa: E402


def exercises_with_contracts(phases: list[int] | None = None) -> list[str]:
    return [ex for ex in grading.EXERCISES if contracts.contract_path(ex).exists()
            and (not phases or int(ex.split(".")[0]) in phases)]


def run_tests(exercises: list[str], folder: Path) -> int:
    """One pytest session per phase, recording into `folder`."""
    env = dict(os.environ, **{contracts.ENV: str(folder)})
    code = 0
    for phase in sorted({ex.split(".")[0] for ex in exercises}):
        mine = [ex for ex in exercises if ex.split(".")[0] == phase]
        selection = " or ".join(f"test_{ex.replace('.', '_')}_" for ex in mine)
        cmd = [sys.executable, "-m", "pytest", f"tests/test_phase{phase}.py", "-q", "-p", "no:cacheprovider",
               "--tb=line", "-k", selection]
        print("$ " + " ".join(cmd), flush=True)
        code |= subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode
    return code


def check(exercises: list[str], folder: Path, verbose: bool = False) -> list[str]:
    """Print each exercise's coverage; return the problems (gaps, stale irrelevance)."""
    exercised = contracts.read_records(folder)
    problems = []
    print(f"{'exercise':<9}{'entries':>8}{'exercised':>10}{'irrelevant':>11}{'of which deferred/pending':>27}"
          f"{'gaps':>6}")
    for ex in exercises:
        contract = contracts.load_contract(ex)
        report = contracts.coverage(contract, exercised.get(ex, {}))
        later = sum(1 for why in report["irrelevant"].values() if why.startswith(("deferred", "pending")))
        print(f"{ex:<9}{report['entries']:>8}{len(report['exercised']):>10}{len(report['irrelevant']):>11}{later:>27}"
              f"{len(report['gaps']):>6}")
        if not exercised.get(ex):
            problems.append(f"{ex}: no call of its public API was recorded: did its graded tests run with "
                            f"{contracts.ENV} set?")
            continue
        for gap in report["gaps"]:
            problems.append(f"{ex} {gap}: no graded test exercised it; add a test of it to "
                            f"tests/phase{ex.split('.')[0]}/, or list it in IRRELEVANT of "
                            f"{contracts.contract_path(ex).relative_to(REPO_ROOT)} with the reason")
        for key in report["unknown_irrelevant"]:
            problems.append(f"{ex}: IRRELEVANT lists {key!r}, which is no entry of its contract")
        if verbose:
            for key in report["irrelevant_but_exercised"]:
                print(f"  note: {key} is listed irrelevant but a test exercised it")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", help="exercise ids (default: every exercise with a contract)")
    parser.add_argument("--phase", type=int, action="append", help="only the exercises of these phases")
    parser.add_argument("--records", type=Path, help="the folder a COURSE_CONTRACTS=<folder> pytest run recorded into")
    parser.add_argument("--run", action="store_true", help="run the exercises' graded tests, recording, first")
    parser.add_argument("-v", "--verbose", action="store_true", help="also name the irrelevant entries tests exercise")
    args = parser.parse_args(argv)
    exercises = args.exercises or exercises_with_contracts(args.phase)
    unknown = [ex for ex in exercises if not contracts.contract_path(ex).exists()]
    if unknown:
        parser.error(f"no contract file for {', '.join(unknown)} ({contracts.contract_path(unknown[0])})")
    if not args.run and args.records is None:
        parser.error("give --records FOLDER (from a COURSE_CONTRACTS=FOLDER pytest run) or --run")
    if args.run:
        folder = args.records or Path(tempfile.mkdtemp(prefix="course-contracts-"))
        folder.mkdir(parents=True, exist_ok=True)
        if run_tests(exercises, folder):
            print("(some graded tests failed: the coverage below counts the calls they made all the same)")
    else:
        folder = args.records
        if not folder.is_dir():
            parser.error(f"{folder} is no folder of records")
    problems = check(exercises, folder, args.verbose)
    for problem in problems:
        print(problem)
    print(f"contract coverage: {len(problems)} problem(s) in {len(exercises)} exercises" if problems else
          f"contract coverage: every documented entry of {len(exercises)} exercises is exercised or listed irrelevant")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
