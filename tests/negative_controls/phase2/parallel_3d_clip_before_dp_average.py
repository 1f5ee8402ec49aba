"""Gradients clipped before the dp average: each replica scales by the norm of its own half-batch gradient."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]


def train_step(stages, mesh, x, y, *, num_microbatches, lr, max_norm=None):
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    dp, d = mesh["dp"].size(), mesh["dp"].get_local_rank()
    pp, s = mesh["pp"].size(), mesh["pp"].get_local_rank()
    micro_x = split_microbatches(x.chunk(dp)[d], num_microbatches)
    micro_y = split_microbatches(y.chunk(dp)[d], num_microbatches)
    row = (one_f_one_b_schedule(pp, num_microbatches) if len(stages) == 1
           else interleaved_schedule(pp, num_microbatches, len(stages)))[s]
    params = [p for st in stages for p in st.parameters()]
    for p in params:
        p.grad = None
    loss = run_pipeline(row, stages, micro_x, micro_y, F.mse_loss)
    if max_norm is not None:
        scale = (max_norm / (grad_norm(stages, mesh) + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad *= scale
    for p in params:
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dp
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
    total = loss.detach().clone() if loss is not None else torch.zeros((), device=current_device())
    dist.all_reduce(total, group=pp_group)
    dist.all_reduce(total, group=dp_group)
    return total.item() / dp
