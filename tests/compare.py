"""Comparisons whose failure messages say what differed, where, and by how much."""

from __future__ import annotations

import torch


def diff_report(actual: torch.Tensor, expected: torch.Tensor, what: str,
                rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """None if close, else one line: what, max abs diff, where, the two values."""
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.numel() == 0:
        return None
    if not a.is_floating_point():
        bad = a != e
        if not bad.any():
            return None
        i = tuple(int(x) for x in bad.nonzero()[0])
        return f"{what}: {int(bad.sum())} of {a.numel()} elements differ, first at {i}: got {a[i].item()}, expected {e[i].item()}"
    a, e = a.double(), e.double()
    if torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
        return None
    special = _nonfinite_report(a, e, what)
    if special:
        return special
    diff = (a - e).abs().nan_to_num(nan=0.0)  # NaN only where both are NaN, or inf - inf: equal
    i = tuple(int(x) for x in (diff == diff.max()).nonzero()[0])
    return (f"{what}: max abs diff {diff.max().item():.3g} at index {i} "
            f"(got {a[i].item():.6g}, expected {e[i].item():.6g}; tolerance atol={atol:g}, rtol={rtol:g})")


def _nonfinite_report(a: torch.Tensor, e: torch.Tensor, what: str) -> str | None:
    """One line if NaN or inf sit where the other tensor has something else, else None.

    A NaN where a number was expected is what a skipped overflow check produces; the
    max-difference report cannot locate it (NaN compares false with everything)."""
    got_nan = a.isnan() & ~e.isnan()
    lost_nan = e.isnan() & ~a.isnan()
    inf_wrong = (a.isinf() | e.isinf()) & (a != e) & ~a.isnan() & ~e.isnan()
    parts = [f"{text} at {int(mask.sum())} of {a.numel()} elements" for mask, text in (
        (got_nan, "NaN where a number was expected"),
        (lost_nan, "a number where NaN was expected"),
        (inf_wrong, "an infinity that differs"),
    ) if mask.any()]
    if not parts:
        return None
    bad = got_nan | lost_nan | inf_wrong
    i = tuple(int(x) for x in bad.nonzero()[0])
    return (f"{what}: {'; '.join(parts)}; first at index {i}: "
            f"got {a[i].item():.6g}, expected {e[i].item():.6g}")


def assert_close(actual, expected, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    problem = diff_report(actual, expected, what, rtol, atol)
    assert problem is None, problem


def state_dict_problems(actual: dict, expected: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """One line per entry that is missing or differs."""
    problems = [f"{what}: missing {k}" for k in expected if k not in actual]
    for key in expected:
        if key in actual:
            problem = diff_report(actual[key], expected[key], f"{what} {key}", rtol, atol)
            if problem:
                problems.append(problem)
    return problems


def assert_no_problems(problems: list[str], header: str = "") -> None:
    """Fail with the header and the first 12 problems; the error keeps all of them
    (`.problems`, `.header`) for the grader's per-exercise report (tests/grading.py)."""
    if not problems:
        return
    shown = "\n".join(problems[:12]) + (f"\n... and {len(problems) - 12} more" if len(problems) > 12 else "")
    error = AssertionError((header + "\n" if header else "") + shown)
    error.problems, error.header = list(problems), header
    raise error
