"""Graded tests of exercise 2.12, a layout planner (phase2_advanced/guidelines.md, section 2.12).

Run them with `python tests/test_phase2.py -k 2_12` (your code) or
`pytest tests/test_phase2.py -k 2_12` (the reference); tests/test_phase2.py collects them.

The planner is pure arithmetic, so most tests compare it with the formulas of its docstrings,
derived here by hand (a second spelling, not the reference's code), on hand-picked cases and on
cases Hypothesis draws (seeded: the same cases every run). One world of 4 CPU ranks measures
what the course's own code sends and holds (2.4's ZeRO stages, 2.7's layers on 2.8's mesh, 2.9's
sequence-parallel block and ring attention, 2.6's pipelines, 2.11's train_step on three meshes): the
planner must predict those bytes exactly and the memory within 10%. The world runs the reference code of those exercises
only, once per session, whatever planner is graded.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grading
from common.launch import run_world
from common.measure import CollectiveLog, PointToPointLog, ring_elements_sent, training_memory
from compare import assert_no_problems

_PL_PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=120,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------ hand-derived formulas (the docstrings, spelled again)


def _pl_params_per_layer(h: int, a: int, kv_heads: int, f: int, gated: bool, bias: bool, tp: int) -> int:
    d = h // a
    q, k, v, out = h * h, h * kv_heads * d, h * kv_heads * d, h * h
    mlp = (3 if gated else 2) * h * f
    sharded = q + k + v + out + mlp + ((h + 2 * kv_heads * d + (2 if gated else 1) * f) if bias else 0)
    replicated = 2 * (2 * h if bias else h) + (2 * h if bias else 0)
    return sharded // tp + replicated


def _pl_psi(model, pp: int, tp: int) -> int:
    """Parameters of the largest pipeline rank on one tp rank."""
    per_layer = _pl_params_per_layer(model.hidden, model.heads, model.kv_heads or model.heads, model.ffn_hidden,
                                     model.gated, model.bias, tp)
    layers = model.layers // pp * per_layer
    table = math.ceil(model.vocab / tp) * model.hidden
    norm = (2 if model.bias else 1) * model.hidden
    output = 0 if (model.tied and pp == 1) else table
    if pp == 1:
        return layers + table + norm + output
    return max(layers + table, layers + norm + output)


def _pl_schedule(schedule: str, p: int, m: int, v: int) -> list:
    """2.6's reference schedule of that kind (the ground truth of the docstring's counts)."""
    pipeline = grading.reference("2.6")
    return {"gpipe": lambda: pipeline.gpipe_schedule(p, m), "1f1b": lambda: pipeline.one_f_one_b_schedule(p, m),
            "zb-h1": lambda: pipeline.zero_bubble_schedule(p, m),
            "interleaved": lambda: pipeline.interleaved_schedule(p, m, v)}[schedule]()


def _pl_in_flight(schedule: str, p: int, m: int, v: int) -> int:
    """Rank 0's peak, counted by walking 2.6's reference schedule."""
    return grading.reference("2.6").max_in_flight(_pl_schedule(schedule, p, m, v)[0])


def _pl_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The bubble of 2.6's time grid of that schedule: idle / (steps x ranks), F = B = W = 1 step."""
    pipeline = grading.reference("2.6")
    return pipeline.bubble_fraction(pipeline.time_grid(_pl_schedule(schedule, p, m, v)))


def _pl_ring(kind: str, n: int, size: float) -> float:
    if n == 1:
        return 0.0
    return size * {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
                   "send": 1.0}[kind]


def _pl_bytes(mod, model, layout, batch, precision) -> dict:
    return {dim: float(v) for dim, v in mod.communication_bytes(model, layout, batch, precision).items()}


def _pl_close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


# ------------------------------------------------------------------ drawn cases


@st.composite
def _pl_cases(draw, pipelines: bool = True):
    """(model, layout, batch) that check_layout accepts: tp, cp, pp, dp, v, m, sp drawn, sizes made to divide."""
    tp, cp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4])) if pipelines else 1
    schedule = "1f1b" if pp == 1 else draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]))
    v = draw(st.sampled_from([1, 2, 3])) if schedule == "interleaved" else 1
    m = pp * draw(st.integers(1, 3)) if pp > 1 else draw(st.integers(1, 4))
    zero = draw(st.integers(0, 1 if pp > 1 else 3))
    heads = tp * draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (heads, heads // 2, tp) if h >= tp and h % tp == 0 and heads % h == 0]))
    model = draw(st.builds(
        lambda layers, d, f, s, vocab, gated, bias, tied, flash: dict(
            name="drawn", layers=layers, hidden=heads * d, heads=heads, ffn_hidden=f, seq_len=s, vocab=vocab,
            kv_heads=kv_heads, gated=gated, bias=bias, tied=tied, flash=flash),
        st.integers(1, 3).map(lambda k: k * pp * v), st.sampled_from([4, 8, 16]), st.integers(1, 8).map(lambda k: k * 4 * tp),
        st.integers(1, 4).map(lambda k: k * 2 * cp), st.integers(5, 100), st.booleans(), st.booleans(), st.booleans(),
        st.booleans()))
    b = draw(st.integers(1, 3))
    layout = dict(dp=dp, zero=zero, tp=tp, pp=pp, schedule=schedule, chunks=v, cp=cp, microbatches=m,
                  checkpointing=draw(st.booleans()), sp=draw(st.booleans()))
    return model, layout, b * dp * m


def _pl_build(mod, case):
    model, layout, batch = case
    return mod.Model(**model), mod.Layout(**layout), batch


def _pl_text(model, layout, batch) -> str:
    return f"{model}, {layout}, batch={batch}"


# ------------------------------------------------------------------ the schedule


@_PL_PROPERTY
@given(case=st.tuples(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]), st.integers(1, 6),
                      st.integers(1, 4), st.integers(1, 4)))
def test_2_12_in_flight_matches_the_pipeline_schedules(grade, case):
    """in_flight equals 2.6's max_in_flight of that schedule's rank 0, for every schedule, p, m (interleaved: m a
    multiple of p, any v); the micro-batch count matters (GPipe holds m)."""
    mod = grade("2.12").load()
    schedule, p, k, v = case
    m = p * k if schedule == "interleaved" else k
    v = v if schedule == "interleaved" else 1
    got, expected = mod.in_flight(schedule, p, m, v), _pl_in_flight(schedule, p, m, v)
    assert got == expected, (f"in_flight({schedule!r}, pp={p}, microbatches={m}, chunks={v}) = {got}, expected "
                             f"{expected}: the peak of (chunk, micro-batch) activations rank 0 holds in 2.6's schedule")


