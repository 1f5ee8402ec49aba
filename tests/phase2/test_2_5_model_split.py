"""Graded tests of exercise 2.5, naive model split (phase2_advanced/guidelines.md, section 2.5).

Run them with `python tests/test_phase2.py -k 2_5` (your code) or
`pytest tests/test_phase2.py -k 2_5` (the reference); tests/test_phase2.py collects them.
All of them share one world of 3 ranks (see _split_rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grading
from compare import assert_no_problems, diff_report
from common.distributed import current_device
from common.launch import run_world
from common.models import MLP


def _pp_layers(hidden: tuple[int, ...]) -> nn.Sequential:
    """The same MLP in every process: Flatten, [Linear, ReLU] per hidden width, Linear (1 + 2h + 1 layers)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP(64, 10, hidden=hidden).net


class Cast(nn.Module):
    """Converts its input to `dtype`: puts a low- (or high-) precision activation on a cut."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _cnn_layers() -> nn.Sequential:
    """8 layers; cut in two before the third conv: (B, 8, 8, 8) features cross it, and a conv needs them 4-D."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def _cast_layers(dtype: torch.dtype) -> nn.Sequential:
    """6 layers, fp32 weights; cut in two after Cast(dtype): a (B, 32) activation in `dtype` crosses it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Cast(dtype), nn.ReLU(), Cast(torch.float32),
                             nn.Linear(32, 10))


MODELS = {"cnn": _cnn_layers, "bfloat16 cut": lambda: _cast_layers(torch.bfloat16),
          "float16 cut": lambda: _cast_layers(torch.float16), "float64 cut": lambda: _cast_layers(torch.float64)}


def _pp_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _unsplit(layers: nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict]:
    """Ground truth: the unsplit model in one process, loss.backward() once per batch (gradients add up).
    Returns the last batch's loss and every gradient, named by layer index."""
    for x, y in batches:
        loss = F.cross_entropy(layers(x), y)
        loss.backward()
    return loss.item(), {f"layer {i} {n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def _pp_expected(hidden: tuple[int, ...], batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Ground truth for the MLP of `hidden` on one batch of `batch` samples."""
    return _unsplit(_pp_layers(hidden), [_pp_batch(batch)])


def _pp_stage_grads(stage) -> dict[str, torch.Tensor | None]:
    """This stage's gradients, named by the layer's index in the unsplit model."""
    return {f"layer {i} {n}": None if p.grad is None else p.grad.detach().cpu().clone()
            for j, i in enumerate(stage.layer_range) for n, p in stage.layers[j].named_parameters()}


def _pp_loss(loss) -> dict:
    """A returned loss as plain data: its value, and whether it still holds a graph (it must be detached)."""
    return {"loss": None if loss is None else float(loss),
            "loss_attached": isinstance(loss, torch.Tensor) and (loss.requires_grad or loss.grad_fn is not None)}


def _pp_problems(results: list[dict], expected_loss: float, expected_grads: dict, num_layers: int, what: str) -> list[str]:
    """Compare every rank's part with the unsplit model: layers held once, loss on the last rank, each gradient."""
    world, problems = len(results), []
    holders = {i: [r for r, res in enumerate(results) if i in res["layers"]] for i in range(num_layers)}
    for i, ranks in holders.items():
        if len(ranks) != 1:
            problems.append(f"{what}: layer {i} of {num_layers} is held by ranks {ranks}, expected exactly one "
                            f"(stages hold {[res['layers'] for res in results]})")
    for rank, res in enumerate(results):
        if rank < world - 1 and res["loss"] is not None:
            problems.append(f"{what}: rank {rank} returned a loss; only the last stage (rank {world - 1}) computes it")
    last = results[-1]["loss"]
    if results[-1].get("loss_attached"):
        problems.append(f"{what}: the loss returned on rank {world - 1} still requires grad (it holds the whole graph "
                        "of the step): return it detached")
    if last is None:
        problems.append(f"{what}: the last stage (rank {world - 1}) returned no loss")
    elif abs(last - expected_loss) > 1e-5 * max(1.0, abs(expected_loss)):
        problems.append(f"{what}: loss {last:.6g} on rank {world - 1}, the unsplit model gives {expected_loss:.6g}")
    for rank, res in enumerate(results):
        for key, grad in res["grads"].items():
            if grad is None:
                problems.append(f"{what}: rank {rank} has no gradient for {key}: did the gradient of its output come "
                                f"back from rank {rank + 1}, and did the receiving rank set requires_grad on its input?")
            elif key in expected_grads:
                problem = diff_report(grad, expected_grads[key], f"{what}: rank {rank} {key} gradient", rtol=1e-4, atol=1e-6)
                if problem:
                    problems.append(problem)
    return problems


# ------------------------------------------------------------ activation round trips

# (shape, dtype) sent by rank 0 with send_activation, received by rank 1 with recv_activation
ROUND_TRIPS = [((5, 7), torch.bfloat16), ((3, 4, 5), torch.float16), ((2, 8, 4, 4), torch.float32),
               ((6,), torch.float64), ((2, 1, 3, 1, 2, 1, 1, 2), torch.float32)]


def _round_trip_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers: exact in every dtype, so a good transfer gives equal bits."""
    return (torch.arange(torch.Size(shape).numel()) % 13 - 6).reshape(shape).to(dtype)


class _WrongSize(Exception):
    pass


def _message_bytes(mod, activation: torch.Tensor) -> list[int]:
    """Bytes of each message this implementation's send_activation queues (a dry run: nothing is sent)."""
    class DryRun(mod.Mailbox):
        def send(self, tensor, dst):
            sizes.append(tensor.numel() * tensor.element_size())

    sizes: list[int] = []
    DryRun().send_activation(activation, 1)
    return sizes


def _checked_mailbox(mod, expected: list[int], problems: list[str], case: str):
    """The implementation's Mailbox whose recv first checks the buffer against the next message's size.

    A buffer of the wrong size would make gloo abort the process (a bigger message) or leave
    it half filled without a word (a smaller one, e.g. bfloat16 data in a float32 buffer);
    here the message is drained into a scratch buffer instead and the case stops.
    """
    class Checked(mod.Mailbox):
        receives = 0

        def recv(self, buffer, src):
            Checked.receives += 1
            got = buffer.numel() * buffer.element_size()
            want = expected.pop(0) if expected else None
            if want != got:
                problems.append(f"{case}: receive {Checked.receives} got a buffer of {got} bytes ({buffer.dtype}, "
                                f"shape {tuple(buffer.shape)}) for a message of {want} bytes: allocate the dtype and "
                                "shape the header names")
                for size in ([want] if want is not None else []) + expected:  # drain the rest of this activation
                    super().recv(torch.empty(size, dtype=torch.uint8, device=buffer.device), src)
                expected.clear()
                raise _WrongSize
            return super().recv(buffer, src)

    return Checked()


def _round_trips(mod, rank: int) -> list[str]:
    """Rank 0 sends every ROUND_TRIPS activation, rank 1 receives and checks it; returns rank 1's problems."""
    problems: list[str] = []
    device = current_device()
    for shape, dtype in ROUND_TRIPS:
        sent = _round_trip_tensor(shape, dtype).to(device)
        case = f"{dtype} activation of shape {shape}"
        if rank == 0:
            box = mod.Mailbox()
            box.send_activation(sent, 1)
            box.flush()
        elif rank == 1:
            expected = _message_bytes(mod, sent)
            mine: list[str] = []
            try:
                got = _checked_mailbox(mod, expected, mine, case).recv_activation(0, device)
            except _WrongSize:
                problems += mine
                continue
            for size in expected:  # messages it never received: drain them, or the sender waits forever
                mod.Mailbox().recv(torch.empty(size, dtype=torch.uint8, device=device), 0)
            if expected:
                problems.append(f"{case}: recv_activation received {len(expected)} message(s) fewer than "
                                "send_activation sent")
            elif got.dtype != dtype or tuple(got.shape) != shape:
                problems.append(f"{case}: recv_activation returned {got.dtype} of shape {tuple(got.shape)}")
            elif not torch.equal(got.cpu(), sent.cpu()):
                problems.append(f"{case}: received values differ from the sent ones: {got.flatten()[:6].tolist()} "
                                f"vs {sent.flatten()[:6].tolist()}")
    return problems


# ------------------------------------------------ the header protocol, without a world
#
# send_activation and recv_activation on a mailbox whose messages stay in this process: what one side
# queues is what the other receives, byte for byte, into the buffer it allocates (as gloo would copy it).


class _Wire:
    """Messages in flight, in order: a send appends a copy of the tensor, a receive takes the first."""

    def __init__(self):
        self.messages: list[torch.Tensor] = []

    def mailbox(self, mod, problems: list[str], case: str):
        wire = self

        class Loopback(mod.Mailbox):
            def send(self, tensor, dst):
                wire.messages.append(tensor.detach().clone().contiguous())
                return mod.Delivery(self, dst)  # never posted: the wire is the transfer

            def recv(self, buffer, src):
                if not wire.messages:
                    problems.append(f"{case}: a receive with no message left (the sender queued fewer)")
                    raise _WrongSize
                message = wire.messages.pop(0)
                nbytes = message.numel() * message.element_size()
                if buffer.numel() * buffer.element_size() != nbytes or not buffer.is_contiguous():
                    problems.append(f"{case}: a {nbytes}-byte message ({message.dtype}, shape {tuple(message.shape)}) "
                                    f"received into a buffer of {buffer.numel() * buffer.element_size()} bytes "
                                    f"({buffer.dtype}, shape {tuple(buffer.shape)})")
                    raise _WrongSize
                buffer.reshape(-1).view(torch.uint8).copy_(message.reshape(-1).view(torch.uint8))
                return buffer

            def post(self):
                pass

            def flush(self):
                pass

        return Loopback()


_PP_PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=80,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])
_PP_ACTIVATIONS = st.tuples(st.lists(st.integers(1, 3), min_size=0, max_size=8),
                            st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
                            st.booleans())


