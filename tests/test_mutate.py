"""tools/mutate.py: the mutants it makes, their ids, the list of equivalents, the verdicts.
Fast: no mutant is run (the tool itself runs in CI: python tools/mutate.py --ci)."""

from __future__ import annotations

import ast
from pathlib import Path
import sys

import pytest

import grading

sys.path.insert(0, str(grading.REPO_ROOT / "tools"))
import mutate  # noqa: E402

SOURCE = '''"""A solution-like file."""
from .other import helper


def outside(a):
    return a + 1 < 2


def exercise(xs, n, flag):
    """Docstring."""
    # EXERCISE 9.9: the hint
    if n < 1:
        raise ValueError(f"bad n: {n - 1}")
    total = xs.sum(dim=0) * 2
    y = total[n:].clone()
    while flag and n > 0:
        n -= 1
    return helper(y, total)  # a comment
    # END EXERCISE


def also_outside(t):
    return t.detach()
'''


def _mutants(source: str = SOURCE):
    return mutate.mutants_of_source(source, "9.9", "solutions/phase9_x/mod.py", "solutions.phase9_x")


def test_mutants_only_inside_the_exercise_region_and_every_operator_appears():
    mutants = _mutants()
    lines = SOURCE.splitlines()
    begin, end = lines.index("    # EXERCISE 9.9: the hint") + 1, lines.index("    # END EXERCISE") + 1
    assert mutants and all(begin < m.line < end for m in mutants), [(m.line, m.change) for m in mutants]
    assert {m.operator for m in mutants} == {"cmp", "const", "arith", "boolop", "index", "drop", "drop_call",
                                             "sum_mean", "swap_args", "negate", "dim"}
    changes = {(m.operator, m.change) for m in mutants}
    for expected in [("cmp", "n < 1 -> n <= 1"), ("const", "1 -> 2"), ("dim", "0 -> 1"), ("dim", "0 -> -1"),
                     ("arith", "xs.sum(dim=0) * 2 -> xs.sum(dim=0) / 2"), ("drop_call", "total[n:].clone() -> total[n:]"),
                     ("sum_mean", "xs.sum(dim=0) -> xs.mean(dim=0)"), ("swap_args", "helper(y, total) -> helper(total, y)"),
                     ("negate", "n < 1 -> not n < 1"), ("index", "total[n:] -> total[n + 1:]"),
                     ("index", "total[n:] -> total[n:-1]"), ("boolop", "flag and n > 0 -> flag or n > 0"),
                     ("arith", "n -= 1 -> n += 1"), ("drop", "y = total[n:].clone() -> pass")]:
        assert expected in changes, (expected, sorted(changes))
    # an f-string (a message) is not mutated; a statement alone in its block is dropped once, with the block
    assert all('f"bad n: {n - 1}"' in m.source for m in mutants if not m.change.startswith("if n < 1:"))
    assert not any(m.operator == "drop" and m.change.startswith(("raise", "n -= 1")) for m in mutants), changes


def test_each_mutant_is_the_whole_file_with_one_change_that_compiles():
    mutants = _mutants()
    original = ast.dump(ast.parse(SOURCE.replace("from .other", "from solutions.phase9_x.other")))
    sources = set()
    for m in mutants:
        assert "from solutions.phase9_x.other import helper" in m.source, "relative imports become absolute"
        assert "# EXERCISE 9.9: the hint" in m.source and "# a comment" in m.source, "comments stay"
        assert "def outside(a):\n    return a + 1 < 2" in m.source and "t.detach()" in m.source
        compile(m.source, m.file, "exec")
        assert ast.dump(ast.parse(m.source)) != original
        sources.add(m.source)
    assert len(sources) == len(mutants), "no two mutants are the same program"


def test_ids_are_stable_and_an_edit_above_only_moves_the_line():
    first, again = _mutants(), _mutants()
    assert [m.id for m in first] == [m.id for m in again]
    assert len({m.id for m in first}) == len(first)
    moved = _mutants(SOURCE.replace('"""A solution-like file."""', '"""A solution-like file.\n\nMore."""'))
    assert [(m.operator, m.digest, m.line + 2) for m in first] == [(m.operator, m.digest, m.line) for m in moved]
    entry = mutate.Entry(first[0].id, "equivalent", "a reason", 7)
    problems = mutate.stale_entries({entry.id: entry}, moved)
    assert len(problems) == 1 and f"now at line {first[0].line + 2}" in problems[0], problems
    assert mutate.stale_entries({entry.id: entry}, first) == []


