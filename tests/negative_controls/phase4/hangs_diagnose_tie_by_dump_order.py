"""diagnose counts the signatures at #seq with Counter.most_common over the holders in the order their dumps came (the order of the glob, of the gather), so a tie between two signatures goes to whichever holder's dump came first, not to the lowest rank's: the same dumps in another order blame other ranks and expect another collective."""
import types
from collections import Counter

from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403
from solutions.phase4_production.hangs import _ranks, signature

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_diagnose_agrees_with_the_contract_on_random_dumps"]


def _first_divergence(group, issued, entries):
    candidates = {seq for per_rank in entries.values() for seq in per_rank}
    if min(issued) < max(issued):
        candidates = {seq for seq in candidates if seq < min(issued)} | {min(issued)}
    for seq in sorted(candidates):
        # the bug: `entries` is filled dump by dump, so its order is the order of the dumps
        holders = {r: held[seq] for r, held in entries.items() if seq in held}
        sigs = {r: (e["op"], e["dtype"], None if e["shape"] is None else tuple(e["shape"])) for r, e in holders.items()}
        expected = Counter(sigs.values()).most_common(1)[0][0] if sigs else None
        never = [r for r, n in zip(group, issued) if n <= seq]
        odd = [r for r in sorted(sigs) if sigs[r] != expected]
        if not never and not odd:
            continue
        waiting = [r for r in sorted(holders) if holders[r]["state"] != "completed"]
        what = "a collective no dump holds any more" if expected is None else signature(*expected)
        if never:
            message = f"{_ranks(never)} never started collective #{seq} ({what}) of group {group}"
        else:
            message = (", ".join(f"rank {r} issued {signature(*sigs[r])}" for r in odd)
                       + f" as collective #{seq} of group {group}, where the others issued {what}")
        return {"group": group, "seq": seq, "kind": "skipped" if never else "mismatch",
                "ranks": never or odd, "waiting": waiting,
                "expected": None if expected is None else
                {"op": expected[0], "dtype": expected[1], "shape": None if expected[2] is None else list(expected[2])},
                "message": message}
    return None


# diagnose looks _first_divergence up in its own module: the reference's body, run with this one.
diagnose = types.FunctionType(_reference.diagnose.__code__, globals(), "diagnose")