def _pp_activation(shape: list[int], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """Small integers (exact in every dtype); transposed: the same values, not contiguous in memory."""
    t = _round_trip_tensor(tuple(shape), dtype)
    return t.transpose(0, -1).contiguous().transpose(0, -1) if transposed and t.dim() >= 2 else t


def _pp_receive(sender_mod, receiver_mod, activation: torch.Tensor, case: str) -> list[str]:
    """sender_mod's send_activation, then receiver_mod's recv_activation, over a _Wire."""
    problems: list[str] = []
    wire = _Wire()
    sent = activation.clone()
    wire.mailbox(sender_mod, problems, case).send_activation(activation, 1)
    try:
        got = wire.mailbox(receiver_mod, problems, case).recv_activation(0, torch.device("cpu"))
    except _WrongSize:
        return problems
    if wire.messages:
        problems.append(f"{case}: {len(wire.messages)} message(s) left over: the receiver took fewer than were sent")
    elif not isinstance(got, torch.Tensor) or got.dtype != activation.dtype or got.shape != activation.shape:
        problems.append(f"{case}: received {got.dtype if isinstance(got, torch.Tensor) else type(got).__name__} of "
                        f"shape {tuple(getattr(got, 'shape', ()))}")
    elif not torch.equal(got, activation):
        problems.append(f"{case}: received values differ from the sent ones")
    if not torch.equal(activation, sent):
        problems.append(f"{case}: send_activation modified the activation it sent")
    return problems


@_PP_PROPERTY
@given(activation=_PP_ACTIVATIONS)
def test_2_5_header_protocol_matches_the_reference(grade, activation):
    """Any activation send_activation can describe (0 to 8 dims, every dtype of DTYPES, contiguous or not): the
    header is [dtype code, ndim, dim0, ..., dim7] as int64, zeros after the last dim, then the data; the
    reference's recv_activation reads what yours sends, and yours reads what the reference's sends."""
    mod, ref = grade("2.5").load(), grading.reference("2.5")
    activation = _pp_activation(*activation)
    case = f"{activation.dtype} activation of shape {tuple(activation.shape)}"
    if not activation.is_contiguous():
        case += " (not contiguous)"
    wire = _Wire()
    wire.mailbox(mod, [], case).send_activation(activation, 1)
    header = [ref.DTYPES.index(activation.dtype), activation.dim(), *activation.shape]
    header += [0] * (ref.HEADER_LEN - len(header))
    first = wire.messages[0] if wire.messages else None
    assert first is not None and first.dtype == torch.int64 and first.tolist() == header, (
        f"{case}: send_activation's first message is "
        f"{None if first is None else (first.dtype, first.tolist())}; the header is int64 {header}: "
        "[dtype code = index in DTYPES, ndim, dim0, ..., dim7], zeros after the last dim")
    problems = _pp_receive(mod, ref, activation, f"{case}, your send_activation to the reference's recv")
    problems += _pp_receive(ref, mod, activation, f"{case}, the reference's send_activation to your recv")
    assert_no_problems(problems, "the activation protocol (guidelines 2.5, \"Shapes and dtypes\"):")


@pytest.mark.parametrize("shape,dtype", [((1,) * 9, torch.float32), ((2, 1, 1, 1, 1, 1, 1, 1, 2), torch.bfloat16),
                                         ((2, 3), torch.int64), ((4,), torch.int32), ((2, 2), torch.bool),
                                         ((3,), torch.uint8), ((2, 2), torch.complex64)])
def test_2_5_send_activation_rejects_what_the_header_cannot_describe(grade, shape, dtype):
    """More than MAX_DIMS dims, or a dtype not in DTYPES: ValueError (the header has no code for it)."""
    mod = grade("2.5").load()
    activation = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError):
        _Wire().mailbox(mod, [], "").send_activation(activation, 1)
        pytest.fail(f"send_activation accepted a {dtype} tensor of {len(shape)} dims; the header describes at most "
                    f"MAX_DIMS = {mod.MAX_DIMS} dims of a dtype in DTYPES: expected ValueError", pytrace=False)


