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
template has exactly the public API of its solution.
"""

from __future__ import annotations

import argparse
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


def make_template(source: str, filename: str = "<solution>") -> str:
    """The template text for one solution file's text."""
    out, open_at = [], None
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
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