def test_the_list_is_read_and_equivalents_leave_the_score(tmp_path):
    mutants = _mutants()
    listing = tmp_path / "list.txt"
    listing.write_text(f"# comment\n\n{mutants[0].id} equivalent the same behaviour\n"
                       f"{mutants[1].id}   survives   a gap of the tests\n")
    entries = mutate.read_list(listing)
    assert entries[mutants[0].id].kind == "equivalent" and entries[mutants[0].id].reason == "the same behaviour"
    assert entries[mutants[1].id].kind == "survives"
    listing.write_text(f"{mutants[0].id} equivalent\n")
    with pytest.raises(SystemExit, match="expected"):
        mutate.read_list(listing)

    rows, problems = [], []
    for m, status in zip(mutants[:4], ["survived", "survived", "killed", "survived"]):
        label, problem = mutate.judge(m, status, "", entries.get(m.id))
        rows.append({"verdict": label, "why": ""})
        problems.append(problem)
    assert [r["verdict"] for r in rows] == ["equivalent", "survived", "killed", "survived"]
    assert problems[:3] == [None, None, None] and "survived" in problems[3], "only an unlisted survivor is a problem"
    result = mutate.score(rows)
    assert result["score"] == "1/3 = 33.3%" and result["equivalent"] == 1, result
    label, problem = mutate.judge(mutants[0], "killed", "test_x: AssertionError", entries[mutants[0].id])
    assert label == "killed" and "remove the entry" in problem
    label, problem = mutate.judge(mutants[1], "timed out", "", entries[mutants[1].id])
    assert "remove the entry" in problem


def test_verdicts_from_test_results():
    def results(*outcomes):
        return [{"test": f"test_9_9_{i}", "outcome": o, "message": "m"} for i, o in enumerate(outcomes)]
    assert mutate.verdict(results("pass", "pass"))[0] == "survived"
    assert mutate.verdict(results("pass", "fail", "skip"))[0] == "killed"
    killed, why = mutate.verdict(results("deadlock"))
    assert killed == "killed" and "deadlock" in why
    assert mutate.verdict(results("pass", "timeout"))[0] == "timed out"
    assert mutate.verdict(results("error", "pass"))[0] == "harness"
    assert mutate.verdict(results("error", "fail"))[0] == "killed"
    assert mutate.verdict([])[0] == "harness"


def test_outcome_of_a_world_that_failed():
    """A rank gloo aborted on collectives the ranks issued differently (its line on the captured stderr) is the
    mutant failing, wherever the rank's innermost frame was; one that died in the mutant's file too; a rank that
    died elsewhere, or a group whose ranks gloo could not connect (the world never formed), is no verdict."""
    from common.launch import RankFailure, WorldError

    mutant = "/tmp/mutants-x/mutant3.py"

    def died(where: str) -> WorldError:
        message = f"rank 0 was killed by signal 6 (SIGABRT) before reporting in {where}"
        return WorldError(f"rank 0 of 3 raised ProcessDied: {message}", {0: RankFailure(0, "ProcessDied", message, "")})

    abort = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
             "pair.cc:464] op.preamble.length <= op.nbytes. 240 vs 192. Received data size doesn't match expected "
             "size. Is there a distributed collective mismatch in your code?\n")
    in_a_wrapper = "/work/main/common/measure.py:139 in recorded (waiting inside distributed_c10d.py:all_reduce)"
    assert mutate._outcome(died(in_a_wrapper), mutant, abort) == "crash"
    assert mutate._outcome(died(in_a_wrapper), mutant, "") == "error"
    assert mutate._outcome(died(f"{mutant}:12 in pull"), mutant, "") == "crash"
    mesh = ("Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer [127.0.0.1]:57998. This is "
            "typically caused by a remote worker crashing.")
    no_world = WorldError(f"rank 1 of 2 raised RuntimeError: {mesh}", {1: RankFailure(1, "RuntimeError", mesh, "")})
    assert mutate._outcome(no_world, mutant, "") == "error"
    assert mutate._outcome(AssertionError("rank 0: expected 3, got 4"), mutant, "") == "fail"


def test_sample_is_deterministic():
    mutants = _mutants()
    chosen = mutate.sample(mutants, 5, seed=0)
    assert [m.id for m in chosen] == [m.id for m in mutate.sample(mutants, 5, seed=0)]
    assert len(chosen) == 5 and [m for m in mutants if m in chosen] == chosen
    assert mutate.sample(mutants, None, 0) == mutants


def test_real_exercise_mutants_and_the_checked_in_list_is_not_stale():
    mutants = mutate.mutants_of("1.1")
    assert mutants and {m.file for m in mutants} == {"solutions/phase1_data_parallel/sampler.py"}
    text = (grading.REPO_ROOT / mutants[0].file).read_text()
    spans = [(b, e) for ex, b, e in mutate.regions(text) if ex == "1.1"]
    assert all(any(b < m.line < e for b, e in spans) for m in mutants)
    entries = mutate.read_list()
    assert all(entry.reason for entry in entries.values())
    assert mutate._check_whole_list(entries) == []