# ------------------------------------------------------------------ the shared world

SPLIT_HIDDEN, SPLIT_BATCH = (32, 32, 16), 12  # 8 layers; the cuts carry (B, 32) and (B, 16) activations


def _run_split(mod, layers: nn.Sequential, num_stages: int, batches: list, rank: int) -> dict | None:
    """Ranks 0..num_stages-1 run forward_backward once per batch (no zero_grad in between)."""
    if rank >= num_stages:
        return None
    stage = mod.PipelineStage(layers, rank, num_stages, device=current_device())
    first, last = rank == 0, rank == num_stages - 1
    for x, y in batches:
        loss = mod.forward_backward(stage, x if first else None, y if last else None, F.cross_entropy)
    return {"layers": list(stage.layer_range), **_pp_loss(loss), "grads": _pp_stage_grads(stage)}


def _split_rank(ref: grading.ModuleRef, hidden: tuple[int, ...], batch: int) -> dict:
    """Every 2.5 check in one world of 3 ranks (rank 2 sits out the 2-stage runs, ranks 1 and 2 the 1-stage one):

    split: the MLP over 3, 2 and 1 stages (one stage is first and last at once); round_trips: activations of several ranks and
    dtypes through send_activation/recv_activation; models: a CNN and MLPs whose cut carries
    bf16/fp16/fp64 (only if every round trip worked: a wrong buffer could abort a rank);
    accumulate: two forward_backward calls on two batches, no zero_grad in between.
    """
    mod = ref.load()
    dist.barrier()  # NCCL: the group's first collective must involve every rank (see Mailbox)
    rank, results = dist.get_rank(), {"split": {}, "models": {}}
    batches = [_pp_batch(batch, seed) for seed in (1, 2)]
    for num_stages in (3, 2, 1):
        results["split"][num_stages] = _run_split(mod, _pp_layers(hidden), num_stages, batches[:1], rank)
    results["round_trips"] = _round_trips(mod, rank)
    failed = torch.tensor([float(bool(results["round_trips"]))], device=current_device())
    dist.all_reduce(failed)
    if not failed.item():
        for name, build in MODELS.items():
            results["models"][name] = _run_split(mod, build(), 2, batches[:1], rank)
    results["accumulate"] = _run_split(mod, _pp_layers(hidden), 2, batches, rank)
    return results


