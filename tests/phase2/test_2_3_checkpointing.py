"""Graded tests of exercise 2.3, activation checkpointing (phase2_advanced/guidelines.md, section 2.3).

Run them with `python tests/test_phase2.py -k 2_3` (your code) or
`pytest tests/test_phase2.py -k 2_3` (the reference); tests/test_phase2.py collects them.

What they grade is behaviour: the same loss, gradients and random streams as the plain
stack (with dropout, under autocast, with a frozen parameter, on a GPU's RNG), when each
block runs, and how many bytes autograd holds. torch's own design, whose last segment
is not checkpointed, passes them all.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from common.measure import predicted_saved_bytes, saved_activation_bytes, storage_key
from common.split import balanced_ranges
from compare import assert_no_problems, diff_report


_CKPT_BATCH, _CKPT_WIDTH = 4, 16


def _ckpt_blocks(num_blocks: int, dropout: float = 0.0, expand: int | None = None,
                 tail: type | None = None) -> list[nn.Module]:
    """Identical blocks, the same weights every call: Linear -> ReLU (-> Dropout) (-> tail()).

    expand=e: Linear(d, e*d) -> ReLU -> Linear(e*d, d) -> ReLU, an MLP block that saves
    (e + 1) outputs' worth besides its input.
    """
    d, e = _CKPT_WIDTH, expand
    blocks = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(num_blocks):
            layers = [nn.Linear(d, e * d), nn.ReLU(), nn.Linear(e * d, d), nn.ReLU()] if e else [nn.Linear(d, d), nn.ReLU()]
            layers += [nn.Dropout(dropout)] if dropout else []
            layers += [tail()] if tail else []
            blocks.append(nn.Sequential(*layers))
    return blocks


def _ckpt_plain(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _torch_sequential(blocks, segments, x):
    return torch.utils.checkpoint.checkpoint_sequential(nn.Sequential(*blocks), segments, x, use_reentrant=False)


def _ckpt_step(blocks, run, x_requires_grad: bool, autocast: bool = False, fake_cuda: "_FakeCuda | None" = None) -> dict:
    """One forward + backward of run(blocks, x) from fixed RNG states; what came out of it.

    autocast: forward and loss under torch.autocast("cpu", bfloat16) (exercise 2.2), backward
    outside it. fake_cuda: x lives on the fake cuda:1, whose generator is reset too.
    """
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH, generator=gen)
    if fake_cuda is not None:
        x = x.as_subclass(_OnCuda1)
    x.requires_grad_(x_requires_grad)
    weights = torch.randn(_CKPT_BATCH, _CKPT_WIDTH, generator=gen)  # loss = sum(w * y): a non-trivial dL/dy
    for block in blocks:
        block.zero_grad(set_to_none=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        if fake_cuda is not None:
            fake_cuda.reset()
        with amp:
            loss = (run(blocks, x) * weights).sum()
        loss.backward()
        out = {"loss": loss.detach(), "next random numbers": torch.rand(4)}  # the global RNG after the step
        if fake_cuda is not None:
            for i, g in enumerate(fake_cuda.generators):
                out[f"next random numbers of cuda:{i}"] = torch.rand(4, generator=g)
    if x_requires_grad:
        out["input gradient"] = x.grad
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            out[f"gradient of block {i} {name}"] = p.grad
    return out


def _ckpt_problems(got: dict, expected: dict, what: str) -> list[str]:
    problems = []
    for key, value in expected.items():
        if value is None:  # a frozen parameter, or one no forward uses
            if got.get(key) is not None:
                problems.append(f"{what}: {key} is not None, but without checkpointing that parameter gets no gradient "
                                "(requires_grad=False, or unused by the forward)")
        elif got.get(key) is None:
            problems.append(f"{what}: no {key} (None)")
        else:
            problem = diff_report(got[key].as_subclass(torch.Tensor), value.as_subclass(torch.Tensor),
                                  f"{what}: {key}", rtol=1e-5, atol=1e-6)
            if problem:
                problems.append(problem)
    return problems


def _learner_step(what: str, fix: str, step):
    """step(), with a crash in the graded code reported as the case it happened in and a pointer to the fix."""
    try:
        return step()
    except NotImplementedError:
        raise  # a TODO stays a TODO
    except Exception as exc:
        raise AssertionError(f"{what}: {type(exc).__name__}: {exc}\n{fix}") from exc


def test_2_3_same_loss_and_gradients_as_without_checkpointing(grade):
    mod = grade("2.3").load()
    problems = []
    for dropout in (0.0, 0.3):
        for num_blocks, segments in ((8, 1), (8, 3), (8, 8), (1, 1), (5, 2)):
            for x_grad in (True, False):
                what = (f"{num_blocks} blocks{' with dropout' if dropout else ''}, {segments} segments, "
                        f"input requires_grad={x_grad}")
                blocks = _ckpt_blocks(num_blocks, dropout)
                expected = _ckpt_step(blocks, _ckpt_plain, x_grad)
                torchs = _ckpt_step(blocks, lambda b, x: _torch_sequential(b, segments, x), x_grad)
                assert_no_problems(_ckpt_problems(torchs, expected, "torch.utils.checkpoint"), "test bug:")
                got = _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x), x_grad)
                problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "checkpoint_sequential must give the loss, gradients and RNG stream of the plain "
                                 "forward/backward (and of torch.utils.checkpoint): restore the RNG state for the "
                                 "recomputation, inside torch.random.fork_rng so the global stream is left as it was")


def test_2_3_under_autocast_same_gradients_as_without_checkpointing(grade):
    mod = grade("2.3").load()
    problems = []
    for segments in (1, 3):
        for x_grad in (True, False):
            what = f"6 blocks with dropout under autocast(cpu, bfloat16), {segments} segments, input requires_grad={x_grad}"
            blocks = _ckpt_blocks(6, dropout=0.3)
            expected = _ckpt_step(blocks, _ckpt_plain, x_grad, autocast=True)
            torchs = _ckpt_step(blocks, lambda b, x: _torch_sequential(b, segments, x), x_grad, autocast=True)
            assert_no_problems(_ckpt_problems(torchs, expected, "torch.utils.checkpoint"), "test bug:")
            got = _learner_step(what, "The recomputation in backward runs outside autocast unless you re-enter the "
                                      "autocast state that forward ran under (guidelines 2.3, 'Autocast').",
                                lambda: _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x),
                                                   x_grad, autocast=True))
            problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "under torch.autocast, checkpointing must give the gradients of the same autocast run "
                                 "without checkpointing: record the autocast state in forward (torch.is_autocast_enabled, "
                                 "torch.get_autocast_dtype) and re-enter it (torch.autocast) for the recomputation")


def _freeze_scattered(blocks):
    blocks[1][0].weight.requires_grad_(False)
    blocks[3][0].weight.requires_grad_(False)  # the first parameter of the second of 2 segments
    blocks[4][0].requires_grad_(False)  # weight and bias: the first parameters of the third of 3 segments


def _freeze_middle(blocks):
    for block in blocks[2:4]:  # fine-tuning: frozen middle layers, trainable ones before them
        block.requires_grad_(False)


_FROZEN = {"the weights of blocks 1 and 3 and all of block 4's Linear frozen (the first parameters of segments "
           "2 and 3)": _freeze_scattered,
           "blocks 2 and 3 frozen (all of segment 2 with 3 segments), the blocks before them trained": _freeze_middle}


def test_2_3_frozen_parameter_gets_no_gradient_and_the_others_are_right(grade):
    mod = grade("2.3").load()
    problems = []
    for frozen, freeze in _FROZEN.items():
        for segments in (2, 3):
            for x_grad in (True, False):
                what = f"6 blocks, {frozen}, {segments} segments, input requires_grad={x_grad}"
                blocks = _ckpt_blocks(6, dropout=0.3)
                freeze(blocks)
                expected = _ckpt_step(blocks, _ckpt_plain, x_grad)
                got = _learner_step(what, "A frozen parameter (requires_grad=False) needs no gradient: differentiate "
                                          "only w.r.t. the inputs that need one (ctx.needs_input_grad: x too, even when "
                                          "no parameter of the segment needs one) and return None for the others.",
                                    lambda: _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x),
                                                       x_grad))
                problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "with frozen parameters in a segment (or a whole frozen segment), every other gradient "
                                 "must be as without checkpointing, and the frozen ones None:")


class _WithSpare(nn.Module):
    """A block that holds a parameter its forward never uses (a spare head): it gets no gradient."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block, self.spare = block, nn.Linear(_CKPT_WIDTH, _CKPT_WIDTH)

    def forward(self, x):
        return self.block(x)


