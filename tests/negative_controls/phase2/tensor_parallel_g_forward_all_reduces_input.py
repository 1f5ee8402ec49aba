"""g's forward all-reduces its input x in place and returns a copy: x, which autograd or the caller may still use, now holds the sum.

The output is right; the partial sum the caller handed in is gone. The whole module is the
reference with this one change.
"""
import inspect

from solutions.phase2_advanced import tensor_parallel as _reference

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_f_g_gather_scatter_operators"]

_SOURCE = inspect.getsource(_reference)
_G_FORWARD = """        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total
"""
assert _SOURCE.count(_G_FORWARD) == 1, "g's forward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_G_FORWARD, "        dist.all_reduce(x, group=group)\n        return x.clone()\n"),
             _reference.__file__, "exec"))
