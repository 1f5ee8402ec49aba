"""common.measure's byte counting (training_memory and what it is made of): the instrument behind
2.4's memory tests and benchmarks/zero_memory.py.

Not graded (it is given code, not an exercise): these tests check the repository itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.launch import run_world
from common.measure import distinct_storage_bytes, module_tensors, storage_key, training_memory


def test_a_view_counts_its_whole_storage_once_and_a_freed_one_nothing():
    flat = torch.zeros(10)
    a, b = flat[:4], flat[4:]
    assert storage_key(a) == storage_key(b) == storage_key(flat)
    assert distinct_storage_bytes([a, b, flat]) == 40, "one buffer of 10 floats, however many views of it"
    assert distinct_storage_bytes([a], exclude=[b]) == 0, "excluded: a storage already counted elsewhere"
    flat.untyped_storage().resize_(0)
    assert distinct_storage_bytes([a, b]) == 0, "a storage resized to 0 holds nothing"


class _Swapped(nn.Module):
    """A Linear whose weight is not a registered parameter but a plain tensor attribute (what a sharded
    module holds while a unit is gathered: FSDP1's unsharded views, 2.4's ZeRO-3)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        self.weight = torch.zeros(3, 5, requires_grad=True)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def test_training_memory_counts_tensors_a_module_holds_as_plain_attributes():
    model = nn.Sequential(_Swapped())
    assert any(t is model[0].weight for t in module_tensors(model)), "a plain tensor attribute is a module tensor"
    model(torch.ones(2, 5)).sum().backward()
    got = training_memory(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert got == {"params": 4 * (3 + 15), "grads": 4 * (3 + 15), "optimizer": 0, "total": 8 * 18}, (
        f"{got}: the bias (3 floats) and the weight held as a plain attribute (15 floats), and both .grad")


def _fully_shard_memory() -> dict:
    """fully_shard on Linear(8, 5) (5 rows: 3 on rank 0, 2 on rank 1), one AdamW step; training_memory, and what
    the local shards' storages hold, counted by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"measured": training_memory(model, optimizer),
            "all_dtensors": all(isinstance(t, DTensor) for t in params + [p.grad for p in params]),
            "local_rows": [p.to_local().shape[0] for p in params],
            "state_local_bytes": sum(v.to_local().numel() * 4 if isinstance(v, DTensor) else v.numel() * 4
                                     for v in state)}


def test_training_memory_counts_a_dtensor_by_its_local_shard():
    """Under torch's fully_shard (FSDP2) every parameter, gradient and Adam state is a DTensor, which has no
    storage of its own (torch 2.14.1: data_ptr() raises on it): each counts the storage under its local shard,
    whole. fully_shard pads a parameter to a multiple of N rows: ceil(5 / 2) = 3 rows on both ranks (rank 1 holds
    2 of them); the gradients of a unit are views of one reduce-scatter output, padded alike; Adam's state follows
    the local shard's unpadded rows, plus a 4-byte `step` per parameter."""
    results = run_world(_fully_shard_memory, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["all_dtensors"], f"rank {rank}: fully_shard's parameters and gradients are expected to be DTensors"
        rows = 3 if rank == 0 else 2
        assert r["local_rows"] == [rows, rows], f"rank {rank}: local shard rows {r['local_rows']}"
        padded = 4 * (3 * 8 + 3)  # weight and bias, 3 rows each
        expected = {"params": padded, "grads": padded, "optimizer": r["state_local_bytes"]}
        expected["total"] = sum(expected.values())
        assert r["measured"] == expected, f"rank {rank}: training_memory {r['measured']}, expected {expected}"
        assert r["state_local_bytes"] == 2 * 4 * rows * 9 + 2 * 4, (
            f"rank {rank}: Adam's exp_avg and exp_avg_sq of {rows} rows of 8 + 1 floats, and two 4-byte steps")


def test_op_log_counts_matrix_product_flops_and_the_largest_new_buffer():
    """OpLog (2.9's work and memory tests): composite ops arrive decomposed (matmul of 3-D tensors as bmm, F.linear
    as addmm / mm), each counted 2 FLOPs per multiply-add, forward and backward; a view makes no buffer."""
    from common.measure import OpLog

    q = torch.randn(2, 8, 4, requires_grad=True)
    linear = nn.Linear(4, 5)
    seen = []
    with OpLog(on_op=seen.append) as ops:
        scores = q @ q.transpose(-1, -2)  # (2, 8, 8): the largest buffer
        linear(scores.softmax(-1) @ q).sum().backward()
    bmm, addmm = 2 * 2 * 8 * 4 * 8, 2 * 16 * 4 * 5
    assert ops.flops == 3 * 2 * bmm + 3 * addmm, "2 bmm forward and 4 backward; addmm forward, 2 mm backward"
    assert ops.largest[0] == 2 * 8 * 8 * 4 and ops.largest[1] == (2, 8, 8), ops.largest
    assert seen == ops.names and "aten.bmm.default" in seen and "aten.transpose.int" in seen