_split_worlds: dict = {}  # ModuleRef -> results or exception: one world serves every 2.5 test


def _pp_shared_world(cache: dict, ref: grading.ModuleRef, worker, world_size: int, args: tuple):
    if ref not in cache:
        try:
            cache[ref] = run_world(worker, world_size, args=(ref, *args))
        except Exception as exc:  # noqa: BLE001 - re-raised by every test that shares the world
            cache[ref] = exc
    if isinstance(cache[ref], Exception):
        raise cache[ref]
    return cache[ref]


def _split_results(ref: grading.ModuleRef) -> list[dict]:
    return _pp_shared_world(_split_worlds, ref, _split_rank, 3, (SPLIT_HIDDEN, SPLIT_BATCH))


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_2_5_split_model_matches_one_process(grade, num_stages):
    results = _split_results(grade("2.5"))
    loss, grads = _pp_expected(SPLIT_HIDDEN, SPLIT_BATCH)
    per_rank = [results[rank]["split"][num_stages] for rank in range(num_stages)]
    problems = _pp_problems(per_rank, loss, grads, 2 * len(SPLIT_HIDDEN) + 2, f"{num_stages} stages")
    assert_no_problems(problems, f"the model split over {num_stages} ranks differs from the unsplit model in one process:")


def test_2_5_activations_of_any_shape_and_dtype_round_trip(grade):
    results = _split_results(grade("2.5"))
    assert_no_problems(results[1]["round_trips"],
                       "rank 0 sent activations with send_activation, rank 1 received them with recv_activation:")


