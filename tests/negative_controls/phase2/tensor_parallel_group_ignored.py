"""f and g all-reduce without `group=`: on the whole world, whatever group the layer was built with.

Right as long as the tensor-parallel group is the world (2.7's other tests), wrong as soon as it is
a sub-group (2.8's mesh): the partial sums of two model replicas get added together.
"""
import inspect

from solutions.phase2_advanced import tensor_parallel as _reference

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_layers_built_on_a_group_communicate_only_within_it"]

_SOURCE = inspect.getsource(_reference)
_BUGGY = "".join(line.replace(", group=ctx.group)", ")").replace(", group=group)", ")") if "dist.all_reduce" in line else line
                 for line in _SOURCE.splitlines(keepends=True))
_REDUCES = [line for line in _BUGGY.splitlines() if "dist.all_reduce" in line]
assert len(_REDUCES) == 2 and not any("group=" in line for line in _REDUCES), \
    "the reference's all-reduces changed: update this control"
exec(compile(_BUGGY, _reference.__file__, "exec"))
