"""Grading plugin: choose the implementation, report TODOs briefly, print the score table.

    pytest                                   grade the reference solutions (the project's tests)
    pytest --impl learner tests/test_phase1.py   grade your templates (= python tests/test_phase1.py)
    pytest --override 1.2=path/to/file.py    grade one exercise with another file (negative controls)
    pytest --override 2.4=path/to/zero/      ... or another package (2.4's is one: zero/)
    pytest --controls controls.json          run each control's CAUGHT_BY tests against it, all
                                             controls in this one session (tools/check_grading.py)
    pytest --contract-coverage               also record which documented inputs the graded tests
                                             exercise and report the gaps (tests/contracts.py;
                                             COURSE_CONTRACTS=<folder> records for tools/check_contracts.py)
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

# tests/phaseN/ hold one module per exercise; tests/test_phaseN.py imports them, so they
# are collected once, there, and their plain asserts are still rewritten by pytest.
collect_ignore_glob = ["phase[0-9]*"]
pytest.register_assert_rewrite("phase1", "phase2", "phase3", "phase4")

import common.launch
import contracts
import grading
from common.launch import WorldTimeout

# The graded tests build CPU tensors inside their ranks: run them on gloo even where
# every rank could have a GPU (the solutions themselves pick NCCL on GPUs).
os.environ.setdefault("COURSE_BACKEND", "gloo")

_outcomes: dict[str, str] = {}
_durations: dict[str, float] = {}  # test nodeid -> seconds of setup + call + teardown
_control_of: dict[str, str] = {}  # test nodeid -> the negative control it ran against (--controls)
# (test function, control) -> the run of it whose world deadlocked: its other parametrizations
# (e.g. larger world sizes) would only wait out the same deadline again.
_deadlocked: dict[tuple[str, str | None], str] = {}
# (test function, control) that failed: a control needs one rejecting case of each test it names, so the
# function's other cases (world sizes, layouts) skip (--controls only; a learner's run shows every case)
_rejected: set[tuple[str, str]] = set()
_records: dict[str, dict] = {}  # test nodeid -> grading.failure_record (what the exercise reports need)
_hints_shown: set[str] = set()  # TODO hints already printed in full once
# Every graded test the session collected, in collection order, {nodeid: {"part", "selected"}}: those
# a filter (-k, -m, --deselect) left out too, so the table says when an exercise did not run whole.
_collected: dict[str, dict] = {}
_uncollected: dict[str, list[str]] = {}  # exercise -> its test functions the session never collected
_order: dict[str, int] = {}  # test nodeid -> its place in the collection
_skipped: set[str] = set()  # tests skipped where they cannot run (no outcome, not missing from the run)


def pytest_addoption(parser):
    group = parser.getgroup("course grading")
    group.addoption("--impl", choices=("solution", "learner"), default="solution",
                    help="grade the reference solutions (default) or the learner's phase folders")
    group.addoption("--learner-root", default=str(grading.REPO_ROOT),
                    help="checkout whose phase folders are graded with --impl learner")
    group.addoption("--override", action="append", default=[], metavar="EX=FILE",
                    help="grade exercise EX with FILE instead (e.g. 1.2=tests/negative_controls/...)")
    group.addoption("--controls", metavar="JSON",
                    help="a list of negative controls ({name, exercise, path, caught_by, world_timeout}): "
                         "each test of a control's caught_by runs once against it, nothing else runs")
    group.addoption("--grade-json", metavar="PATH", help="also write the exercise table as JSON")
    group.addoption("--contract-coverage", action="store_true",
                    help="record which documented inputs, modes and call sequences of each exercise the graded tests "
                         "exercise (tests/contracts.py) and list, per exercise that ran, the entries none did")
    group.addoption("--course-runner", choices=("learner", "instructor"), default=None,
                    help="set by tests/test_phaseN.py (learner) and tests/grade.py (instructor): whom the "
                         "banner and the closing verdict speak to")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """pytest -n N (pytest-xdist): unless --dist says otherwise, an idle worker takes tests queued for
    another (worksteal; xdist's default deals them out in advance, whatever each one costs)."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "worksteal"


def _overrides(config) -> dict[str, str]:
    result = {}
    for item in config.getoption("--override"):
        ex, sep, path = item.partition("=")
        found = Path(path).is_file() or (Path(path) / "__init__.py").is_file()  # a file, or a package's folder
        if not sep or ex not in grading.EXERCISES or not found:
            raise pytest.UsageError(f"--override {item!r}: expected EX=FILE with a known exercise and an existing file "
                                    "(or a package's folder)")
        result[ex] = str(Path(path).resolve())
    return result


def _controls(config) -> list[dict]:
    path = config.getoption("--controls")
    if not path:
        return []
    controls = json.loads(Path(path).read_text())
    for control in controls:
        found = Path(control["path"]).is_file() or (Path(control["path"]) / "__init__.py").is_file()  # or a package
        if control["exercise"] not in grading.EXERCISES or not found:
            raise pytest.UsageError(f"--controls: {control} names an unknown exercise or a missing file")
    return controls


def pytest_generate_tests(metafunc):
    """With --controls, a test runs once per control that names it in its caught_by."""
    controls = _controls(metafunc.config)
    if controls and "grade" in metafunc.fixturenames:
        chosen = [c for c in controls if metafunc.function.__name__ in c["caught_by"]]
        if chosen:
            metafunc.parametrize("grade", chosen, indirect=True, ids=[c["name"] for c in chosen])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _order.update((item.nodeid, i) for i, item in enumerate(items))  # before any filter deselects some
    _skip_the_gpu_suite_unless_asked(config, items)
    for item in items:  # a property-based test reports a TODO at once (grading.stop_hypothesis_at_todo)
        grading.stop_hypothesis_at_todo(getattr(item, "obj", None))
    if not _controls(config):
        return
    keep = [item for item in items if _control(item) is not None]
    config.hook.pytest_deselected(items=[item for item in items if _control(item) is None])
    items[:] = keep


def _part(item) -> str | None:
    """The part of its exercise a test grades: @pytest.mark.part("stage 3") (grading.py's docstring)."""
    marker = item.get_closest_marker("part")
    return str(marker.args[0]) if marker is not None and marker.args else None


def pytest_deselected(items):
    if not items or items[0].config.getoption("--controls"):
        return
    for item in items:
        if grading.exercise_of_test(item.name):
            _collected[item.nodeid] = {"part": _part(item), "selected": False}


def pytest_collection_finish(session):
    """What the run will grade, and what of each exercise it leaves out: deselected tests (above) and test
    functions that were never collected (a node id named on the command line)."""
    if _controls(session.config):
        return
    deselected = dict(_collected)
    _collected.clear()
    modules, seen = {}, set()
    for item in session.items:
        if grading.exercise_of_test(item.name):
            _collected[item.nodeid] = {"part": _part(item), "selected": True}
            seen.add(getattr(item, "originalname", item.name))
            if getattr(item, "module", None) is not None:
                modules[item.module.__name__] = item.module
    for nodeid, info in deselected.items():
        _collected.setdefault(nodeid, info)
        seen.add(nodeid.rsplit("::", 1)[-1].split("[")[0])
    ordered = sorted(_collected.items(), key=lambda item: _order.get(item[0], len(_order)))
    _collected.clear()
    _collected.update(ordered)
    ran = {grading.exercise_of_test(n.rsplit("::", 1)[-1]) for n in _collected if _collected[n]["selected"]}
    for module in modules.values():
        for name, value in vars(module).items():
            ex = grading.exercise_of_test(name)
            if ex in ran and callable(value) and name not in seen:
                _uncollected.setdefault(ex, []).append(name)


def _skip_the_gpu_suite_unless_asked(config, items) -> None:
    """Tests marked `gpu` (tests/test_gpu.py) run with `pytest -m gpu` only: a plain `pytest`,
    CI's included, skips them even on a machine that has a GPU."""
    if "gpu" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the GPU suite runs with `pytest -m gpu` only (never in CI)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _control(item) -> dict | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("grade") if callspec else None


def _audience(config) -> str:
    """learner (python tests/test_phaseN.py, pytest --impl learner), instructor (tests/grade.py)
    or reference (pytest on the solutions)."""
    return config.getoption("--course-runner") or ("learner" if config.getoption("--impl") == "learner" else "reference")


def _graded_description(config) -> str:
    root = Path(config.getoption("--learner-root")).resolve()
    if _audience(config) == "instructor":
        text = (f"grading the learner checkout {root}: its phase folders, with the tests, harness and reference "
                f"solutions of {grading.REPO_ROOT}")
    elif config.getoption("--impl") == "learner":
        text = f"GRADING YOUR CODE: the phase folders of {root} (not solutions/)"
    else:
        text = f"grading the REFERENCE SOLUTIONS in {grading.REPO_ROOT / 'solutions'} (your own code: python tests/test_phaseN.py)"
    for ex, path in _overrides(config).items():
        text += f"; exercise {ex} from {path}"
    if config.getoption("--controls"):
        text += f"; each test against the negative controls that name it in {config.getoption('--controls')}"
    return text


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "part(name): the part of its exercise that a graded test grades (a stage, "
                                       "a schedule): the exercise table shows one row per part (tests/grading.py)")
    config._course_graded = _graded_description(config)
    if config.getoption("--controls"):
        _no_shrinking()
    if config.getoption("--contract-coverage") and not contracts.recording():
        import tempfile
        os.environ[contracts.ENV] = tempfile.mkdtemp(prefix="course-contracts-")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(config._course_graded, bold=True)
        common.launch.heartbeat = _terminal_writer(config, reporter)