def test_variants_take_their_exercise_from_the_folder_or_the_file_and_their_kind_from_the_name(tmp_path):
    (tmp_path / "3.2").mkdir()
    (tmp_path / "3.2" / "wrong_a.py").write_text("from .ring import x\n")
    (tmp_path / "3.2" / "correct_b.py").write_text("y = 1\n")
    (tmp_path / "loose.py").write_text('EXERCISE = "1.2"\n')
    found = {Path(m.change).name: m for m in mutate.variants_of([str(tmp_path)])}
    assert {name: (m.exercise, m.operator) for name, m in found.items()} == {
        "wrong_a.py": ("3.2", "wrong"), "correct_b.py": ("3.2", "correct"), "loose.py": ("1.2", "wrong")}
    assert found["wrong_a.py"].file == "solutions/phase3_multi_node/bucketed_ddp.py"  # its original runs first
    assert "from solutions.phase3_multi_node.ring import x" in found["wrong_a.py"].source
    assert len({m.id for m in found.values()}) == 3
    (tmp_path / "nowhere.py").write_text("z = 0\n")
    with pytest.raises(SystemExit, match="no exercise"):
        mutate.variants_of([str(tmp_path / "nowhere.py")])


def test_variants_are_scored_as_caught_and_accepted():
    rows = [{"exercise": "1.1", "operator": "wrong", "verdict": "killed"},
            {"exercise": "1.1", "operator": "wrong", "verdict": "survived"},
            {"exercise": "1.1", "operator": "wrong", "verdict": "harness"},
            {"exercise": "1.1", "operator": "correct", "verdict": "survived"},
            {"exercise": "1.1", "operator": "correct", "verdict": "killed"}]
    assert mutate.report_variants(rows, ["1.1"])["1.1"] == {"wrong": 2, "caught": 1, "correct": 2, "accepted": 1,
                                                            "harness": 1}


def test_renumber_follows_a_change_that_moved_and_keeps_twins_in_order(tmp_path):
    """An edit above a listed mutant moves its line; --renumber rewrites the id. Two entries
    for the same change (the same text on two lines) keep their order."""
    twice = SOURCE.replace("    total = xs.sum(dim=0) * 2\n", "    total = xs.sum(dim=0) * 2\n    other = xs.sum(dim=0) * 2\n")
    before = _mutants(twice)
    twins = [m for m in before if m.change == "xs.sum(dim=0) * 2 -> xs.sum(dim=0) / 2"]
    assert len(twins) == 2
    entries = {m.id: mutate.Entry(m.id, "equivalent", "why", i) for i, m in enumerate(twins)}
    after = _mutants('"""A solution-like file, with one line more above."""\n' + twice)
    moves = mutate.renumbered(entries, after)
    assert moves == {old.id: old.id.replace(f":{old.line}:", f":{old.line + 1}:") for old in twins}
    listing = tmp_path / "list.txt"
    listing.write_text("# a comment\n" + "".join(f"{m.id} equivalent why\n" for m in twins))
    mutate.update_list(moves, listing)
    assert listing.read_text().splitlines()[1:] == [f"{moves[m.id]} equivalent why" for m in twins]


def test_a_two_digit_exercise_is_mutated_and_sampled_on_its_own():
    """2.10 next to 2.1: each gets its own tests (prefix test_2_1_ is not test_2_10_), its own mutants,
    and CI's sample (--ci) includes 2.10."""
    assert mutate.graded_tests("2.10") and all(t.startswith("test_2_10_") for t in mutate.graded_tests("2.10"))
    assert not any(t.startswith("test_2_10_") for t in mutate.graded_tests("2.1"))
    assert {m.file for m in mutate.mutants_of("2.10")} == {"solutions/phase2_advanced/moe.py"}
    assert "2.10" in mutate._exercises_of_phases(mutate.CI_PHASES)


def test_ci_samples_all_four_phases_and_only_the_fast_exercises_of_phases_3_and_4():
    """--ci runs CI_PER_EXERCISE mutants of every exercise of phases 1-2 and, of phases 3-4, only the exercises
    CI_SAMPLE_34 names (their graded tests take seconds; each exercise's unmutated file runs them all first), with
    their numbers: every phase is covered, no torchrun exercise (4.2, 4.3) is."""
    sampled = {ex: mutate.ci_sample_size(ex) for ex in mutate._exercises_of_phases(mutate.CI_PHASES)
               if mutate.ci_sample_size(ex)}
    assert {int(ex.split(".")[0]) for ex in sampled} == {1, 2, 3, 4}
    assert all(n == mutate.CI_PER_EXERCISE for ex, n in sampled.items() if ex.split(".")[0] in ("1", "2"))
    assert {ex: n for ex, n in sampled.items() if ex.split(".")[0] in ("3", "4")} == mutate.CI_SAMPLE_34
    assert mutate.ci_sample_size("4.2") == mutate.ci_sample_size("4.3") == 0
    assert "2.10" in sampled and sampled["2.10"] == mutate.CI_PER_EXERCISE


