"""diagnose lines the ranks' records up by their position in each dump, not by sequence number: once the ring buffers have wrapped, ranks that issued different numbers of collectives hold different windows, and position i is not the same collective on every rank."""
from solutions.phase4_production import hangs as _reference
from solutions.phase4_production.hangs import *  # noqa: F401,F403
from solutions.phase4_production.hangs import _first_divergence

EXERCISE = "4.6"
CAUGHT_BY = ["test_4_6_diagnose_names_who_diverged_and_where"]


def diagnose(dumps):
    _reference.diagnose(dumps)  # the reference's checks of the dumps (ValueError)
    issued, held = {}, {}
    for d in dumps:
        for g in d["groups"]:
            issued.setdefault(tuple(g["ranks"]), {})[d["rank"]] = g["issued"]
        mine = {}
        for e in d["entries"]:
            mine.setdefault(tuple(e["group"]), []).append(e)
        for group, entries in mine.items():  # the bug: the i-th entry held is taken as collective #i
            held.setdefault(group, {})[d["rank"]] = {i: {**e, "seq": i} for i, e in enumerate(entries)}
    findings = []
    for group in sorted(set(issued) | set(held)):
        finding = _first_divergence(list(group), [issued.get(group, {}).get(r, 0) for r in group], held.get(group, {}))
        if finding is not None:
            findings.append(finding)
    return findings