def test_2_3_unused_and_shared_parameters(grade):
    """A parameter no forward uses keeps no gradient (None, as without checkpointing); a weight
    shared by blocks of different segments gets the sum of both segments' contributions."""
    mod = grade("2.3").load()
    problems = []
    for segments in (2, 3):
        for x_grad in (True, False):
            what = (f"6 blocks, block 2 holding an unused parameter, blocks 0 and 5 sharing one weight, {segments} "
                    f"segments, input requires_grad={x_grad}")
            blocks = _ckpt_blocks(6, dropout=0.3)
            blocks[2] = _WithSpare(blocks[2])
            blocks[5][0].weight = blocks[0][0].weight  # one Parameter, in the first and the last segment
            expected = _ckpt_step(blocks, _ckpt_plain, x_grad)
            got = _learner_step(what, "A parameter that run_function does not use has no gradient: "
                                      "torch.autograd.grad(..., allow_unused=True) returns None for it.",
                                lambda: _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x), x_grad))
            problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "with an unused parameter and a weight shared across segments, every gradient must be "
                                 "as without checkpointing (None for the unused one):")


# ------------------------------------------------------- a GPU's RNG, without a GPU


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (device, is_cuda, get_device); what ops on it return does too."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = getattr(func, "__self__", None)
        if getattr(func, "__name__", "") == "__get__" and owner is torch.Tensor.device:
            return torch.device("cuda", 1)
        if getattr(func, "__name__", "") == "__get__" and owner is torch.Tensor.is_cuda:
            return True
        if func is torch.Tensor.get_device:
            return 1
        return super().__torch_function__(func, types, args, kwargs or {})