def _no_shrinking() -> None:
    """A control (or a mutant) needs one failing example, not the smallest: Hypothesis's shrinking
    took 160 of a control's 162 s (a time_grid wrong on every drawn schedule). Before the test
    modules are imported, so that their settings(...) inherit it; a learner's run still shrinks."""
    from hypothesis import Phase, settings

    settings.register_profile("course-controls", phases=[p for p in Phase if p != Phase.shrink])
    settings.load_profile("course-controls")


def _terminal_writer(config, reporter):
    """A line on the terminal now, past pytest's output capture: a world waiting for its
    deadline (a deadlock, most often) says that it is alive."""
    capture = config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)
    return write


def pytest_report_header(config):
    return config._course_graded


@pytest.fixture
def grade(request):
    """grade("1.2") -> ModuleRef of the code to grade for exercise 1.2."""
    config = request.config
    overrides = _overrides(config)
    control = getattr(request, "param", None)  # --controls: this run's negative control
    if control:
        overrides[control["exercise"]] = str(Path(control["path"]).resolve())

    def ref(exercise: str) -> grading.ModuleRef:
        if exercise in overrides:
            return grading.ModuleRef(exercise, "file", overrides[exercise])
        if config.getoption("--impl") == "learner":
            return grading.ModuleRef(exercise, "learner", str(Path(config.getoption("--learner-root")).resolve()))
        return grading.ModuleRef(exercise, "solution", str(grading.REPO_ROOT))

    return ref