def test_2_5_cnn_and_low_precision_cuts_match_one_process(grade):
    results = _split_results(grade("2.5"))
    if not results[0]["models"]:
        pytest.fail("not run: an activation round trip failed (see test_2_5_activations_of_any_shape_and_dtype_"
                    "round_trip); a buffer of the wrong dtype or shape can abort a rank", pytrace=False)
    problems = []
    for name, build in MODELS.items():
        layers = build()
        loss, grads = _unsplit(layers, [_pp_batch(SPLIT_BATCH)])
        per_rank = [results[rank]["models"][name] for rank in range(2)]
        problems += _pp_problems(per_rank, loss, grads, len(layers), f"{name} on 2 stages")
    assert_no_problems(problems, "a CNN (4-D features at the cut) and MLPs whose cut carries bfloat16, float16 or "
                       "float64 differ from the unsplit model in one process:")


def test_2_5_forward_backward_accumulates_gradients(grade):
    results = _split_results(grade("2.5"))
    loss, grads = _unsplit(_pp_layers(SPLIT_HIDDEN), [_pp_batch(SPLIT_BATCH, seed) for seed in (1, 2)])
    per_rank = [results[rank]["accumulate"] for rank in range(2)]
    problems = _pp_problems(per_rank, loss, grads, 2 * len(SPLIT_HIDDEN) + 2, "two calls on 2 stages")
    assert_no_problems(problems, "forward_backward on batch 1, then on batch 2, without zero_grad: every gradient "
                       "must be the sum of both batches' gradients, as two loss.backward() calls leave it:")