class _FakeCuda:
    """torch.cuda's RNG API for two fake devices, each a CPU torch.Generator; the current device is 0.

    `install(monkeypatch)` puts it in place of torch.cuda's: get/set_rng_state(device),
    *_all, default_generators, device(...) as a context, current_device, device_count,
    is_available, is_initialized. Tensors made _OnCuda1 then look like tensors of cuda:1.
    """

    def __init__(self):
        self.generators = (torch.Generator(), torch.Generator())
        self.current = 0
        self.reset()

    def reset(self):
        for i, g in enumerate(self.generators):
            g.manual_seed(100 + i)

    def index(self, device="cuda") -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def install(self, monkeypatch):
        fake = self

        class device_context:  # torch.cuda.device(d): makes d current inside the block
            def __init__(self, device):
                self.index = None if device is None else fake.index(device)

            def __enter__(self):
                self.previous = fake.current
                if self.index is not None:
                    fake.current = self.index

            def __exit__(self, *exc):
                fake.current = self.previous

        patches = {
            "get_rng_state": lambda device="cuda": fake.generators[fake.index(device)].get_state(),
            "set_rng_state": lambda state, device="cuda": fake.generators[fake.index(device)].set_state(state),
            "get_rng_state_all": lambda: [g.get_state() for g in fake.generators],
            "set_rng_state_all": lambda states: [g.set_state(s) for g, s in zip(fake.generators, states)],
        }
        for module in (torch.cuda, torch.cuda.random):
            for name, fn in patches.items():
                monkeypatch.setattr(module, name, fn)
        monkeypatch.setattr(torch.cuda, "default_generators", self.generators)
        monkeypatch.setattr(torch.cuda, "device", device_context)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(fake.generators))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "_initialized", True)


class _CudaDropout(nn.Module):
    """Dropout(0.5) whose mask comes from the generator of its input's (fake) CUDA device, as on a GPU."""

    fake: _FakeCuda

    def forward(self, x):
        keep = torch.rand(x.shape, generator=self.fake.generators[x.get_device()]) > 0.5
        return x * keep * 2.0


