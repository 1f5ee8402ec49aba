"""send_activation skips its check: a 9-dim activation goes out with an 11-value header (longer than HEADER_LEN), which no receiver can read.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import model_split as _reference

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_send_activation_rejects_what_the_header_cannot_describe"]

_SOURCE = inspect.getsource(_reference)
_OLD = "        if activation.dim() > MAX_DIMS or activation.dtype not in DTYPES:\n"
assert _SOURCE.count(_OLD) == 1, "send_activation changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, "        if False:\n"), _reference.__file__, "exec"))
