"""Grading plugin: choose the implementation, report TODOs briefly, print the score table.

    pytest                                   grade the reference solutions (the project's tests)
    pytest --impl learner tests/test_phase1.py   grade your templates (= python tests/test_phase1.py)
    pytest --override 1.2=path/to/file.py    grade one exercise with another file (negative controls)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# tests/phaseN/ hold one module per exercise; tests/test_phaseN.py imports them, so they
# are collected once, there, and their plain asserts are still rewritten by pytest.
collect_ignore_glob = ["phase[0-9]*"]
pytest.register_assert_rewrite("phase1", "phase2", "phase3", "phase4")

import grading
from common.launch import WorldTimeout

# The graded tests build CPU tensors inside their ranks: run them on gloo even where
# every rank could have a GPU (the solutions themselves pick NCCL on GPUs).
os.environ.setdefault("COURSE_BACKEND", "gloo")

_outcomes: dict[str, str] = {}
# test function -> the run of it whose world deadlocked: its other parametrizations
# (e.g. larger world sizes) would only wait out the same deadline again.
_deadlocked: dict[str, str] = {}


def pytest_addoption(parser):
    group = parser.getgroup("course grading")
    group.addoption("--impl", choices=("solution", "learner"), default="solution",
                    help="grade the reference solutions (default) or the learner's phase folders")
    group.addoption("--learner-root", default=str(grading.REPO_ROOT),
                    help="checkout whose phase folders are graded with --impl learner")
    group.addoption("--override", action="append", default=[], metavar="EX=FILE",
                    help="grade exercise EX with FILE instead (e.g. 1.2=tests/negative_controls/...)")
    group.addoption("--grade-json", metavar="PATH", help="also write the exercise table as JSON")


def _overrides(config) -> dict[str, str]:
    result = {}
    for item in config.getoption("--override"):
        ex, sep, path = item.partition("=")
        if not sep or ex not in grading.EXERCISES or not Path(path).is_file():
            raise pytest.UsageError(f"--override {item!r}: expected EX=FILE with a known exercise and an existing file")
        result[ex] = str(Path(path).resolve())
    return result


def _graded_description(config) -> str:
    if config.getoption("--impl") == "learner":
        root = Path(config.getoption("--learner-root")).resolve()
        text = f"GRADING YOUR CODE: the phase folders of {root} (not solutions/)"
    else:
        text = f"grading the REFERENCE SOLUTIONS in {grading.REPO_ROOT / 'solutions'} (your own code: python tests/test_phaseN.py)"
    for ex, path in _overrides(config).items():
        text += f"; exercise {ex} from {path}"
    return text


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config._course_graded = _graded_description(config)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(config._course_graded, bold=True)


def pytest_report_header(config):
    return config._course_graded


@pytest.fixture
def grade(request):
    """grade("1.2") -> ModuleRef of the code to grade for exercise 1.2."""
    config = request.config
    overrides = _overrides(config)

    def ref(exercise: str) -> grading.ModuleRef:
        if exercise in overrides:
            return grading.ModuleRef(exercise, "file", overrides[exercise])
        if config.getoption("--impl") == "learner":
            return grading.ModuleRef(exercise, "learner", str(Path(config.getoption("--learner-root")).resolve()))
        return grading.ModuleRef(exercise, "solution", str(grading.REPO_ROOT))

    return ref


def pytest_runtest_setup(item):
    first = _deadlocked.get(item.originalname)
    if first:
        pytest.fail(f"not run: {first} deadlocked (see that test); fix it first", pytrace=False)


def _deadlocked_world(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, WorldTimeout):
            return not exc.not_started  # a world too slow to start is no deadlock of the code
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and call.excinfo and _deadlocked_world(call.excinfo.value):
        _deadlocked.setdefault(item.originalname, item.nodeid.rsplit("::", 1)[-1])
    if report.when == "call" or (report.when == "setup" and report.failed):
        todo = grading.todo_of(call.excinfo.value) if call.excinfo else None
        if todo:
            ex = grading.EXERCISES.get(grading.exercise_of_test(item.name) or "")
            where = f" (read {ex.guidelines})" if ex else ""
            report.longrepr = f"{todo}{where}"
        death = None if todo or report.passed else grading.harness_error_of(call.excinfo.value if call.excinfo else None)
        if death:
            report.longrepr = (f"HARNESS ERROR, no verdict on the graded code: {death}\n"
                               "(a rank died without reporting, or the machine was too busy to start the world "
                               "in time): run the test again.\n\n"
                               f"{report.longrepr}")
        _outcomes[item.nodeid] = "todo" if todo else "pass" if report.passed else "error" if death else "fail"
    elif report.failed:  # teardown errors count against the test too
        _outcomes[item.nodeid] = "fail"


def pytest_terminal_summary(terminalreporter, config):
    rows = grading.summarize(_outcomes)
    if rows:
        terminalreporter.section("exercises")
        terminalreporter.write_line(config._course_graded)
        terminalreporter.write_line(grading.format_table(rows))
    path = config.getoption("--grade-json")
    if path:
        grading.write_json(Path(path), rows, _outcomes, config._course_graded)