def test_2_3_rng_of_the_gpu_the_input_is_on_is_replayed(grade, monkeypatch):
    """x on cuda:1 while cuda:0 is current: its dropout masks come from cuda:1's generator."""
    mod = grade("2.3").load()
    fake = _FakeCuda()
    fake.install(monkeypatch)
    _CudaDropout.fake = fake
    problems = []
    for segments in (1, 3):
        for x_grad in (True, False):
            what = f"6 blocks with CPU and cuda:1 dropout, input on cuda:1, {segments} segments, requires_grad={x_grad}"
            blocks = _ckpt_blocks(6, dropout=0.3, tail=_CudaDropout)
            expected = _ckpt_step(blocks, _ckpt_plain, x_grad, fake_cuda=fake)
            torchs = _ckpt_step(blocks, lambda b, x: _torch_sequential(b, segments, x), x_grad, fake_cuda=fake)
            assert_no_problems(_ckpt_problems(torchs, expected, "torch.utils.checkpoint on the fake GPU"), "test bug:")
            got = _learner_step(what, "This test stands in for a GPU: torch.cuda's RNG functions (get_rng_state, "
                                      "set_rng_state, their *_all forms, default_generators, device, current_device) "
                                      "act on two fake devices; see the test's _FakeCuda.",
                                lambda: _ckpt_step(blocks, lambda b, x: mod.checkpoint_sequential(b, segments, x),
                                                   x_grad, fake_cuda=fake))
            problems += _ckpt_problems(got, expected, what)
    assert_no_problems(problems, "a segment on a GPU draws its dropout masks from that GPU's generator: save and restore "
                                 "the RNG state of the device x is on (cuda:1 here, not the current device cuda:0), "
                                 "as well as the CPU's, and fork it (torch.random.fork_rng(devices=...)) so its stream "
                                 "is left as it was")


# ------------------------------------------------------------ order and memory


class _CkptLogged(nn.Module):
    """A block that records its index each time it runs."""

    def __init__(self, inner: nn.Module, index: int, log: list):
        super().__init__()
        self.inner, self.index, self.log = inner, index, log

    def forward(self, x):
        self.log.append(self.index)
        return self.inner(x)


def test_2_3_each_segment_recomputed_once_in_backward_last_first(grade):
    mod = grade("2.3").load()
    log: list = []
    blocks = [_CkptLogged(b, i, log) for i, b in enumerate(_ckpt_blocks(6))]
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH)
    y = mod.checkpoint_sequential(blocks, 3, x)
    forward = list(log)
    y.sum().backward()
    backward = log[len(forward):]
    segments = [list(r) for r in balanced_ranges(6, 3)]  # [0, 1], [2, 3], [4, 5]
    assert forward == list(range(6)), f"forward of 6 blocks in 3 segments ran blocks {forward}; expected each once, in order"
    recomputed = [i for segment in reversed(segments) for i in segment]
    assert backward in (recomputed, recomputed[len(segments[-1]):]), (
        f"backward re-ran blocks {backward}; expected each segment recomputed once, last segment first: {recomputed} "
        f"(or {recomputed[len(segments[-1]):]} if the last segment kept its activations, as torch's "
        "checkpoint_sequential does). No recomputation means the activations were kept: no memory saved")


def _ctx_attributes_holding_activations(y: torch.Tensor, params) -> list[str]:
    """'ctx.<name>' for each attribute of a custom Function in y's graph holding a floating tensor that is not a parameter."""
    param_keys = {storage_key(p) for p in params}
    found, seen, nodes = set(), set(), [y.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name, value in getattr(node, "__dict__", {}).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) and v.is_floating_point() and storage_key(v) not in param_keys
                   for v in values):
                found.add(f"ctx.{name}")
        nodes.extend(fn for fn, _ in node.next_functions)
    return sorted(found)


