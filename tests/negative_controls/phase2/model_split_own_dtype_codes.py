"""send_activation and recv_activation agree on dtype codes of their own (float16 and bfloat16 swapped), not DTYPES' indices: each reads itself, and misreads a sender that follows the documented header.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import model_split as _reference

EXERCISE = "2.5"
CAUGHT_BY = ["test_2_5_header_protocol_matches_the_reference"]

_SOURCE = inspect.getsource(_reference)
_CHANGES = {
    "        header = [DTYPES.index(activation.dtype), activation.dim(), *activation.shape]\n":
        "        header = [_CODES.index(activation.dtype), activation.dim(), *activation.shape]\n",
    "        dtype, ndim = DTYPES[header[0]], header[1]\n": "        dtype, ndim = _CODES[header[0]], header[1]\n",
}
for _old, _new in _CHANGES.items():
    assert _SOURCE.count(_old) == 1, "the header protocol changed in the reference: update this control"
    _SOURCE = _SOURCE.replace(_old, _new)
_SOURCE += "\n_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)\n"
exec(compile(_SOURCE, _reference.__file__, "exec"))
