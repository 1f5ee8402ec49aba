"""Write the learner's templates from the reference solutions.

    python tools/make_templates.py            # regenerate phaseN_*/ *.py from solutions/
    python tools/make_templates.py --check    # CI: fail if a committed template differs

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
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO_ROOT / "solutions"

BEGIN = re.compile(r"^(?P<indent>\s*)# EXERCISE (?P<id>\d+\.\d+): (?P<hint>.+?)\s*$")
END = re.compile(r"^\s*# END EXERCISE\s*$")


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


def exercise_ids(source: str) -> set[str]:
    return {m["id"] for m in map(BEGIN.match, source.splitlines()) if m}


def template_pairs() -> list[tuple[Path, Path]]:
    """(solution file, template file) for every .py file of every solutions/phase*/ folder."""
    return [(src, REPO_ROOT / src.relative_to(SOLUTIONS)) for src in sorted(SOLUTIONS.glob("phase*/*.py"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate templates from solutions.")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on any difference")
    args = parser.parse_args(argv)
    stale = []
    for src, dst in template_pairs():
        expected = make_template(src.read_text(), str(src.relative_to(REPO_ROOT)))
        current = dst.read_text() if dst.exists() else None
        if current == expected:
            continue
        if args.check:
            stale.append(dst)
            diff = difflib.unified_diff((current or "").splitlines(True), expected.splitlines(True),
                                        str(dst.relative_to(REPO_ROOT)), "regenerated", n=1)
            sys.stdout.writelines(list(diff)[:40])
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(expected)
            print(f"wrote {dst.relative_to(REPO_ROOT)}")
    if stale:
        print(f"\n{len(stale)} template(s) differ from their solutions: run `python tools/make_templates.py` and commit")
        return 1
    if args.check:
        print("templates are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