@pytest.mark.parametrize("expand", [None, 4], ids=["Linear-ReLU blocks (c = A)", "MLP blocks (A = 5c)"])
def test_2_3_saved_bytes_fall_as_predicted(grade, expand):
    """Peak bytes autograd holds = max over segments j of (j checkpoints + segment j's blocks).

    Linear -> ReLU blocks save one output each (A = c): least at k = sqrt(16) = 4. MLP blocks
    (Linear(d, 4d) -> ReLU -> Linear(4d, d) -> ReLU) save 5 outputs (A = 5c): least near
    k = sqrt(16 * 5) ~ 9, and one checkpoint per block (k = 16) beats k = 4.
    """
    mod = grade("2.3").load()
    n = 16
    a = _CKPT_BATCH * _CKPT_WIDTH * 4  # one block output, float32: the checkpoint c
    block = a * (expand + 1) if expand else a  # A: what a block saves besides its input
    blocks = _ckpt_blocks(n, expand=expand)
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(_CKPT_BATCH, _CKPT_WIDTH)

    def measure(run) -> int:  # floating-point storages only: a saved RNG state (uint8) is no activation
        return saved_activation_bytes(lambda: run().sum().backward(), exclude=params, count_if=torch.is_floating_point)

    plain = measure(lambda: _ckpt_plain(blocks, x))
    assert plain == predicted_saved_bytes(n, None, a, block), "test bug: the plain stack's bytes"
    problems, measured, hidden = [], {}, []
    for k in (1, 2, 3, 4, 5, 8, 16):
        measured[k] = measure(lambda: mod.checkpoint_sequential(blocks, k, x))
        expected = predicted_saved_bytes(n, k, a, block)
        if measured[k] > expected:
            problems.append(f"{k} segments: peak saved {measured[k] / a:g} block outputs, expected {expected / a:g} "
                            f"(k checkpoints + the blocks of one recomputed segment; without checkpointing: "
                            f"{plain / a:g})")
        elif measured[k] < expected:
            hidden += _ctx_attributes_holding_activations(mod.checkpoint_sequential(blocks, k, x), params)
            problems.append(f"{k} segments: autograd saw only {measured[k] / a:g} block outputs, expected "
                            f"{expected / a:g}")
    if any(measured[k] < predicted_saved_bytes(n, k, a, block) for k in measured):
        where = (f"a tensor kept as a ctx attribute: {', '.join(sorted(set(hidden)))}" if hidden else
                 "a tensor kept as a ctx attribute? (torch.utils.checkpoint with use_reentrant=False also keeps its "
                 "recomputed tensors out of their sight: this exercise asks for CheckpointFunction)")
        problems.append(f"fewer bytes than k checkpoints + one segment: tensors are kept where saved_tensors_hooks do "
                        f"not see them ({where}). Use ctx.save_for_backward(x), not a ctx attribute: then autograd "
                        "frees x after backward and checks that nobody modified it in place")
    shape = f"MLP blocks d -> {expand}d -> d" if expand else "Linear->ReLU blocks"
    assert_no_problems(problems, f"{n} {shape}, batch {_CKPT_BATCH} x width {_CKPT_WIDTH} (one block output = {a} "
                                 f"bytes, a block saves {block // a} besides its input); saved tensors measured with "
                                 f"saved_tensors_hooks, parameters excluded:")
    best = 8 if expand else 4  # sqrt(n * A / c) = sqrt(80) ~ 8.9, or sqrt(16) = 4
    assert measured[best] == min(measured.values()) < plain, f"test bug: k = {best} should save the least: {measured}"


def _direct_case(mod, x_grad: bool, params: str, mode: str):
    """CheckpointFunction.apply(run, x, *params) against run(x) without checkpointing: output and every gradient.
    params: "all" (the Linear's weight and bias), "frozen" (the bias requires no grad), "spare" (a parameter run
    does not use, passed too), "none" (no params at all: x must then need a gradient). mode: "grad", "no_grad"
    (an evaluation: no graph), "autocast" (bf16 on the CPU)."""
    torch.manual_seed(5)
    linear, spare = nn.Linear(4, 4), nn.Parameter(torch.randn(4))
    if params == "frozen":
        linear.bias.requires_grad_(False)
    x = torch.randn(3, 4, requires_grad=x_grad)

    def run(t):
        return torch.tanh(linear(t)) * 2.0

    passed = {"all": [linear.weight, linear.bias], "frozen": [linear.weight, linear.bias],
              "spare": [linear.weight, linear.bias, spare], "none": []}[params]
    context = torch.no_grad() if mode == "no_grad" else \
        torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    results = {}
    for name, call in (("checkpointed", lambda: mod.CheckpointFunction.apply(run, x, *passed)), ("plain", lambda: run(x))):
        for t in (x, linear.weight, linear.bias, spare):
            t.grad = None
        with context:
            y = call()
        if y.requires_grad:
            y.float().pow(2).sum().backward()
        results[name] = {"y": y.detach().float(), "requires_grad": y.requires_grad,
                         "grads": {k: None if t.grad is None else t.grad.clone()
                                   for k, t in (("x", x), ("weight", linear.weight), ("bias", linear.bias),
                                                ("spare", spare))}}
    return results


