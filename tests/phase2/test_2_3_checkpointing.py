"""Graded tests of exercise 2.3, activation checkpointing (phase2_advanced/guidelines.md, section 2.3).

Run them with `python tests/test_phase2.py -k 2_3` (your code) or
`pytest tests/test_phase2.py -k 2_3` (the reference); tests/test_phase2.py collects them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint

import grading
from compare import assert_no_problems, diff_report


_CKPT_BATCH, _CKPT_WIDTH = 4, 16


def _ckpt_blocks(num_blocks: int, dropout: float = 0.0) -> list[nn.Module]:
    """Identical Linear -> ReLU (-> Dropout) blocks, the same weights every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(_CKPT_WIDTH, _CKPT_WIDTH), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []))
                for _ in range(num_blocks)]


def _ckpt_plain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _ckpt_step(blocks, run, x_requires_grad: bool) -> dict:
    """One forward + backward of run(blocks, x) from a fixed RNG state; what came out of it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH, generator=gen).requires_grad_(x_requires_grad)
    weights = torch.randn(_CKPT_BATCH, _CKPT_WIDTH, generator=gen)  # loss = sum(w * y): a non-trivial dL/dy
    for block in blocks:
        block.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        loss = (run(blocks, x) * weights).sum()
        loss.backward()
        next_random = torch.rand(4)  # what the global RNG gives after the step
    out = {"loss": loss.detach(), "next random numbers": next_random}
    if x_requires_grad:
        out["input gradient"] = x.grad
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            out[f"gradient of block {i} {name}"] = p.grad
    return out


def _ckpt_problems(got: dict, expected: dict, what: str) -> list[str]:
    problems = []
    for key, value in expected.items():
        if got.get(key) is None:
            problems.append(f"{what}: no {key} (None)")
        else:
            problem = diff_report(got[key], value, f"{what}: {key}", rtol=1e-5, atol=1e-6)
            if problem:
                problems.append(problem)
    return problems


def test_2_3_same_loss_and_gradients_as_without_checkpointing(grade):
    mod = grade("2.3").load()
    problems = []
    for dropout in (0.0, 0.3):
        for segments in (1, 3, 8):
            for x_grad in (True, False):
                what = f"8 blocks{' with dropout' if dropout else ''}, {segments} segments, input requires_grad={x_grad}"
                blocks = _ckpt_blocks(8, dropout)
                expected = _ckpt_step(blocks, _ckpt_plain, x_grad)
                torchs = _ckpt_step(blocks, lambda b, x: torch.utils.checkpoint.checkpoint_sequential(
                    nn.Sequential(*b), segments, x, use_reentrant=False), x_grad)
                assert_no_problems(_ckpt_problems(torchs, expected, "torch.utils.checkpoint"), "test bug:")
                got = _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x), x_grad)
                problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "checkpoint_sequential must give the loss, gradients and RNG stream of the plain "
                                 "forward/backward (and of torch.utils.checkpoint): restore the RNG state for the "
                                 "recomputation, inside torch.random.fork_rng so the global stream is left as it was")


class _CkptLogged(nn.Module):
    """A block that records (its index, whether grad mode was on) each time it runs."""

    def __init__(self, inner: nn.Module, index: int, log: list):
        super().__init__()
        self.inner, self.index, self.log = inner, index, log

    def forward(self, x):
        self.log.append((self.index, torch.is_grad_enabled()))
        return self.inner(x)


def test_2_3_forward_without_grad_then_recompute_each_segment_in_backward(grade):
    mod = grade("2.3").load()
    log: list = []
    blocks = [_CkptLogged(b, i, log) for i, b in enumerate(_ckpt_blocks(6))]
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH)
    y = mod.checkpoint_sequential(blocks, 3, x)
    forward = list(log)
    y.sum().backward()
    backward = log[len(forward):]
    assert forward == [(i, False) for i in range(6)], (
        f"forward of 6 blocks in 3 segments ran (block, grad enabled) = {forward}; expected each block once, "
        "with grad DISABLED (nothing saved inside a segment)")
    expected = [(4, True), (5, True), (2, True), (3, True), (0, True), (1, True)]
    assert backward == expected, (
        f"backward ran (block, grad enabled) = {backward}; expected each segment recomputed once with grad "
        f"enabled, last segment first: {expected}")


def test_2_3_saved_bytes_fall_as_predicted(grade):
    mod = grade("2.3").load()
    ref = grading.reference("2.3")  # the measuring tape and the formula come from the reference
    n = 16
    a = _CKPT_BATCH * _CKPT_WIDTH * 4  # one block's output (its ReLU result), float32
    blocks = _ckpt_blocks(n)
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH)
    plain = ref.saved_activation_bytes(lambda: _ckpt_plain(blocks, x).sum().backward(), exclude=params)
    assert plain == ref.predicted_saved_bytes(n, None, a, a) == (n + 1) * a, "test bug: the plain stack's bytes"
    problems, measured = [], {}
    for k in (1, 2, 3, 4, 5, 8, 16):
        measured[k] = ref.saved_activation_bytes(lambda: mod.checkpoint_sequential(blocks, k, x).sum().backward(),
                                                 exclude=params)
        expected = ref.predicted_saved_bytes(n, k, a, a)
        if measured[k] != expected:
            problems.append(f"{k} segments: peak saved {measured[k]} bytes = {measured[k] / a:g} block outputs, "
                            f"expected {expected / a:g} (k checkpoints + the blocks of one recomputed segment; "
                            f"without checkpointing: {n + 1})")
    assert_no_problems(problems, f"{n} Linear->ReLU blocks, batch {_CKPT_BATCH} x width {_CKPT_WIDTH} "
                                 f"(one block output = {a} bytes); saved tensors measured with saved_tensors_hooks:")
    assert measured[4] < plain and measured[4] == min(measured.values()), \
        f"k = sqrt(16) = 4 segments must save the least, and less than no checkpointing: {measured}"
