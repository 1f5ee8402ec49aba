"""all_to_all's backward sends the gradient with the forward's splits instead of swapping them:
with uneven splits the gradient rows go to the wrong ranks, in the wrong sizes (gloo then finds
a message larger than the receive buffer and aborts a rank)."""

EXERCISE = "2.10"
CAUGHT_BY = ["test_2_10_all_to_all_uneven_splits_forward_and_backward"]
EDITS = {
    "_AllToAll.backward": [
        ("        out = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))\n"
         "        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)\n",
         "        out = grad.new_empty((sum(ctx.recv_splits), *grad.shape[1:]))\n"
         "        dist.all_to_all_single(out, grad.contiguous(), ctx.recv_splits, ctx.send_splits, group=ctx.group)\n"),
    ],
}