def test_2_3_checkpoint_function_applied_directly(grade):
    """CheckpointFunction.apply(run_function, x, *params) used alone, as its docstring allows: x that needs no
    gradient (the data) with params that do; a frozen parameter among params (None); a parameter run_function
    does not use (None); no params, x needing a gradient; under torch.no_grad() (no graph, the same output) and
    under autocast (the same output and gradients as run_function under autocast)."""
    mod = grade("2.3").load()
    problems = []
    for x_grad, params, mode in [(False, "all", "grad"), (True, "all", "grad"), (False, "frozen", "grad"),
                                 (True, "spare", "grad"), (True, "none", "grad"), (False, "all", "no_grad"),
                                 (True, "all", "autocast")]:
        what = f"CheckpointFunction.apply(run, x, <{params} params>), x.requires_grad={x_grad}, {mode}"
        got = _direct_case(mod, x_grad, params, mode)
        ours, plain = got["checkpointed"], got["plain"]
        tol = dict(rtol=2e-2, atol=2e-2) if mode == "autocast" else dict(rtol=1e-6, atol=1e-7)
        problem = diff_report(ours["y"], plain["y"], f"{what}: output", **tol)
        if problem:
            problems.append(problem)
        if ours["requires_grad"] != plain["requires_grad"]:
            problems.append(f"{what}: the output requires_grad={ours['requires_grad']}, without checkpointing "
                            f"{plain['requires_grad']}")
        for name, want in plain["grads"].items():
            have = ours["grads"][name]
            if params == "spare" and name == "spare" or params == "none" and name in ("weight", "bias"):
                want = None  # passed but unused by run_function, or not passed: no gradient through the Function
            if (have is None) != (want is None):
                problems.append(f"{what}: the gradient of {name} is {'None' if have is None else 'set'}, "
                                f"expected {'None' if want is None else 'a tensor'}")
            elif want is not None:
                problem = diff_report(have, want, f"{what}: gradient of {name}", **tol)
                if problem:
                    problems.append(problem)
    assert_no_problems(problems, "CheckpointFunction used directly must give run_function's output and gradients "
                                 "(None where a parameter needs none or is not used):")


def test_2_3_checkpoint_sequential_in_an_evaluation(grade):
    """An evaluation: blocks in eval mode (dropout off), under torch.no_grad(), and in eval mode with grad: the
    output of the blocks run one after the other, and no graph kept under torch.no_grad()."""
    mod = grade("2.3").load()
    problems = []
    blocks = _ckpt_blocks(6, dropout=0.3)
    for block in blocks:
        block.eval()
    x = torch.randn(4, _CKPT_WIDTH, generator=torch.Generator().manual_seed(2))
    expected = x
    for block in blocks:
        expected = block(expected)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = mod.checkpoint_sequential(blocks, 3, x)
        what = f"checkpoint_sequential(6 blocks in eval mode, 3 segments, x){'' if grad else ' under torch.no_grad()'}"
        problem = diff_report(got.detach(), expected.detach(), f"{what}: output", rtol=1e-6, atol=1e-7)
        if problem:
            problems.append(problem)
        if got.requires_grad != grad:
            problems.append(f"{what}: the output requires_grad={got.requires_grad}, expected {grad}")
    assert_no_problems(problems, "checkpoint_sequential in an evaluation must compute the blocks' output:")
