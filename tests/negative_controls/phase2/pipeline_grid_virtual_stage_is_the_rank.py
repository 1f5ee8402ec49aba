"""time_grid reads (kind, j, k) but keeps 1F1B's dependencies between ranks (F on rank r after F on rank r-1), not between virtual stages: right for one stage per rank, wrong as soon as a rank holds several chunks.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import pipeline as _reference

EXERCISE = "2.6"
CAUGHT_BY = ["test_2_6_time_grid_of_any_schedule_interleaved"]

_SOURCE = inspect.getsource(_reference)
_CHANGES = {
    "            kind, j, k = rows[r][position[r]]\n": "            kind, j, _ = rows[r][position[r]]\n            k = r\n",
    "    last = max([num_ranks - 1] + [k for row in rows for _, _, k in row])\n": "    last = num_ranks - 1\n",
}
for _old, _new in _CHANGES.items():
    assert _SOURCE.count(_old) == 1, "time_grid changed in the reference: update this control"
    _SOURCE = _SOURCE.replace(_old, _new)
_SOURCE = _SOURCE.replace("from .model_split import", "from solutions.phase2_advanced.model_split import")
exec(compile(_SOURCE, _reference.__file__, "exec"))