def _deadlock_key(item) -> tuple[str, str | None]:
    control = _control(item)
    return item.originalname, control["name"] if control else None


def pytest_runtest_setup(item):
    if contracts.recording():  # the calls this test makes (and the worlds it starts) are its exercise's
        os.environ[contracts.TEST_ENV] = item.nodeid
    first = _deadlocked.get(_deadlock_key(item))
    if first:
        pytest.fail(f"not run: {first} deadlocked (see that test); fix it first", pytrace=False)
    if _control(item) and _deadlock_key(item) in _rejected:
        pytest.skip("another case of this test already rejected this control")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A control whose bug deadlocks may say how long its tests' worlds need at most."""
    control, default = _control(item), common.launch.DEFAULT_TIMEOUT_S
    if control and control.get("world_timeout"):
        common.launch.DEFAULT_TIMEOUT_S = float(control["world_timeout"])
    try:
        yield
    finally:
        common.launch.DEFAULT_TIMEOUT_S = default


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
    _durations[item.nodeid] = _durations.get(item.nodeid, 0.0) + report.duration
    if _control(item):
        _control_of[item.nodeid] = _control(item)["name"]
    if report.when == "call" and call.excinfo and _deadlocked_world(call.excinfo.value):
        _deadlocked.setdefault(_deadlock_key(item), item.nodeid.rsplit("::", 1)[-1])
    if _control(item) and report.failed and not grading.harness_error_of(call.excinfo.value if call.excinfo else None):
        _rejected.add(_deadlock_key(item))
    if report.skipped:  # skipped where it cannot run (a platform): no outcome, and not missing from the run
        _collected.pop(item.nodeid, None)
        _skipped.add(item.nodeid)
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        todo = grading.todo_of(call.excinfo.value) if call.excinfo else None
        if todo:
            ex = grading.EXERCISES.get(grading.exercise_of_test(item.name) or "")
            where = f" (read {ex.guidelines})" if ex else ""
            # each hint in full once; the other tests it stops say so in a few words
            report.longrepr = f"{todo}{where}" if todo not in _hints_shown else f"{todo.split(':', 1)[0]}, as above"
            _hints_shown.add(todo)
        death = None if todo or report.passed else grading.harness_error_of(call.excinfo.value if call.excinfo else None)
        mismatch = grading.collective_mismatch_of(call.excinfo.value, report.capstderr) if death else None
        if mismatch:  # the death is gloo's verdict on the graded code: a failure, not a harness error
            death = None
            report.longrepr = f"{mismatch}\n\n{report.longrepr}"
        if death:
            report.longrepr = (f"HARNESS ERROR, no verdict on the graded code: {death}\n"
                               "(a rank died without reporting, or the machine was too busy to start the world "
                               "in time): run the test again.\n\n"
                               f"{report.longrepr}")
        _outcomes[item.nodeid] = "todo" if todo else "pass" if report.passed else "error" if death else "fail"
        exercise = grading.exercise_of_test(item.name)
        if exercise in grading.EXERCISES:
            ref = item.funcargs.get("grade") if hasattr(item, "funcargs") else None
            record = grading.failure_record(item.name, _outcomes[item.nodeid],
                                            None if report.passed or todo else
                                            AssertionError(mismatch) if mismatch else call.excinfo.value, exercise,
                                            graded=ref(exercise).path() if callable(ref) else None)
            _records[item.nodeid] = {**record, "todo": todo}
    elif report.failed:  # teardown errors count against the test too
        _outcomes[item.nodeid] = "fail"
        if item.nodeid in _records:
            _records[item.nodeid].update(outcome="fail", lines=[*_records[item.nodeid]["lines"],
                                                                f"teardown failed: {report.longreprtext.splitlines()[-1:]}"])


