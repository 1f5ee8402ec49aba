"""f's backward all-reduces the gradient it was given in place and returns it: the caller's upstream gradient is overwritten with the sum.

Every number f returns is right; the damage is to a tensor f does not own (autograd may
hand the same gradient to other functions, or it is the user's own tensor). The whole
module is the reference with this one change.
"""
import inspect

from solutions.phase2_advanced import tensor_parallel as _reference

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_f_g_gather_scatter_operators"]

_SOURCE = inspect.getsource(_reference)
_F_BACKWARD = """        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None
"""
assert _SOURCE.count(_F_BACKWARD) == 1, "f's backward changed in the reference: update this control"
exec(compile(_SOURCE.replace(_F_BACKWARD, "        dist.all_reduce(grad, group=ctx.group)\n        return grad, None\n"),
             _reference.__file__, "exec"))
