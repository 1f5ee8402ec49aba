"""ColumnParallelLinear without bias returns F.linear(f(x), weight) straight away: gather_output=True is ignored when bias=False.

The whole module is the reference with this one change."""
import inspect

from solutions.phase2_advanced import tensor_parallel as _reference

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_column_parallel_linear_matches_nn_linear"]

_SOURCE = inspect.getsource(_reference)
_OLD = "        y = F.linear(CopyToTensorParallelRegion.apply(x, self.group), self.weight, self.bias)\n"
_NEW = ("        if self.bias is None:\n"
        "            return F.linear(CopyToTensorParallelRegion.apply(x, self.group), self.weight)\n" + _OLD)
assert _SOURCE.count(_OLD) == 1, "ColumnParallelLinear.forward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_OLD, _NEW), _reference.__file__, "exec"))
