"""diagnose looks for a rank that never started a collective first and reports it, and only without one looks for a mismatch: a shape mismatch that happened earlier (the real cause; the later hang is its consequence) is never reported."""
import types

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_diagnose_names_who_diverged_and_where"]


def _first_divergence(group, issued, entries):
    if min(issued) < max(issued):  # the bug: the skip wins, whatever happened before it
        later = {r: {s: e for s, e in held.items() if s >= min(issued)} for r, held in entries.items()}
        return _reference._first_divergence(group, issued, later)
    return _reference._first_divergence(group, issued, entries)


diagnose = types.FunctionType(_reference.diagnose.__code__, globals(), "diagnose")