@_PL_PROPERTY
@given(case=st.tuples(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]), st.integers(1, 6),
                      st.integers(1, 4), st.integers(1, 4)))
def test_2_12_bubble_fraction_matches_the_pipeline_time_grid(grade, case):
    """bubble_fraction equals the idle share of 2.6's time grid of that schedule (F, B, W one step each; m >= p), for
    every schedule; 0 with one stage."""
    mod = grade("2.12").load()
    schedule, p, k, v = case
    m = p * k
    v = v if schedule == "interleaved" else 1
    got, expected = mod.bubble_fraction(schedule, p, m, v), _pl_bubble(schedule, p, m, v)
    assert _pl_close(got, expected), (f"bubble_fraction({schedule!r}, pp={p}, microbatches={m}, chunks={v}) = {got}, "
                                      f"expected {expected} (2.6's time grid: idle slots / all slots)")


def test_2_12_hand_derived_schedule_cases(grade):
    mod = grade("2.12").load()
    cases = [(("gpipe", 4, 8, 1), 8, 3 / 11), (("1f1b", 4, 8, 1), 4, 3 / 11), (("1f1b", 4, 2, 1), 2, 3 / 5),
             (("interleaved", 4, 8, 2), 11, 3 / 19), (("interleaved", 4, 4, 1), 4, 3 / 7),
             (("zb-h1", 4, 8, 1), 4, 3 / 27), (("1f1b", 1, 5, 1), 1, 0.0), (("gpipe", 1, 5, 1), 5, 0.0)]
    problems = []
    for args, flight, bubble in cases:
        if mod.in_flight(*args) != flight:
            problems.append(f"in_flight{args} = {mod.in_flight(*args)}, expected {flight}")
        if not _pl_close(mod.bubble_fraction(*args), bubble):
            problems.append(f"bubble_fraction{args} = {mod.bubble_fraction(*args)}, expected {bubble}")
    assert_no_problems(problems)


# ------------------------------------------------------------------ the ring


def test_2_12_ring_bytes(grade):
    """ring_bytes: all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, send S, 0 in a group of one;
    another kind raises ValueError."""
    mod = grade("2.12").load()
    problems = []
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "send"):
        for n in (1, 2, 3, 4, 8, 64):
            for size in (1000, 4096.0, 7):
                got, expected = mod.ring_bytes(kind, n, size), _pl_ring(kind, n, size)
                if not _pl_close(got, expected):
                    problems.append(f"ring_bytes({kind!r}, {n}, {size}) = {got}, expected {expected}")
    assert_no_problems(problems)
    with pytest.raises(ValueError):
        mod.ring_bytes("broadcast", 4, 100)


def test_2_12_collective_seconds_alpha_beta(grade):
    """collective_seconds: count x (latencies x alpha + ring bytes x beta), 1.3's ring latencies."""
    mod = grade("2.12").load()
    alpha, beta = 1e-5, 1e-9
    problems = []
    for kind, latencies in (("all_reduce", lambda n: 2 * (n - 1)), ("reduce_scatter", lambda n: n - 1),
                            ("all_gather", lambda n: n - 1), ("send", lambda n: 1)):
        for n, size, count in ((1, 100, 3), (2, 1e6, 1), (8, 4e6, 5), (3, 30, 2)):
            c = mod.Collective("dp", kind, n, size, count)
            expected = 0.0 if n == 1 else count * (latencies(n) * alpha + _pl_ring(kind, n, size) * beta)
            got = mod.collective_seconds(c, alpha, beta)
            if not _pl_close(got, expected):
                problems.append(f"collective_seconds({c}, alpha={alpha}, beta={beta}) = {got}, expected {expected}")
    assert_no_problems(problems)


# ------------------------------------------------------------------ memory