def test_the_whole_list_check_reuses_the_mutants_already_made():
    """--ci checks every entry of the list against the mutants of every file it names; mutants already made for the
    sample (with their imports made absolute) give the same ids, so they are not made twice."""
    made = mutate.mutants_of("1.1")
    fresh = {m.id for m in mutate.mutants_of_source((grading.REPO_ROOT / made[0].file).read_text(), "1.1", made[0].file)}
    assert {m.id for m in made} == fresh
    entries = {e.id: e for e in mutate.read_list().values() if e.id.startswith(made[0].file)}
    entries["solutions/phase1_data_parallel/sampler.py:1:drop:00000000"] = mutate.Entry(
        "solutions/phase1_data_parallel/sampler.py:1:drop:00000000", "equivalent", "a stale one", 0)
    assert mutate._check_whole_list(entries, {"1.1": made}) == mutate._check_whole_list(entries) != []


def test_a_file_of_an_exercise_package_is_mutated_in_a_copy_of_the_whole_package(tmp_path):
    """2.4 is a package (zero/, one file per stage): a mutant of one of its files keeps the imports of the
    package's own files and loads as a copy of the whole package, so every stage (and what calls the mutated
    code from another file) is there; the unmutated copy loads the same way."""
    sys.path.insert(0, str(grading.REPO_ROOT / "tests"))
    import controls

    mutants = mutate.mutants_of("2.4")
    files = {m.file for m in mutants}
    if not all(f.startswith("solutions/phase2_advanced/zero/") for f in files):
        pytest.skip("2.4 is no package")
    stage3 = next(m for m in mutants if m.file.endswith("/stage3.py"))
    assert stage3.package == "solutions/phase2_advanced/zero"
    assert "from .flat import" in stage3.source, "an import of the package's own file stays relative"
    path = mutate._write_loadable(tmp_path, "mutant1", stage3.file, stage3.source)
    original = mutate._write_loadable(tmp_path, "original_2_4_zero", stage3.file)
    assert path.is_dir() and (path / "stage3.py").read_text() == stage3.source
    assert (original / "stage3.py").read_text() == (grading.REPO_ROOT / stage3.file).read_text()
    try:
        module = controls.load(path)
        ref = grading.ModuleRef("2.4", "file", str(path))
        assert ref.path() == path / "__init__.py" and ref.load() is module
        assert {"ZeroStage1", "ZeroStage2", "ZeroStage3", "zero_state_bytes"} <= set(vars(module))
        assert module.ZeroStage3.__module__ == "_control_mutant1.stage3"
        assert module.STAGES[3] is module.ZeroStage3, "the package's other files meet the mutated one"
    finally:
        for name in [m for m in sys.modules if m.startswith("_control_mutant1")]:
            del sys.modules[name]


def test_with_the_originals_run_last_a_verdict_stands_only_on_a_test_the_original_passes():
    """--originals-last (CI): the unmutated file runs after the mutants, only the tests that killed one. A kill
    counts if that test passed on it; a timeout only if the mutant's limit was at least 10 x the original's
    time (the rule the tool applies when the original runs first); anything else is no verdict."""
    killed = [{"test": "test_a", "outcome": "pass"}, {"test": "test_b", "outcome": "fail", "message": "x"}]
    slow = [{"test": "test_a", "outcome": "timeout", "limit": 20.0, "message": "still running"}]
    check = mutate._checked_against_original
    assert check(mutate.verdict(killed), killed, "9.9", {("9.9", "test_b"): 1.0})[0] == "killed"
    assert check(mutate.verdict(killed), killed, "9.9", {("9.9", "test_a"): 1.0})[0] == "harness"
    assert check(mutate.verdict(killed), killed, "9.8", {("9.9", "test_b"): 1.0})[0] == "harness"
    assert check(mutate.verdict(slow), slow, "9.9", {("9.9", "test_a"): 1.5})[0] == "timed out"
    status, why = check(mutate.verdict(slow), slow, "9.9", {("9.9", "test_a"): 2.5})
    assert status == "harness" and "2.5 s" in why
    survived = [{"test": "test_a", "outcome": "pass"}]
    assert check(mutate.verdict(survived), survived, "9.9", {}) == ("survived", "")