def _test_listing(rows: list[dict]) -> list[str]:
    """For the instructor: every graded test once, by exercise, each TODO hint once and whole."""
    lines = []
    for row in rows:
        lines.append(f"{row['exercise']} {row['title']}")
        mine = [(nodeid, rec) for nodeid, rec in _records.items()
                if grading.exercise_of_test(rec["test"]) == row["exercise"]]
        for nodeid, rec in mine:
            outcome = _outcomes[nodeid]
            first = rec["lines"][0] if outcome in ("fail", "error") and rec["lines"] else ""
            lines.append(f"  {outcome.upper():<5} {rec['test']}" + (f": {first}" if first else ""))
        for hint in dict.fromkeys(rec["todo"] for _, rec in mine if rec.get("todo")):
            lines.append(f"  {hint}")
    return lines


def _rows() -> list[dict]:
    return grading.summarize(_outcomes, _collected, _uncollected)


# pytest -n N (pytest-xdist): the tests run in N worker processes; each sends what the table and the
# exercise reports need when it ends, and the controller, which runs no test, merges it.
_SHARED = {"outcomes": _outcomes, "records": _records, "durations": _durations, "control_of": _control_of,
           "collected": _collected, "uncollected": _uncollected}


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)  # set on an xdist worker only
    if output is not None:
        output["course"] = json.dumps({**_SHARED, "skipped": sorted(_skipped)}, default=str)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's results, merged (every worker collected every test, in order)."""
    sent = getattr(node, "workeroutput", {}).get("course")
    if not sent:
        return
    state = json.loads(sent)
    for key, mine in _SHARED.items():
        if key in ("collected", "uncollected"):
            for name, value in state[key].items():
                mine.setdefault(name, value)
        else:
            mine.update(state[key])
    _skipped.update(state["skipped"])
    for nodeid in _skipped:  # another worker collected it too: skipped there, it is no test left out
        _collected.pop(nodeid, None)
    if not _order:
        _order.update((nodeid, i) for i, nodeid in enumerate(state["collected"]))
    in_order = sorted(_records.items(), key=lambda item: _order.get(item[0], len(_order)))
    _records.clear()
    _records.update(in_order)