def _pl_expected_activations(model, layout, batch, act_bytes: int) -> float:
    """Korthikanti et al. 2022, Table 2: with sequence parallelism sbh(34 + 5as/h)/t, checkpointing 2sbh/t; tp alone
    (sp=False) sbh(10 + 24/t + 5as/(ht)), checkpointing 2sbh (the input, whole on every tp rank)."""
    b = batch // (layout.dp * layout.microbatches)
    s, h, t = model.seq_len / layout.cp, model.hidden, layout.tp
    scores = 0.0 if (model.flash or layout.cp > 1) else 5 * model.heads * s * s * b
    if layout.sp:
        full, input_ = (34 * s * b * h + scores) / t, 2 * s * b * h / t
    else:
        full, input_ = 10 * s * b * h + (24 * s * b * h + scores) / t, 2 * s * b * h
    kept = input_ if layout.checkpointing else full
    chunks = _pl_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    total = chunks * (model.layers // (layout.pp * layout.chunks)) * kept + (full if layout.checkpointing else 0)
    return total * act_bytes / 2


@_PL_PROPERTY
@given(case=_pl_cases(), fp32=st.booleans())
def test_2_12_memory_terms_match_the_formulas(grade, case, fp32):
    """Parameters, gradients, optimizer state (Psi of the largest stage on one tp rank, ZeRO's 1/(dp*cp) where the
    stage shards it) and activations (Korthikanti et al. over the chunks in flight, with sequence parallelism and
    without), mixed precision and fp32."""
    mod = grade("2.12").load()
    model, layout, batch = _pl_build(mod, case)
    precision = mod.FP32 if fp32 else mod.MIXED
    psi = _pl_psi(model, layout.pp, layout.tp)
    n = layout.dp * layout.cp
    bp, bg, bo = (4, 4, 8) if fp32 else (2, 2, 12)
    expected = {"params": psi * bp / (n if layout.zero >= 3 else 1), "grads": psi * bg / (n if layout.zero >= 2 else 1),
                "optimizer": psi * bo / (n if layout.zero >= 1 else 1),
                "activations": _pl_expected_activations(model, layout, batch, 4 if fp32 else 2)}
    held = mod.memory(model, layout, batch, precision)
    problems = [f"memory(...).{kind} = {getattr(held, kind)}, expected {value}"
                for kind, value in expected.items() if not _pl_close(getattr(held, kind), value)]
    if not _pl_close(held.total, sum(expected.values())):
        problems.append(f"memory(...).total = {held.total}, expected {sum(expected.values())}")
    alone = mod.activation_bytes(model, layout, batch, precision)
    if not _pl_close(alone, expected["activations"]):
        problems.append(f"activation_bytes(...) = {alone}, expected {expected['activations']}")
    assert_no_problems(problems, f"{'FP32' if fp32 else 'MIXED'}, {_pl_text(model, layout, batch)}:")


@_PL_PROPERTY
@given(case=_pl_cases())
def test_2_12_memory_properties(grade, case):
    """A higher ZeRO stage never holds more; activations shrink with checkpointing; tp without sequence parallelism
    (sp=False) holds as much as with it when tp = 1 and more when tp > 1, with the same parameters."""
    mod = grade("2.12").load()
    model, layout, batch = _pl_build(mod, case)
    problems = []
    top = 3 if layout.pp == 1 else 1
    totals = [mod.memory(model, mod.Layout(**{**case[1], "zero": z}), batch).total for z in range(top + 1)]
    if any(later > earlier * (1 + 1e-12) for earlier, later in zip(totals, totals[1:])):
        problems.append(f"ZeRO stages 0..{top} hold {totals} bytes: a higher stage never holds more")
    held = mod.memory(model, layout, batch)
    if layout.checkpointing:
        without = mod.memory(model, mod.Layout(**{**case[1], "checkpointing": False}), batch)
        if held.activations > without.activations + 1e-9 and model.layers // (layout.pp * layout.chunks) > 1:
            problems.append(f"checkpointing holds {held.activations} activation bytes, more than without "
                            f"({without.activations})")
    with_sp, without_sp = (mod.memory(model, mod.Layout(**{**case[1], "sp": sp}), batch) for sp in (True, False))
    if layout.tp == 1 and not _pl_close(with_sp.activations, without_sp.activations):
        problems.append(f"tp = 1: activations {with_sp.activations} bytes with sp, {without_sp.activations} without: "
                        "sequence parallelism splits nothing in a tp group of one")
    if layout.tp > 1 and not without_sp.activations > with_sp.activations:
        problems.append(f"tp = {layout.tp}: activations {without_sp.activations} bytes without sp, not more than the "
                        f"{with_sp.activations} with it (10 sbh a layer stay whole on every tp rank without)")
    if any(getattr(with_sp, k) != getattr(without_sp, k) for k in ("params", "grads", "optimizer")):
        problems.append("sp changed the parameters, gradients or optimizer state: sequence parallelism shards "
                        "activations only")
    assert_no_problems(problems, _pl_text(model, layout, batch))


def test_2_12_memory_hand_derived(grade):
    """Worked cases: the ZeRO paper's 7.5B-parameter accounting on 64 GPUs, and a tp x pp case."""
    mod = grade("2.12").load()
    model = mod.Model("m", layers=2, hidden=64, heads=4, ffn_hidden=256, seq_len=32, vocab=128, bias=False)
    # per layer: 4*64*64 + 2*64*256 + 2*64 (norms) = 16384 + 32768 + 128 = 49280
    psi = 2 * 49280 + 128 * 64 + 64 + 128 * 64  # layers, embedding, final norm, output
    problems = []
    for zero, expected in ((0, 16 * psi), (1, 4 * psi + 12 * psi / 8), (2, 2 * psi + 14 * psi / 8), (3, 16 * psi / 8)):
        held = mod.memory(model, mod.Layout(dp=8, zero=zero), 8)
        got = held.params + held.grads + held.optimizer
        if not _pl_close(got, expected):
            problems.append(f"ZeRO {zero}, dp 8, mixed precision: model states {got} bytes, expected {expected} "
                            f"(Psi = {psi}: 2+2+12 bytes a parameter, sharded as the ZeRO paper's Figure 1)")
    odd = mod.Model("odd", layers=2, hidden=64, heads=4, ffn_hidden=256, seq_len=32, vocab=130, bias=False)
    odd_psi = 2 * 49280 + 130 * 64 + 64 + 130 * 64  # 115264: 2 Psi and 12 Psi are not multiples of 5
    for zero in (1, 2, 3):  # dp = 5: the shards are not whole bytes, and a share is Psi * P / n, not rounded
        held = mod.memory(odd, mod.Layout(dp=5, zero=zero), 5)
        expected = {"params": 2 * odd_psi / (5 if zero >= 3 else 1), "grads": 2 * odd_psi / (5 if zero >= 2 else 1),
                    "optimizer": 12 * odd_psi / 5}
        for kind, value in expected.items():
            if not _pl_close(getattr(held, kind), value):
                problems.append(f"ZeRO {zero}, dp 5, vocab 130: {kind} {getattr(held, kind)} bytes, expected {value} "
                                "(Psi * P / n bytes, not rounded)")
    stages = mod.stage_parameters(model, 2, 2)
    if list(stages) != [(16384 + 32768) // 2 + 128 + 64 * 64, (16384 + 32768) // 2 + 128 + 64 + 64 * 64]:
        problems.append(f"stage_parameters(model, pp=2, tp=2) = {stages}, expected [28800, 28864]")
    # tp 2, pp 2: the last stage is the largest: 1 layer (its matrices halved, its norms whole), the final norm,
    # half the output layer: (16384 + 32768)/2 + 128 + 64 + 64*64 (stage 0: the same less the final norm)
    held = mod.memory(model, mod.Layout(tp=2, pp=2, microbatches=2), 2)
    psi = (16384 + 32768) // 2 + 128 + 64 + 64 * 64
    if not _pl_close(held.params, 2 * psi):
        problems.append(f"tp 2, pp 2: parameters {held.params} bytes, expected {2 * psi} (Psi = {psi})")
    # activations: 1f1b p=2 m=2: 2 micro-batches of 1 layer, b=1, s=32, h=64, a=4, t=2: 32*64*(34 + 5*4*32/64)/2
    expected = 2 * 32 * 1 * 64 * (34 + 5 * 4 * 32 / 64) / 2
    if not _pl_close(held.activations, expected):
        problems.append(f"tp 2, pp 2, 1F1B m=2: activations {held.activations} bytes, expected {expected}")
    # the same without sequence parallelism (Korthikanti's "tensor parallel" row): 2 x 32*64*(10 + 24/2 + 5*4*32/(64*2))
    # = 2 x 2048 x 27 = 110592; with checkpointing 2 x 2*32*64 (the inputs, whole) + 2048 x 27 (the layer recomputed)
    nosp = mod.memory(model, mod.Layout(tp=2, pp=2, microbatches=2, sp=False), 2)
    if not _pl_close(nosp.activations, 110592):
        problems.append(f"tp 2, pp 2, 1F1B m=2, sp=False: activations {nosp.activations} bytes, expected 110592 "
                        "(10 sbh whole on each tp rank, 24 sbh and the scores split)")
    nosp = mod.memory(model, mod.Layout(tp=2, pp=2, microbatches=2, checkpointing=True, sp=False), 2)
    if not _pl_close(nosp.activations, 2 * 4096 + 55296):
        problems.append(f"tp 2, pp 2, 1F1B m=2, sp=False, checkpointing: activations {nosp.activations} bytes, "
                        f"expected {2 * 4096 + 55296} (2 kept inputs of 2sbh = 4096 bytes, whole, + one layer "
                        "recomputed)")
    assert_no_problems(problems)


# ------------------------------------------------------------------ communication


@_PL_PROPERTY
@given(case=_pl_cases(), fp32=st.booleans())
def test_2_12_bytes_per_dimension_match_the_formulas(grade, case, fp32):
    """Bytes each rank sends per step, per dimension: tp's 4 (6) all-reduces a layer and micro-batch, cp's 3cp-2
    (4cp-3) ring hops of K and V, pp's 2v-1 or 2v messages a micro-batch (h/tp wide with sp, h without), dp's
    all-reduce or ZeRO's reduce-scatter and all-gather over dp*cp; 0 where the dimension is 1."""
    mod = grade("2.12").load()
    model, layout, batch = _pl_build(mod, case)
    precision = mod.FP32 if fp32 else mod.MIXED
    act, gb, pb = (4, 4, 4) if fp32 else (2, 2, 2)
    b, m, s = batch // (layout.dp * layout.microbatches), layout.microbatches, model.seq_len // layout.cp
    layers = model.layers // layout.pp
    kv = model.hidden // model.heads * (model.kv_heads or model.heads)
    tp_calls = (6 if layout.checkpointing else 4) * layers * m
    hops = (4 * layout.cp - 3 if layout.checkpointing else 3 * layout.cp - 2) * layers * m
    per_mb = 0 if layout.pp == 1 else (2 * layout.chunks - 1 if layout.pp == 2 else 2 * layout.chunks)
    n = layout.dp * layout.cp
    psi = _pl_psi(model, layout.pp, layout.tp)
    dp = {0: _pl_ring("all_reduce", n, psi * gb),
          1: _pl_ring("reduce_scatter", n, psi * gb) + _pl_ring("all_gather", n, psi * pb),
          2: m * _pl_ring("reduce_scatter", n, psi * gb) + _pl_ring("all_gather", n, psi * pb),
          3: 2 * m * _pl_ring("all_gather", n, psi * pb) + m * _pl_ring("reduce_scatter", n, psi * gb)}[layout.zero]
    expected = {"tp": tp_calls * _pl_ring("all_reduce", layout.tp, b * s * model.hidden * act),
                "cp": hops * _pl_ring("send", layout.cp, 2 * b * s * kv // layout.tp * act),
                "pp": per_mb * m * _pl_ring("send", layout.pp,
                                            b * s * model.hidden // (layout.tp if layout.sp else 1) * act),
                "dp": dp}
    got = _pl_bytes(mod, model, layout, batch, precision)
    problems = [f"communication_bytes: {dim}: {got.get(dim)} bytes, expected {value}" for dim, value in expected.items()
                if not _pl_close(got.get(dim, -1.0), value)]
    for dim, value in expected.items():
        fn = getattr(mod, f"{dim}_collectives")
        listed = fn(model, layout, batch, precision)
        direct = sum(c.count * _pl_ring(c.kind, c.n, c.nbytes) for c in listed)
        if not _pl_close(direct, value):
            problems.append(f"{fn.__name__}: its collectives {listed} send {direct} bytes (ring algorithms), "
                            f"expected {value}")
    assert_no_problems(problems, f"communication_bytes, {'FP32' if fp32 else 'MIXED'}, "
                                 f"{_pl_text(model, layout, batch)}:")


def test_2_12_each_dimension_lists_its_own_collectives(grade):
    """tp_collectives, cp_collectives, pp_collectives, dp_collectives return [] when their dimension is 1 and tag
    what they return with their dimension and group size."""
    mod = grade("2.12").load()
    model = mod.Model("m", layers=4, hidden=64, heads=4, ffn_hidden=256, seq_len=32, vocab=128)
    problems = []
    fns = {"tp": mod.tp_collectives, "cp": mod.cp_collectives, "pp": mod.pp_collectives, "dp": mod.dp_collectives}
    alone = mod.Layout()
    for dim, fn in fns.items():
        if fn(model, alone, 4):
            problems.append(f"{fn.__name__} with every dimension 1 returned {fn(model, alone, 4)}, expected []")
    busy = mod.Layout(dp=2, tp=2, cp=2, pp=2, microbatches=2, zero=1)
    for dim, fn in fns.items():
        got = fn(model, busy, 8)
        size = 4 if dim == "dp" else 2
        if not got or any(c.dim != dim or c.n != size for c in got):
            problems.append(f"{fn.__name__}({busy}) returned {got}: expected collectives of dim {dim!r} on groups of "
                            f"{size} ranks")
    m = 3  # the docstring's table: which collectives each ZeRO stage makes, and how often (not only their bytes)
    table = {0: [("all_reduce", 1)], 1: [("all_gather", 1), ("reduce_scatter", 1)],
             2: [("all_gather", 1), ("reduce_scatter", m)], 3: [("all_gather", 2 * m), ("reduce_scatter", m)]}
    for zero, expected in table.items():
        layout = mod.Layout(dp=2, cp=2, zero=zero, microbatches=m)
        got = sorted((c.kind, c.count) for c in mod.dp_collectives(model, layout, 2 * m))
        if got != expected:
            problems.append(f"dp_collectives with ZeRO stage {zero}, m = {m}: (kind, calls) {got}, expected {expected}")
    assert_no_problems(problems)


# ------------------------------------------------------------------ placement and time


def _pl_cluster(mod, gpus_per_node: int = 8, nodes: int = 4):
    return mod.Cluster("c", nodes, gpus_per_node, 80e9, alpha_intra=1e-6, beta_intra=1e-11, alpha_inter=2e-5,
                       beta_inter=1e-10, peak_flops=1e15, efficiency=0.5)


def test_2_12_link_follows_the_placement(grade):
    """tp innermost, then cp, dp, pp: a group inside a node iff its span divides the GPUs per node."""
    mod = grade("2.12").load()
    cluster = _pl_cluster(mod)
    intra, inter = (1e-6, 1e-11), (2e-5, 1e-10)
    cases = [(dict(tp=8, dp=4), {"tp": intra, "dp": inter}), (dict(tp=16, dp=2), {"tp": inter, "dp": inter}),
             (dict(tp=2, cp=4, dp=4), {"tp": intra, "cp": intra, "dp": inter}),
             (dict(tp=2, cp=2, dp=2, pp=4, microbatches=4), {"tp": intra, "cp": intra, "dp": intra, "pp": inter}),
             (dict(tp=4, cp=4, dp=2), {"tp": intra, "cp": inter, "dp": inter}),
             (dict(tp=1, dp=32), {"tp": intra, "dp": inter}), (dict(tp=32), {"tp": inter})]
    problems = []
    for layout, links in cases:
        for dim, expected in links.items():
            got = tuple(mod.link(cluster, mod.Layout(**layout), dim))
            if got != expected:
                problems.append(f"link(8 GPUs a node, {layout}, {dim!r}) = {got}, expected "
                                f"{'intra' if expected == intra else 'inter'}-node {expected}")
    small = _pl_cluster(mod, gpus_per_node=6, nodes=2)
    got = tuple(mod.link(small, mod.Layout(tp=4, dp=3), "tp"))
    if got != inter:
        problems.append(f"link(6 GPUs a node, tp=4, 'tp') = {got}: a tp group of 4 straddles a node of 6 (ranks 4-7), "
                        f"expected the inter-node {inter}")
    assert_no_problems(problems)


@_PL_PROPERTY
@given(case=_pl_cases())
def test_2_12_step_time_terms(grade, case):
    """compute from Kaplan's FLOPs per token, each dimension's collectives on its link, the bubble around compute +
    tp + cp, the total their sum."""
    mod = grade("2.12").load()
    model, layout, batch = _pl_build(mod, case)
    cluster = _pl_cluster(mod, nodes=1, gpus_per_node=layout.world)
    cluster_many = _pl_cluster(mod, nodes=layout.world, gpus_per_node=1)
    for c in (cluster, cluster_many):
        got = mod.step_time(model, c, layout, batch)
        n_nonembed = model.parameters() - model.vocab * model.hidden
        flops = (4 if layout.checkpointing else 3) * (2 * n_nonembed + 2 * model.layers * model.seq_len * model.hidden)
        expected = {"compute": flops * batch * model.seq_len / (c.world * c.peak_flops * c.efficiency)}
        for dim in ("tp", "cp", "pp", "dp"):
            alpha, beta = (c.alpha_intra, c.beta_intra) if c.gpus_per_node == layout.world else (
                (c.alpha_intra, c.beta_intra) if {"tp": layout.tp, "cp": layout.tp * layout.cp,
                                                   "dp": layout.tp * layout.cp * layout.dp,
                                                   "pp": layout.world}[dim] == 1 else (c.alpha_inter, c.beta_inter))
            seconds = 0.0
            for coll in mod.collectives(model, layout, batch):
                if coll.dim == dim and coll.n > 1:
                    lat = {"all_reduce": 2 * (coll.n - 1), "send": 1}.get(coll.kind, coll.n - 1)
                    seconds += coll.count * (lat * alpha + _pl_ring(coll.kind, coll.n, coll.nbytes) * beta)
            expected[dim] = seconds
        f = _pl_bubble(layout.schedule, layout.pp, layout.microbatches, layout.chunks) if layout.pp > 1 else 0.0
        expected["bubble"] = (expected["compute"] + expected["tp"] + expected["cp"]) * f / (1 - f)
        expected["total"] = sum(expected.values())
        problems = [f"{k}: {got.get(k)} s, expected {v}" for k, v in expected.items()
                    if not _pl_close(got.get(k, -1.0), v, 1e-7)]
        assert_no_problems(problems, f"step_time, {c.gpus_per_node} GPUs a node, {_pl_text(model, layout, batch)}:")
    with pytest.raises(ValueError):
        mod.step_time(model, _pl_cluster(mod, nodes=1, gpus_per_node=layout.world + 1), layout, batch)


# ------------------------------------------------------------------ ranking


def test_2_12_rank_layouts_sorted_and_only_what_fits(grade):
    """Every candidate whose memory fits and no other, fastest first (ties: less memory, then candidate order),
    each with its memory and step time."""
    mod = grade("2.12").load()
    reference = grading.reference("2.12")
    model = mod.Model("m", layers=4, hidden=64, heads=4, ffn_hidden=256, seq_len=64, vocab=128)
    problems = []
    ref_model = reference.Model(**vars(model))
    probe = reference.Cluster("c", 2, 4, 1e9, 1e-5, 1e-9, 5e-5, 1e-8, 1e12, 0.5)
    middle = reference.candidate_layouts(ref_model, probe, 16)[len(reference.candidate_layouts(ref_model, probe, 16)) // 2]
    exact = reference.memory(ref_model, middle, 16, reference.FP32).total  # a budget a plan fills to the byte
    for budget, precision in ((1.0, None), (3e6, None), (6e6, None), (1e9, None), (exact, "FP32"), (6e6, "FP32")):
        cluster = mod.Cluster("c", 2, 4, budget, 1e-5, 1e-9, 5e-5, 1e-8, 1e12, 0.5)  # 1 byte: nothing fits
        extra_args = () if precision is None else (getattr(mod, precision),)
        candidates = reference.candidate_layouts(ref_model, reference.Cluster(**vars(cluster)), 16)
        fits = []
        for i, c in enumerate(candidates):
            layout = mod.Layout(**vars(c))
            total = mod.memory(model, layout, 16, *extra_args).total
            if total <= budget:
                fits.append((mod.step_time(model, cluster, layout, 16, *extra_args)["total"], total, i, layout))
        expected = [layout for *_, layout in sorted(fits, key=lambda x: x[:3])]
        plans = mod.rank_layouts(model, cluster, 16, *extra_args)
        got = [p.layout for p in plans]
        where = f"memory budget {budget:g}" + (f", precision {precision}" if precision else "")
        if got != expected:
            extra = [lay for lay in got if lay not in expected][:3]
            missing = [lay for lay in expected if lay not in got][:3]
            order = "" if extra or missing else " (the same layouts, in another order)"
            problems.append(f"{where}: rank_layouts gave {len(got)} layouts, expected {len(expected)}"
                            f"{order}; not expected: {extra}; missing: {missing} (a plan fits when its total is "
                            "at most the GPU's memory)")
            continue
        for plan in plans[:20]:
            if plan.memory != mod.memory(model, plan.layout, 16, *extra_args) or \
                    plan.time != mod.step_time(model, cluster, plan.layout, 16, *extra_args):
                problems.append(f"{where}: the plan of {plan.layout} does not carry memory() and step_time() of its "
                                "layout (with the precision given)")
                break
    assert_no_problems(problems)


def test_2_12_command_line(grade, capsys):
    """The CLI prints a ranked table for named presets; bad input is one line and exit code 2."""
    mod = grade("2.12").load()
    assert mod.main(["--model", "course-toy", "--cluster", "laptop-cpu", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fastest first" in out and len(out.strip().splitlines()) == 6, out  # title, header, rule, 3 rows
    for argv in (["--model", "nope", "--cluster", "laptop-cpu"], ["--model", "course-toy"],
                 ["--model", "course-toy", "--cluster", "laptop-cpu", "--batch", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            mod.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, (argv, exit_info.value.code, err)


# ------------------------------------------------------------------ held against the course's own worlds

_MEASURE_WORLD = 4
_H, _HEADS, _FFN, _S, _V, _B = 32, 4, 128, 8, 64, 2  # b = 2 sequences a micro-batch on each replica
_measured: dict = {}


def _pl_toy(layers: int) -> nn.Sequential:
    """The planner's Model(layers, 32, 4, 128, 8, 64) built of 2.9's Blocks: embedding, blocks, norm, output."""
    from solutions.phase2_advanced.context_parallel import Block
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(_V, _H), *[Block(_H, _HEADS, _FFN) for _ in range(layers)], nn.LayerNorm(_H),
                         nn.Linear(_H, _V, bias=False))


def _pl_sent(calls) -> float:
    """Bytes this rank sends for the recorded calls under the ring algorithms (common.measure.ring_elements_sent)."""
    total = 0.0
    for c in calls:
        if c.numel:
            size = dist.get_world_size(c.group) if c.group is not None else dist.get_world_size()
            total += ring_elements_sent(c, size) * c.nbytes / c.numel
    return total


def _pl_zero_rows(out: dict) -> None:
    from solutions.phase2_advanced import zero
    rank = dist.get_rank()
    for stage in range(4):
        model = _pl_toy(2)
        if stage == 3:
            net = zero.ZeroStage3(model)
            optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
        else:
            net = model
            cls = (zero.DataParallelOptimizer, zero.ZeroStage1, zero.ZeroStage2)[stage]
            optimizer = cls(model.parameters(), torch.optim.Adam, lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        ids, targets = torch.randint(_V, (_B, _S), generator=g), torch.randint(_V, (_B, _S), generator=g)
        with CollectiveLog() as log:
            optimizer.zero_grad()
            F.cross_entropy(net(ids).reshape(-1, _V), targets.reshape(-1)).backward()
            optimizer.step()
        by_name: dict = {}
        for c in log.calls:
            by_name[c.name] = by_name.get(c.name, 0.0) + _pl_sent([c])
        held = training_memory(net, optimizer)
        out[f"zero{stage}"] = {"sent": by_name, "held": held["params"] + held["grads"] + held["optimizer"]}


def _pl_tp_layer(ln1, attn, ln2, mlp, x):
    x = x + attn(ln1(x))
    return x + mlp(ln2(x))


def _pl_mesh_rows(out: dict) -> None:
    """(dp, tp) = (2, 2) on 2.8's groups: 2 layers of 2.7's ParallelSelfAttention and ParallelMLP (LayerNorms whole),
    a vocab-parallel embedding and output (V/tp rows), 2 micro-batches, then 2.8's dp all-reduce of every gradient."""
    from solutions.phase2_advanced.context_parallel import SequenceParallelBlock
    from solutions.phase2_advanced.mesh import build_groups
    from solutions.phase2_advanced.tensor_parallel import ParallelMLP, ParallelSelfAttention
    groups = build_groups(2, 2)
    torch.manual_seed(0)
    layers = [(nn.LayerNorm(_H), ParallelSelfAttention(_H, _HEADS, group=groups.tp), nn.LayerNorm(_H),
               ParallelMLP(_H, _FFN, group=groups.tp)) for _ in range(2)]
    emb, norm, head = nn.Embedding(_V // 2, _H), nn.LayerNorm(_H), nn.Linear(_H, _V // 2, bias=False)
    params = [p for part in [*[m for layer in layers for m in layer], emb, norm, head] for p in part.parameters()]
    g = torch.Generator().manual_seed(dist.get_rank(groups.dp))
    with CollectiveLog() as log:
        for _ in range(2):  # micro-batches
            x = emb(torch.randint(_V // 2, (_B, _S), generator=g))
            for layer in layers:
                x = _pl_tp_layer(*layer, x)
            head(norm(x)).pow(2).mean().backward()
    tp_sent = _pl_sent([c for c in log.calls if c.group is groups.tp])
    with CollectiveLog() as log:
        for p in params:
            dist.all_reduce(p.grad, group=groups.dp)
            p.grad /= 2
    out["mesh"] = {"tp": tp_sent, "dp": _pl_sent([c for c in log.calls if c.group is groups.dp]),
                   "held": sum(p.numel() * p.element_size() for p in params)}
    block = SequenceParallelBlock(_H, _HEADS, _FFN, group=groups.tp)
    x = torch.randn(_B, _S // 2, _H, requires_grad=True)
    with CollectiveLog() as log:
        block(x).pow(2).mean().backward()
    out["sp"] = _pl_sent([c for c in log.calls if c.group is groups.tp])
    for cp, group in ((4, None), (2, groups.tp)):
        from solutions.phase2_advanced.context_parallel import ring_attention
        q, k, v = (torch.randn(_B, _HEADS, _S // cp, _H // _HEADS, requires_grad=True) for _ in range(3))
        with PointToPointLog() as log:
            ring_attention(q, k, v, causal=True, group=group).pow(2).sum().backward()
        out[f"cp{cp}"] = sum(op.nbytes for op in log.ops if op.kind == "send")


def _pl_pipeline_rows(out: dict) -> None:
    """1F1B on 4 stages (4 micro-batches), and interleaved 1F1B with v = 2 on ranks {0, 1} and {2, 3} (2 micro-batches),
    of 4 of 2.9's Blocks on (b, s, h) activations; the payload of every send (2.5's int64 headers left out)."""
    from solutions.phase2_advanced import pipeline
    from solutions.phase2_advanced.context_parallel import Block
    from solutions.phase2_advanced.model_split import PipelineStage
    rank = dist.get_rank()
    torch.manual_seed(0)
    blocks = [Block(_H, _HEADS, _FFN) for _ in range(4)]
    data = [torch.randn(_B, _S, _H) for _ in range(4)]

    def payload(log) -> int:
        return sum(op.nbytes for op in log.ops if op.kind == "send" and op.tensor.is_floating_point())

    stage = PipelineStage(blocks, rank, 4)
    with PointToPointLog() as log:
        pipeline.run_pipeline(pipeline.one_f_one_b_schedule(4, 4)[rank], stage, data if rank == 0 else None,
                              data if rank == 3 else None, F.mse_loss)
    out["1f1b"] = payload(log)
    ranks = [0, 1, 0, 1] if rank < 2 else [2, 3, 2, 3]
    r = rank % 2
    stages = [pipeline.VirtualStage(blocks, k, 4, ranks) for k in (r, r + 2)]
    with PointToPointLog() as log:
        pipeline.run_pipeline(pipeline.interleaved_schedule(2, 2, 2)[r], stages, data[:2] if r == 0 else None,
                              data[:2] if r == 1 else None, F.mse_loss)
    out["interleaved"] = payload(log)


_PL_3D_SHAPES = ((2, 1, 2), (1, 2, 2), (2, 2, 1))  # (pp, dp, tp), the order of init_device_mesh's dimensions
_PL_3D_LAYERS, _PL_3D_MICRO = 2, 2


def _pl_3d_rows(out: dict) -> None:
    """2.11's reference train_step (1F1B, m = 2, max_norm set) of a 2-block Transformer on 4-rank meshes built with
    torch's init_device_mesh: the bytes each rank sends in its tp group and dp group (collectives, ring counts), and in
    its pp group (the payload of every send, 2.5's int64 headers left out). Left out: the 1-element all-reduces (the
    loss over pp and dp, the norm's sums over tp and pp: 4 calls a step of one float each), which the planner does not
    model."""
    from torch.distributed.device_mesh import init_device_mesh

    from solutions.phase2_advanced import parallel_3d
    torch.manual_seed(0)
    model = parallel_3d.Transformer(_PL_3D_LAYERS, _H, _HEADS, _FFN)
    batch = 2 * _PL_3D_MICRO * _B  # dp <= 2: _B sequences a micro-batch on each replica
    x, y = torch.randn(batch, _S, _H), torch.randn(batch, _S, _H)
    for pp, dp, tp in _PL_3D_SHAPES:
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        groups = {dim: mesh[dim].get_group() for dim in ("tp", "dp", "pp")}
        stages = parallel_3d.build_stages(model, mesh)
        with PointToPointLog() as log:
            parallel_3d.train_step(stages, mesh, x[:dp * _PL_3D_MICRO * _B], y[:dp * _PL_3D_MICRO * _B],
                                   num_microbatches=_PL_3D_MICRO, lr=0.1, max_norm=1.0)
        row = {dim: _pl_sent([c for c in log.calls if c.group is group and c.numel > 1])
               for dim, group in groups.items() if dim != "pp"}
        row["pp"] = sum(op.nbytes for op in log.ops if op.kind == "send" and op.tensor.is_floating_point())
        out[f"3d{pp}{dp}{tp}"] = row


def _pl_measure_rank() -> dict:
    out: dict = {}
    _pl_zero_rows(out)
    _pl_mesh_rows(out)
    _pl_pipeline_rows(out)
    _pl_3d_rows(out)
    return out


def _measured_world() -> list[dict]:
    if "results" not in _measured:
        try:
            _measured["results"] = run_world(_pl_measure_rank, _MEASURE_WORLD)
        except Exception as exc:  # noqa: BLE001 - re-raised by every test that shares the world
            _measured["results"] = exc
    if isinstance(_measured["results"], Exception):
        raise _measured["results"]
    return _measured["results"]


def _measurement_rows(mod, results: list[dict]) -> list[dict]:
    """Each row: what the planner predicts, what every rank measured, exact or within a tolerance."""
    fp32 = mod.FP32

    def model(layers: int):
        return mod.Model("course-measured", layers=layers, hidden=_H, heads=_HEADS, ffn_hidden=_FFN, seq_len=_S,
                         vocab=_V)

    rows = []

    def row(name, measured, predicted, exact=True, tolerance=0.0):
        rows.append({"name": name, "measured": measured, "predicted": float(predicted), "exact": exact,
                     "tolerance": tolerance})

    toy = model(2)
    for stage in range(4):
        layout = mod.Layout(dp=4, zero=stage)
        sent = [r[f"zero{stage}"]["sent"] for r in results]
        predicted = mod.communication_bytes(toy, layout, 4 * _B, fp32)["dp"]
        if stage == 1:  # the course's ZeroStage1 all-reduces, then broadcasts (torch's ZeroRedundancyOptimizer)
            row("2.4 ZeroStage1 gradient all-reduce (dp 4) vs DP's", [s.get("all_reduce", 0) for s in sent],
                mod.communication_bytes(toy, mod.Layout(dp=4), 4 * _B, fp32)["dp"])
        else:
            row(f"2.4 ZeRO stage {stage} bytes sent a step (dp 4, fp32)", [sum(s.values()) for s in sent], predicted)
        held = mod.memory(toy, layout, 4 * _B, fp32)
        row(f"2.4 ZeRO stage {stage} params+grads+optimizer bytes (dp 4)", [r[f"zero{stage}"]["held"] for r in results],
            held.params + held.grads + held.optimizer, exact=False, tolerance=0.10)
    mesh = mod.Layout(dp=2, tp=2, microbatches=2, sp=False)  # 2.7's layers: no sequence parallelism
    predicted = mod.communication_bytes(toy, mesh, 2 * 2 * _B, fp32)
    row("2.7 layers on 2.8's (dp 2, tp 2) mesh: tp bytes, 2 layers x m=2", [r["mesh"]["tp"] for r in results],
        predicted["tp"])
    row("2.8 dp gradient all-reduce on the (2, 2) mesh", [r["mesh"]["dp"] for r in results], predicted["dp"])
    row("2.7 tp-sharded model: parameter bytes a rank (tp 2)", [r["mesh"]["held"] for r in results],
        mod.memory(toy, mesh, 8, fp32).params, exact=False, tolerance=0.10)
    row("2.9 SequenceParallelBlock (tp 2), one layer", [r["sp"] for r in results],
        mod.communication_bytes(model(1), mod.Layout(tp=2), _B, fp32)["tp"])
    for cp in (4, 2):
        row(f"2.9 ring attention (cp {cp}), one layer", [r[f"cp{cp}"] for r in results],
            mod.communication_bytes(model(1), mod.Layout(cp=cp), _B, fp32)["cp"])
    row("2.6 1F1B, pp 4, m 4: the busiest rank's sends", [max(r["1f1b"] for r in results)],
        mod.communication_bytes(model(4), mod.Layout(pp=4, microbatches=4), 4 * _B, fp32)["pp"])
    row("2.6 interleaved, pp 2, v 2, m 2: the busiest rank's sends", [max(r["interleaved"] for r in results)],
        mod.communication_bytes(model(4), mod.Layout(pp=2, schedule="interleaved", chunks=2, microbatches=2),
                                2 * _B, fp32)["pp"])
    _pl_3d_measurement_rows(mod, results, model(_PL_3D_LAYERS), row)
    return rows


def _pl_3d_measurement_rows(mod, results: list[dict], toy, row) -> None:
    """2.11's worlds against tp_collectives, pp_collectives and dp_collectives of the same Layout (FP32).

    2.11's Transformer has blocks only (no embedding, final norm or output layer), which the planner's Model cannot
    say (vocab >= 1, the embedding always counted): tp and pp bytes do not depend on vocab, so their functions are
    used as they are; dp's all-reduce is the planner's Collective (kind, n, count) on a gradient of this stage's
    Psi = layers / pp * Model.layer_parameters(tp) parameters, the blocks alone, instead of max(stage_parameters).
    The 1-element all-reduces 2.11 adds (the loss over pp and dp, the norm's sums over tp and pp) are not
    compared: _pl_3d_rows leaves them out, the planner counts none of them.
    2.11 has no sequence parallelism: the Layout says sp=False, and every tp rank sends the whole (b, s, h)
    activation to its pipeline peer, as pp_collectives counts it then."""
    fp32 = mod.FP32

    def sent(collectives, nbytes=None) -> float:
        return sum(c.count * mod.ring_bytes(c.kind, c.n, c.nbytes if nbytes is None else nbytes) for c in collectives)

    for pp, dp, tp in _PL_3D_SHAPES:
        layout = mod.Layout(dp=dp, tp=tp, pp=pp, microbatches=_PL_3D_MICRO, sp=False)
        batch, key = dp * _PL_3D_MICRO * _B, f"3d{pp}{dp}{tp}"
        name = f"2.11 (pp {pp}, dp {dp}, tp {tp}), m {_PL_3D_MICRO}:"
        if tp > 1:
            row(f"{name} tp bytes", [r[key]["tp"] for r in results],
                sent(mod.tp_collectives(toy, layout, batch, fp32)))
        if pp > 1:
            row(f"{name} pp sends, busiest rank (sp=False)", [max(r[key]["pp"] for r in results)],
                sent(mod.pp_collectives(toy, layout, batch, fp32)))
        if dp > 1:
            psi = _PL_3D_LAYERS // pp * toy.layer_parameters(tp)
            row(f"{name} dp bytes", [r[key]["dp"] for r in results],
                sent(mod.dp_collectives(toy, layout, batch, fp32), psi * fp32.grads))


def test_2_12_predictions_match_the_course_worlds(grade):
    """Bytes measured in the course's own worlds (4 ranks: 2.4's ZeRO stages, 2.7's layers on 2.8's mesh, 2.9's SP
    block and ring attention, 2.6's 1F1B and interleaved pipelines, 2.11's train_step on (pp, dp, tp) meshes) equal
    the planner's predictions; memory held within 10%."""
    mod = grade("2.12").load()
    toy = mod.Model("course-measured", layers=2, hidden=_H, heads=_HEADS, ffn_hidden=_FFN, seq_len=_S, vocab=_V)
    mod.communication_bytes(toy, mod.Layout(dp=2, tp=2, cp=2, pp=2, microbatches=2), 8)  # unfinished: TODO before
    mod.memory(toy, mod.Layout(dp=2), 2)  # the world starts
    rows = _measurement_rows(mod, _measured_world())
    problems = []
    for row in rows:
        for rank, value in enumerate(row["measured"]):
            bad = (not _pl_close(value, row["predicted"], 1e-9) if row["exact"]
                   else abs(value - row["predicted"]) > row["tolerance"] * value)
            if bad:
                problems.append(f"{row['name']}: measured {value:g} bytes (rank {rank}), the planner predicts "
                                f"{row['predicted']:g}" + ("" if row["exact"] else f" (more than "
                                                             f"{100 * row['tolerance']:.0f}% off)"))
    assert_no_problems(problems, "predictions against the course's worlds (fp32, common.measure's ring counts):")
