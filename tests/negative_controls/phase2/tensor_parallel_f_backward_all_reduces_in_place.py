"""f's backward all-reduces the gradient it was given in place and returns it: the caller's upstream gradient is overwritten with the sum.

Every number f returns is right; the damage is to a tensor f does not own (autograd may
hand the same gradient to other functions, or it is the user's own tensor). The whole
module is the reference with this one change."""

EXERCISE = "2.7"
CAUGHT_BY = ["test_2_7_f_g_gather_scatter_operators"]
EDITS = {
    "CopyToTensorParallelRegion.backward": [
        ("        total = grad.clone(memory_format=torch.contiguous_format)\n"
         "        dist.all_reduce(total, group=ctx.group)\n"
         "        return total, None\n",
         "        dist.all_reduce(grad, group=ctx.group)\n"
         "        return grad, None\n"),
    ],
}