def pytest_terminal_summary(terminalreporter, config):
    rows = _rows()
    if rows and _audience(config) == "instructor":
        terminalreporter.section("tests")
        for line in _test_listing(rows):
            terminalreporter.write_line(line)
    failing = [row for row in rows if row["status"] == "fail"]
    if failing:
        terminalreporter.section("exercise reports")
        for row in failing:
            records = [rec for rec in _records.values() if grading.exercise_of_test(rec["test"]) == row["exercise"]]
            for line in grading.exercise_report(row, records):
                terminalreporter.write_line(line)
    if config.getoption("--contract-coverage"):
        _contract_report(terminalreporter, rows)
    path = config.getoption("--grade-json")
    if path:
        grading.write_json(Path(path), rows, _outcomes, config._course_graded,
                           durations=_durations, controls=_control_of)


def _contract_report(terminalreporter, rows: list[dict]) -> None:
    """--contract-coverage: per exercise that ran whole, its documented entries that no test exercised."""
    terminalreporter.section("contract coverage")
    exercised = contracts.read_records(Path(os.environ[contracts.ENV]))
    for row in rows:
        contract = contracts.load_contract(row["exercise"])
        if contract is None:
            terminalreporter.write_line(f"{row['exercise']}: no contract file ({contracts.contract_path(row['exercise'])})")
            continue
        report = contracts.coverage(contract, exercised.get(row["exercise"], {}))
        complete = "" if row.get("complete", True) else " (not all its tests ran)"
        terminalreporter.write_line(
            f"{row['exercise']}: {report['entries']} entries, {len(report['exercised'])} exercised, "
            f"{len(report['irrelevant'])} irrelevant, {len(report['gaps'])} gaps{complete}")
        for gap in report["gaps"]:
            terminalreporter.write_line(f"  GAP {gap}")


def pytest_unconfigure(config):
    """The table and the verdict come last, after pytest's own summary lines."""
    rows = _rows()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not rows or reporter is None or not hasattr(config, "_course_graded"):
        return
    reporter.write_sep("=", "exercises")
    reporter.write_line(config._course_graded)
    reporter.write_line(grading.format_table(rows))
    reporter.write_line(grading.verdict(rows, _audience(config), config.getoption("--grade-json"),
                                        grading.left_out(_collected, _outcomes)), bold=True)
