"""Write the learner's templates from the reference solutions.

    python tools/make_templates.py            # regenerate phaseN_*/ *.py from solutions/
    python tools/make_templates.py --check    # CI: fail if a committed template differs, or a hint is too long
    python tools/make_templates.py --force    # also overwrite exercise regions holding your code
                                              # (each such file is first copied to <file>.bak-<time>)

A template whose exercise region holds something other than its TODO stub (a learner's
work) is never overwritten without --force: the command stops, names the files, and
writes nothing.

In a solution file, an exercise body is fenced by two comments:

        # EXERCISE 1.2: one-line hint shown to the learner
        ...reference code...
        # END EXERCISE

and the template gets, at the same indentation,

        raise NotImplementedError("TODO 1.2: one-line hint shown to the learner")

Everything else (imports, signatures, docstrings, helpers) is copied unchanged, so a
template has exactly the public API of its solution. One exception: an import of another
phase's reference, `from solutions.phase1_data_parallel.trainer import sync_gradients`,
becomes `from phase1_data_parallel.trainer import sync_gradients` in the template, so the
learner's phase-2 code runs on their own phase-1 code (the grader rebinds it to the
reference, so one exercise is still graded alone).

The hint cap (part of --check): the hint of every `# EXERCISE x.y: <hint>` line of every
solution file, i.e. the text after "# EXERCISE x.y: " with its trailing blanks stripped,
which the template raises as "TODO x.y: <hint>", is at most HINT_CAP = 120 characters
(len() of the str: characters, not bytes). A hint states the contract and one pointer; the
rest (the API, the recipe) belongs in that exercise's "Stuck?" section of the phase's
guidelines.md. The hint stays on its marker line, so shortening it moves no line.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO_ROOT / "solutions"

BEGIN = re.compile(r"^(?P<indent>\s*)# EXERCISE (?P<id>\d+\.\d+): (?P<hint>.+?)\s*$")
HINT_CAP = 120  # characters of a hint (see the module's docstring)
END = re.compile(r"^\s*# END EXERCISE\s*$")
STUB = re.compile(r"""^\s*raise NotImplementedError\((?P<q>['"])TODO (?P<id>\d+\.\d+): .*(?P=q)\)\s*$""")


class MarkerError(ValueError):
    pass


_SOLUTIONS_PREFIX = re.compile(r"\bsolutions\.(?=phase\d+_)")


def _import_lines_of_solutions(source: str, filename: str) -> set[int]:
    """Line numbers of the import statements that name a `solutions.phaseN_*` module."""
    lines = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _SOLUTIONS_PREFIX.match(node.module or ""):
            lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "solutions":
            raise MarkerError(f"{filename}:{node.lineno}: name the module, `from solutions.phaseN_x.module "
                              "import name`, so that the template can import the learner's own instead")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _SOLUTIONS_PREFIX.match(alias.name):
                    if alias.asname is None:
                        raise MarkerError(f"{filename}:{node.lineno}: `import {alias.name}` binds the name "
                                          "`solutions` in the template too; write `from ... import ...` or add `as`")
                    lines.add(node.lineno)
    return lines


def make_template(source: str, filename: str = "<solution>") -> str:
    """The template text for one solution file's text."""
    out, open_at = [], None
    rewrite = _import_lines_of_solutions(source, filename)
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        if lineno in rewrite:  # the learner's own code of that phase, not the reference
            line = _SOLUTIONS_PREFIX.sub("", line)
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if open_at:
                raise MarkerError(f"{filename}:{lineno}: EXERCISE inside the exercise opened at line {open_at}")
            open_at = lineno
            hint = f"TODO {begin['id']}: {begin['hint']}"
            out.append(f"{begin['indent']}raise NotImplementedError({hint!r})\n")
        elif end:
            if not open_at:
                raise MarkerError(f"{filename}:{lineno}: END EXERCISE without EXERCISE")
            open_at = None
        elif not open_at:
            out.append(line)
    if open_at:
        raise MarkerError(f"{filename}:{open_at}: EXERCISE never closed by '# END EXERCISE'")
    text = "".join(out)
    compile(text, filename, "exec")  # a template must at least import
    return text


def long_hints(source: str, filename: str = "<solution>") -> list[str]:
    """One line per hint of `source` longer than HINT_CAP characters, naming its file, line and length."""
    return [f"{filename}:{lineno}: the hint of TODO {m['id']} has {len(m['hint'])} characters (at most {HINT_CAP}: "
            "the contract and one pointer; the rest goes to its \"Stuck?\" section of the guidelines)"
            for lineno, m in enumerate(map(BEGIN.match, source.splitlines()), start=1)
            if m and len(m["hint"]) > HINT_CAP]


def exercise_ids(source: str) -> set[str]:
    return {m["id"] for m in map(BEGIN.match, source.splitlines()) if m}


def template_pairs() -> list[tuple[Path, Path]]:
    """(solution file, template file) for every .py file of every solutions/phase*/ folder and
    of every package in one (a folder with an __init__.py: phase4_production/trainer/)."""
    sources = [*SOLUTIONS.glob("phase*/*.py"),
               *(src for init in SOLUTIONS.glob("phase*/*/__init__.py") for src in init.parent.glob("*.py"))]
    return [(src, REPO_ROOT / src.relative_to(SOLUTIONS)) for src in sorted(sources)]


def learner_regions(template: str, current: str) -> list[str]:
    """Ids of the exercises whose region in `current` (a template file as it is on disk) holds
    something other than a TODO stub, compared with `template` (as generated now): code
    written in place of the stub or just before it. A stub whose hint changed is still a stub."""
    expected, actual = template.splitlines(), current.splitlines()
    stubs = {i: m["id"] for i, m in ((i, STUB.match(line)) for i, line in enumerate(expected)) if m}
    found = set()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, expected, actual, autojunk=False).get_opcodes():
        if tag == "equal" or all(STUB.match(line) or not line.strip() for line in actual[j1:j2]):
            continue  # nothing but stubs (a hint reworded in the solution) or blank lines
        touched = [i for i in stubs if i1 <= i < i2 or (tag == "insert" and i == i1)]
        found.update(stubs[i] for i in touched)
    return sorted(found, key=lambda ex: tuple(int(p) for p in ex.split(".")))


def templates_with_learner_code(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """{template path relative to `root`: exercise ids} for the templates under `root` whose
    exercise regions hold a learner's code (see learner_regions)."""
    found = {}
    for src, dst in template_pairs():
        dst = root / dst.relative_to(REPO_ROOT)
        if dst.exists():
            expected = make_template(src.read_text(), str(src.relative_to(REPO_ROOT)))
            regions = learner_regions(expected, dst.read_text())
            if regions:
                found[dst.relative_to(root).as_posix()] = regions
    return found


def _describe(found: dict[str, list[str]]) -> str:
    return ", ".join(f"{path} ({', '.join(ids)})" for path, ids in found.items())


def main(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    """`root`: the checkout whose templates are written or checked (tests use a copy)."""
    parser = argparse.ArgumentParser(description="Generate templates from solutions.")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on any difference")
    parser.add_argument("--force", action="store_true",
                        help="also overwrite templates whose exercise regions hold your code (a copy is kept)")
    args = parser.parse_args(argv)
    stale, writes, learner, too_long = [], [], {}, []
    for src, dst in template_pairs():
        too_long += long_hints(src.read_text(), src.relative_to(REPO_ROOT).as_posix())
        dst = root / dst.relative_to(REPO_ROOT)
        name = dst.relative_to(root).as_posix()
        expected = make_template(src.read_text(), str(src.relative_to(REPO_ROOT)))
        current = dst.read_text() if dst.exists() else None
        if current == expected:
            continue
        if current is not None and learner_regions(expected, current):
            learner[name] = learner_regions(expected, current)
        if args.check:
            stale.append(dst)
            diff = difflib.unified_diff((current or "").splitlines(True), expected.splitlines(True),
                                        name, "regenerated", n=1)
            sys.stdout.writelines(list(diff)[:40])
        else:
            writes.append((dst, name, expected))
    if learner and not args.check and not args.force:
        print(f"error: not overwriting your code in the exercise regions of {_describe(learner)}; "
              "nothing was written (run with --force to overwrite them, keeping a copy of each)", file=sys.stderr)
        return 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for dst, name, expected in writes:
        if name in learner:
            backup = dst.with_name(f"{dst.name}.bak-{stamp}")
            shutil.copy2(dst, backup)
            print(f"kept your version of {name} as {backup.relative_to(root).as_posix()}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(expected)
        print(f"wrote {name}")
    if args.check and too_long:
        print("\n".join(too_long))
        print(f"\n{len(too_long)} hint(s) longer than {HINT_CAP} characters: shorten them in the solutions "
              "(tools/make_templates.py says the rule)")
    if stale:
        mine = f" ({len(learner)} of them hold learner code: {_describe(learner)})" if learner else ""
        print(f"\n{len(stale)} template(s) differ from their solutions{mine}: "
              "run `python tools/make_templates.py` and commit")
        return 1
    if args.check and too_long:
        return 1
    if args.check:
        print("templates are up to date, every hint within the cap")
    return 0


if __name__ == "__main__":
    sys.exit(main())
