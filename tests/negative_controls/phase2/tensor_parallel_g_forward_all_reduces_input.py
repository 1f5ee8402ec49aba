"""g's forward all-reduces its input x in place and returns a copy: x, which autograd or the caller may still use, now holds the sum.

The output is right; the partial sum the caller handed in is gone. The whole module is the
reference with this one change."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_f_g_gather_scatter_operators"]
EDITS = {
    "ReduceFromTensorParallelRegion.forward": [
        ("        total = x.clone(memory_format=torch.contiguous_format)\n"
         "        dist.all_reduce(total, group=group)\n"
         "        return total\n",
         "        dist.all_reduce(x, group=group)\n"
         "        return x.clone()\n"),
    ],
}
