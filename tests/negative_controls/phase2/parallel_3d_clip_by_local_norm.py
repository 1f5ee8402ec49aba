"""Clipping with torch.nn.utils.clip_grad_norm_ on this rank's parameters: each rank's shards clipped by a local norm."""

EXERCISE = "2.11"
CAUGHT_BY = ["test_2_11_training_on_the_mesh_equals_one_process"]
EDITS = {
    "train_step": [
        ("        scale = (max_norm / (grad_norm(stages, mesh) + 1e-6)).clamp(max=1.0)\n",
         "        scale = (max_norm / (nn.utils.get_total_norm([q.grad for q in params]) + 1e-6)).clamp(max=1.0)\n"),
    ],
}
