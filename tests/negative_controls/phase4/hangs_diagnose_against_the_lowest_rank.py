"""A mismatch is judged against the lowest rank's collective (rank 0 as the reference) instead of what most ranks issued: when rank 0 is the odd one, every other rank is blamed."""
import types

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_diagnose_names_who_diverged_and_where"]


def _first_divergence(group, issued, entries):
    finding = _reference._first_divergence(group, issued, entries)
    if finding is None or finding["kind"] != "mismatch":
        return finding
    seq = finding["seq"]
    holders = {r: entries[r][seq] for r in group if seq in entries.get(r, {})}
    sig = {r: (e["op"], e["dtype"], e["shape"]) for r, e in holders.items()}
    first = sig[min(sig)]  # the bug: the lowest rank is right by definition
    odd = [r for r in sorted(sig) if sig[r] != first]
    return {**finding, "ranks": odd, "expected": {"op": first[0], "dtype": first[1], "shape": first[2]},
            "message": f"ranks {odd} differ from rank {min(sig)} at collective #{seq} ({first[0]})"}


diagnose = types.FunctionType(_reference.diagnose.__code__, globals(), "diagnose")
