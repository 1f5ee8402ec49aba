"""Gradients clipped before the dp average: each replica scales by the norm of its own half-batch gradient."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("    for p in params:\n        dist.all_reduce(p.grad, group=dp_group)\n        p.grad /= dp\n"
         "    if max_norm is not None:\n        scale = (max_norm / (grad_norm(stages, mesh) + 1e-6)).clamp(max=1.0)\n"
         "        for p in params:\n            p.grad *= scale\n",
         "    if max_norm is not None:\n        scale = (max_norm / (grad_norm(stages, mesh) + 1e-6)).clamp(max=1.0)\n"
         "        for p in params:\n            p.grad *= scale\n"
         "    for p in params:\n        dist.all_reduce(p.grad, group=dp_group)\n        p.grad /= dp\n"),
    ],
}
