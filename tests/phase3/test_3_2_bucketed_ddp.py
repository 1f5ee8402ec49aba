"""Graded tests of exercise 3.2, a bucketed DDP with overlap (phase3_multi_node/guidelines.md, section 3.2).

Run them with `python tests/test_phase3.py -k 3_2` (your code) or
`pytest tests/test_phase3.py -k 3_2` (the reference); tests/test_phase3.py collects them.

One world of 3 ranks runs every scenario next to torch's own DistributedDataParallel
(same models, same data), and each test reads the scenarios it grades. What is graded
is behaviour: the gradients torch DDP produces, the all_reduce calls a step makes (how
many, asynchronous or not) and when they are launched relative to the gradient hooks of
the first layer (an order of events, no clock). In one scenario an async all-reduce
delivers its result only when its own Work is waited for (tests/phase3/delayed_all_reduce.py),
so gradients read before every Work was waited are caught deterministically. Bucket
assignment is graded against the rule its docstring states.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import grading
from common.measure import CollectiveLog
from compare import assert_no_problems, diff_report
from phase3.delayed_all_reduce import DelayedAllReduce
from scenarios import SharedWorld, run_scenarios

_WORLD = 3
_AGREE_S = 20  # how long ranks wait for each other between scenarios
_CAP_BYTES = 1100  # Net's 10 parameters (3136 bytes) -> 3 buckets, see _EXPECTED_BUCKETS
_TOL = dict(rtol=1e-4, atol=1e-6)


class Net(nn.Module):
    """first -> BatchNorm -> mid -> (+ branch, while use_branch) -> last.

    Parameter bytes in registration order: first 384+64, bn 64+64, mid 1024+64,
    branch 1024+64, last 320+20.
    """

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 16)
        self.last = nn.Linear(16, 5)
        self.use_branch = True

    def forward(self, x):
        h = F.relu(self.bn(self.first(x)))
        h = F.relu(self.mid(h))
        if self.use_branch:
            h = h + self.branch(h)
        return self.last(h)


# The rule of assign_buckets at _CAP_BYTES, walked by hand from the last parameter:
# last.b 20 + last.w 320 + branch.b 64 + branch.w 1024 = 1428 >= 1100: closes;
# mid.b 64 + mid.w 1024 + bn.b 64 = 1152: closes; bn.w, first.b, first.w stay open.
_EXPECTED_BUCKETS = [[9, 8, 7, 6], [5, 4, 3], [2, 1, 0]]


def _net(seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = Net()
    with torch.no_grad():  # buffers that differ per seed too (BatchNorm's running statistics)
        net.bn.running_mean.fill_(float(seed))
        net.bn.running_var.fill_(1.0 + seed)
        net.bn.num_batches_tracked.fill_(seed)
    return net


class TiedFrozenNet(nn.Module):
    """first -> mid -> frozen (requires_grad=False) -> mid2, whose weight IS mid's -> last, whose bias is frozen.

    Trainable, each counted once: first 96+16, mid 256+16, mid2.bias 16, last.weight 80 = 480 elements.
    """

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.mid = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.mid2 = nn.Linear(16, 16)
        self.mid2.weight = self.mid.weight  # tied: one Parameter used by two layers
        self.last = nn.Linear(16, 5)
        self.last.bias.requires_grad_(False)

    def forward(self, x):
        h = F.relu(self.mid(F.relu(self.first(x))))
        return self.last(F.relu(self.mid2(F.relu(self.frozen(h)))))


_TIED_FROZEN_ELEMENTS = 480


def _tied_frozen_net(seed: int) -> TiedFrozenNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TiedFrozenNet()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven local batches: rank r has 3 + 2r samples."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    n = 3 + 2 * rank
    return torch.randn(n, 6, generator=gen), torch.randint(0, 5, (n,), generator=gen)


def _grads(net: nn.Module) -> dict:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in net.named_parameters()}


def _loss(model, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return F.cross_entropy(model(x), y)


def _log(mod, events=None) -> CollectiveLog:
    on_call = None if events is None else (lambda call: events.append(("collective", call.name)))
    return CollectiveLog(on_call=on_call, also_in=(mod,))


def _calls(log: CollectiveLog) -> list[tuple[str, bool]]:
    return [(call.name, call.async_op) for call in log.calls]


# ---------------------------------------------------------------- inside a rank


def _bucket_storages(model, net: nn.Module) -> list:
    """Per bucket of model.buckets (indices into list(net.parameters())): the storage address of each .grad
    in it (None where .grad is None), as backward left them."""
    params = list(net.parameters())
    return [[None if params[i].grad is None else params[i].grad.untyped_storage().data_ptr() for i in bucket]
            for bucket in model.buckets]


def _scenario_train(mod, rank: int) -> dict:
    """3 SGD steps (momentum) of BucketedDDP and torch DDP on uneven batches; events of step 1."""
    ours_net, torch_net = _net(seed=rank), _net(seed=rank)  # different on every rank: broadcast decides
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    after_init = {k: v.clone() for k, v in ours_net.state_dict().items()}
    ref = DDP(torch_net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours_net, torch_net)]
    events: list = []
    recording = [True]  # step 1 only
    # Backward reaches the first layer when the gradient of its output is ready (this tensor
    # hook), before it computes first.weight's and first.bias's gradients.
    def watch_first_output(module, args, out):
        out.register_hook(lambda grad: events.append(("backward reaches", "first")) if recording[0] else None)

    ours_net.first.register_forward_hook(watch_first_output)
    steps = []
    for step in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with _log(mod, events if step == 0 else None) as log:
            _loss(ours, step, rank).backward()
            if recording[0]:
                events.append(("backward returned",))
        recording[0] = False
        _loss(ref, step, rank).backward()
        steps.append({"ours": _grads(ours_net), "torch": _grads(torch_net), "calls": _calls(log),
                      "storages": _bucket_storages(ours, ours_net)})
        for opt in opts:
            opt.step()
    return {"after_init": after_init, "steps": steps, "events": events,
            "final": {"ours": dict(ours_net.named_parameters()), "torch": dict(torch_net.named_parameters())}}


def _scenario_no_sync(mod, rank: int) -> dict:
    """DDP's mixed cases: forward and backward on either side of no_sync()."""
    ours_net, torch_net = _net(seed=7), _net(seed=7)
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    ref = DDP(torch_net)
    out = {}

    def case(name, run):
        ours_net.zero_grad(set_to_none=True)
        torch_net.zero_grad(set_to_none=True)
        with _log(mod) as log:
            run(ours)
        run(ref)
        out[name] = {"ours": _grads(ours_net), "torch": _grads(torch_net), "calls": _calls(log)}

    def forward_inside(model):
        with model.no_sync():
            loss = _loss(model, 0, rank)
        loss.backward()

    def backward_inside(model):
        loss = _loss(model, 1, rank)
        with model.no_sync():
            loss.backward()

    def accumulate(model):
        with model.no_sync():
            _loss(model, 2, rank).backward()
        _loss(model, 3, rank).backward()

    def nested(model):
        with model.no_sync():
            with model.no_sync():
                pass
            loss = _loss(model, 4, rank)  # still inside the outer block: no sync
        loss.backward()

    def evaluation_between(model):
        loss = _loss(model, 5, rank)  # decided: sync
        with torch.no_grad(), model.no_sync():
            _loss(model, 6, rank)  # an evaluation: builds no graph, decides nothing (torch DDP ignores it)
        loss.backward()

    def keywords(model):
        _loss_with_keywords(model, 7, rank).backward()

    case("forward inside no_sync(), backward outside", forward_inside)
    case(_EVALUATION, evaluation_between)
    case(_KEYWORDS, keywords)
    case("forward outside no_sync(), backward inside", backward_inside)
    case("2 micro-batches, the first inside no_sync()", accumulate)
    case(_NESTED, nested)
    return out


_NESTED = "forward in an outer no_sync() after an inner no_sync() ended"
_EVALUATION = "forward, then a forward under torch.no_grad() inside no_sync() (an evaluation), then the first backward"
_KEYWORDS = "a forward whose input is passed by keyword"


def _loss_with_keywords(model, step: int, rank: int) -> torch.Tensor:
    """_loss with the input passed as a keyword argument: the wrapper must hand keywords to the module."""
    x, y = _batch(step, rank)
    return F.cross_entropy(model(x=x), y)


def _scenario_unused(mod, rank: int) -> dict:
    """Step 1: `branch` unused on rank 0 only; step 2: unused on every rank."""
    ours_net, torch_net = _net(seed=3), _net(seed=3)
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    ref = DDP(torch_net, find_unused_parameters=True)
    out = []
    for step, use_branch in enumerate([rank != 0, False]):
        ours_net.use_branch = torch_net.use_branch = use_branch
        ours_net.zero_grad(set_to_none=True)
        torch_net.zero_grad(set_to_none=True)
        with _log(mod) as log:
            _loss(ours, step, rank).backward()
        _loss(ref, step, rank).backward()
        out.append({"ours": _grads(ours_net), "torch": _grads(torch_net), "calls": _calls(log)})
    return out


def _scenario_unused_accumulated(mod, rank: int) -> list:
    """`branch` has a .grad from earlier backwards when rank 0 leaves it out: a micro-batch inside no_sync() that
    uses it everywhere, then 2 synced backwards (no zero_grad between them) where rank 0 skips it."""
    ours_net, torch_net = _net(seed=5), _net(seed=5)
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    ref = DDP(torch_net, find_unused_parameters=True)
    for model in (ours, ref):
        model.module.use_branch = True
        with model.no_sync():
            _loss(model, 0, rank).backward()
        model.module.use_branch = rank != 0
    out = []
    for step in (1, 2):
        with _log(mod) as log:
            _loss(ours, step, rank).backward()
        _loss(ref, step, rank).backward()
        out.append({"ours": _grads(ours_net), "torch": _grads(torch_net), "calls": _calls(log)})
    return out


def _scenario_late_delivery(mod, rank: int) -> list:
    """2 SGD steps like "train", but each async all-reduce delivers its result only when its Work is waited for
    (tests/phase3/delayed_all_reduce.py): a bucket whose Work is never waited keeps its unreduced values."""
    ours_net, torch_net = _net(seed=rank), _net(seed=rank)
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    ref = DDP(torch_net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours_net, torch_net)]
    steps = []
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with DelayedAllReduce(also_in=(mod,)):
            _loss(ours, step, rank).backward()
            returned = _grads(ours_net)  # what the optimizer would read once backward has returned
        _loss(ref, step, rank).backward()
        steps.append({"ours": returned, "torch": _grads(torch_net)})
        for opt in opts:
            opt.step()
    return steps


def _scenario_tied_frozen(mod, rank: int) -> dict:
    """2 SGD steps (momentum, weight decay) of BucketedDDP and torch DDP on TiedFrozenNet, from a different model
    on every rank (frozen parameters included: construction decides)."""
    ours_net, torch_net = _tied_frozen_net(seed=rank), _tied_frozen_net(seed=rank)
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20)
    after_init = {k: v.clone() for k, v in ours_net.state_dict().items()}
    ref = DDP(torch_net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01) for m in (ours_net, torch_net)]
    steps = []
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with _log(mod) as log:
            _loss(ours, step, rank).backward()
        _loss(ref, step, rank).backward()
        steps.append({"ours": _grads(ours_net), "torch": _grads(torch_net), "calls": _calls(log),
                      "elements": sum(call.numel for call in log.calls if call.name == "all_reduce")})
        for opt in opts:
            opt.step()
    return {"after_init": after_init, "steps": steps,
            "final": {"ours": _state(ours_net), "torch": _state(torch_net)}}


def _state(net: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


_SUBGROUP = [1, 2]  # global ranks; the group's rank 0 is global rank 1


def _scenario_subgroup(mod, rank: int) -> dict | None:
    """group=[1, 2] (global rank 0 not in it): 2 SGD steps of BucketedDDP and torch DDP on that group."""
    group = dist.new_group(_SUBGROUP, backend="gloo")  # every rank creates it, only members use it
    if rank not in _SUBGROUP:
        return None
    ours_net, torch_net = _net(seed=rank), _net(seed=rank)  # different on each member: broadcast decides
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=_CAP_BYTES / 2**20, group=group)
    after_init = {k: v.clone() for k, v in ours_net.state_dict().items()}
    ref = DDP(torch_net, process_group=group)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours_net, torch_net)]
    steps = []
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        _loss(ours, step, rank).backward()
        _loss(ref, step, rank).backward()
        steps.append({"ours": _grads(ours_net), "torch": _grads(torch_net)})
        for opt in opts:
            opt.step()
    return {"after_init": after_init, "steps": steps}


class MixedNet(nn.Module):
    """A float32 layer, then a float64 one, each bias registered BEFORE its weight (registration order is not
    the order backward produces gradients in); with a cap of 1 byte, every parameter is a bucket of its own."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            self.b1 = nn.Parameter(torch.randn(8) * 0.1)
            self.w1 = nn.Parameter(torch.randn(8, 6) * 0.3)
            self.b2 = nn.Parameter(torch.randn(5, dtype=torch.float64) * 0.1)
            self.w2 = nn.Parameter(torch.randn(5, 8, dtype=torch.float64) * 0.3)
        self.events: list | None = None  # while set: ("backward reaches", "first") when backward reaches layer 1

    def forward(self, x):
        h = F.linear(x, self.w1, self.b1)
        if self.events is not None and h.requires_grad:
            events = self.events
            h.register_hook(lambda grad: events.append(("backward reaches", "first")))
        return F.linear(torch.relu(h).double(), self.w2, self.b2)


def _mixed_loss(model, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return F.cross_entropy(model(x), y)


def _scenario_mixed(mod, rank: int) -> dict:
    """MixedNet, a bucket per parameter (cap 1 byte), BucketedDDP and torch DDP: step 0 synced (its events); then a
    backward through the wrapped module itself (model.module, no forward of the wrapper): what each gives."""
    ours_net, torch_net = MixedNet(), MixedNet()
    ours = mod.BucketedDDP(ours_net, bucket_cap_mb=1 / 2**20)
    ref = DDP(torch_net, bucket_cap_mb=1 / 2**20)
    events: list = []
    ours_net.events = events
    with _log(mod, events):
        _mixed_loss(ours, 0, rank).backward()
        events.append(("backward returned",))
    ours_net.events = None
    _mixed_loss(ref, 0, rank).backward()
    synced = {"ours": _grads(ours_net), "torch": _grads(torch_net)}
    for net in (ours_net, torch_net):
        net.zero_grad(set_to_none=True)
    with _log(mod) as log:
        _mixed_loss(ours_net, 1, rank).backward()  # the module itself: no forward of the wrapper prepared a sync
    _mixed_loss(torch_net, 1, rank).backward()
    return {"events": events, "synced": synced, "unwrapped": {"ours": _grads(ours_net), "torch": _grads(torch_net)},
            "unwrapped_calls": _calls(log)}


_HALF_GRAD = 30000.0  # float16's largest finite value is 65504: the mean of 3 such gradients fits, their sum does not


def _scenario_half(mod, rank: int) -> dict:
    """A float16 Linear(1, 1) without bias, input _HALF_GRAD on every rank: each rank's gradient is _HALF_GRAD;
    BucketedDDP and torch DDP."""
    ours_net, torch_net = nn.Linear(1, 1, bias=False).half(), nn.Linear(1, 1, bias=False).half()
    ours, ref = mod.BucketedDDP(ours_net), DDP(torch_net)
    x = torch.full((1, 1), _HALF_GRAD, dtype=torch.float16)
    ours(x).sum().backward()
    ref(x).sum().backward()
    return {"ours": _grads(ours_net), "torch": _grads(torch_net)}


_SCENARIOS = {"train": _scenario_train, "no_sync": _scenario_no_sync, "unused": _scenario_unused,
              "unused_accumulated": _scenario_unused_accumulated, "late_delivery": _scenario_late_delivery,
              "subgroup": _scenario_subgroup, "tied_frozen": _scenario_tied_frozen, "mixed": _scenario_mixed,
              "half": _scenario_half}


def _ddp_rank(ref: grading.ModuleRef) -> dict:
    """Every scenario, in turn, agreeing after each (tests/scenarios.py)."""
    mod = ref.load()
    rank = dist.get_rank()
    return run_scenarios({name: partial(scenario, mod, rank) for name, scenario in _SCENARIOS.items()}, _AGREE_S)


# ---------------------------------------------------------------- in the parent

_world = SharedWorld(_ddp_rank, _WORLD)


def _results(ref: grading.ModuleRef, name: str) -> list:
    """Per rank, the results of one scenario; one world shared by every test."""
    return _world.results(name, ref, hang_hint="a rank waits for a collective another never launched?")


def _grad_problems(ours: dict, expected: dict, what: str) -> list[str]:
    problems = []
    for name, want in expected.items():
        got = ours[name]
        if (got is None) != (want is None):
            problems.append(f"{what}, {name}.grad: {'None' if got is None else 'a tensor'}, torch DDP gives "
                            f"{'None' if want is None else 'a tensor'}")
        elif got is not None:
            problem = diff_report(got, want, f"{what}, {name}.grad", **_TOL)
            if problem:
                problems.append(problem)
    return problems


def _count_problems(calls: list, what: str) -> list[str]:
    problems = []
    names = [name for name, _ in calls]
    if names != ["all_reduce"] * len(_EXPECTED_BUCKETS):
        problems.append(f"{what}: called {names or 'no collective'}; expected one all_reduce per bucket, "
                        f"{len(_EXPECTED_BUCKETS)} (buckets {_EXPECTED_BUCKETS} at {_CAP_BYTES} bytes)")
    blocking = sum(1 for name, is_async in calls if name == "all_reduce" and not is_async)
    if blocking:
        problems.append(f"{what}: {blocking} all_reduce call(s) without async_op=True; a blocking call "
                        "inside a gradient hook stops backward until the network is done (no overlap)")
    return problems


def test_3_2_assign_buckets_follows_the_rule(grade):
    mod = grade("3.2").load()

    def params(*specs):  # (numel, dtype, device, requires_grad)
        return [torch.zeros(n, dtype=dt, device=dev).requires_grad_(rg) for n, dt, dev, rg in specs]

    f32, f64 = torch.float32, torch.float64
    net = Net()
    cases = [
        ("Net of this test, 1100 bytes", list(net.parameters()), _CAP_BYTES, _EXPECTED_BUCKETS),
        ("the docstring's example", params((10, f32, "cpu", True), (10, f32, "cpu", True),
                                           (30, f32, "cpu", True), (5, f32, "cpu", True)), 80, [[3, 2], [1, 0]]),
        ("a bucket closes when it REACHES the cap (>=)", params(*[(5, f32, "cpu", True)] * 3), 40, [[2, 1], [0]]),
        ("a bucket one byte short of the cap stays open", params(*[(10, f32, "cpu", True)] * 3), 81, [[2, 1, 0]]),
        ("a parameter larger than the cap closes the bucket it joins",
         params((2, f32, "cpu", True), (100, f32, "cpu", True), (2, f32, "cpu", True), (2, f32, "cpu", True)),
         32, [[3, 2, 1], [0]]),
        ("a parameter larger than the cap, into an empty bucket", params((2, f32, "cpu", True), (100, f32, "cpu", True)),
         32, [[1], [0]]),
        ("frozen parameters (requires_grad=False) are left out",
         params((5, f32, "cpu", True), (5, f32, "cpu", False), (5, f32, "cpu", True), (5, f32, "cpu", False)),
         1000, [[2, 0]]),
        ("one open bucket per dtype", params((10, f32, "cpu", True), (10, f64, "cpu", True), (10, f32, "cpu", True),
                                             (10, f64, "cpu", True), (10, f32, "cpu", True)), 80, [[3], [4, 2], [1], [0]]),
        ("one open bucket per device", params((10, f32, "cpu", True), (10, f32, "meta", True), (10, f32, "cpu", True)),
         80, [[2, 0], [1]]),
        ("leftover buckets in the order they were opened",
         params((1, f64, "cpu", True), (1, f32, "cpu", True), (1, f64, "cpu", True)), 1000, [[2, 0], [1]]),
        ("cap_bytes=1: every parameter reaches the cap alone", params(*[(3, f32, "cpu", True)] * 3), 1,
         [[2], [1], [0]]),
        ("no parameters at all", [], 100, []),
        ("only frozen parameters", params((5, f32, "cpu", False)), 100, []),
    ]
    problems = []
    for what, ps, cap, expected in cases:
        got = mod.assign_buckets(ps, cap)
        if [list(b) for b in got] != expected:
            sizes = [(p.numel() * p.element_size(), str(p.dtype).replace("torch.", ""), p.device.type,
                      "" if p.requires_grad else "frozen") for p in ps]
            problems.append(f"{what}: assign_buckets(params of bytes {sizes}, cap_bytes={cap}) returned "
                            f"{got}, expected {expected}")
    assert_no_problems(problems, "assign_buckets differs from the rule in its docstring:")


def test_3_2_gradients_equal_torch_ddp(grade):
    ranks = _results(grade("3.2"), "train")
    problems = []
    for rank, r in enumerate(ranks):
        for step, s in enumerate(r["steps"], start=1):
            problems += _grad_problems(s["ours"], s["torch"], f"step {step}, rank {rank} of {_WORLD} (local batch "
                                       f"{3 + 2 * rank})")
        for key, want in r["final"]["torch"].items():
            problem = diff_report(r["final"]["ours"][key].detach(), want.detach(),
                                  f"rank {rank}, {key} after 3 SGD steps", **_TOL)
            if problem:
                problems.append(problem)
    assert_no_problems(problems, "BucketedDDP's gradients differ from torch DDP's (same models, uneven batches of "
                                 "3, 5, 7 samples); DDP's gradient is the MEAN over ranks of each rank's gradient:")


def test_3_2_broadcast_parameters_and_buffers_at_construction(grade):
    ranks = _results(grade("3.2"), "train")
    rank0 = _net(seed=0).state_dict()
    problems = []
    for rank, r in enumerate(ranks):
        for key, want in rank0.items():
            got = r["after_init"][key]
            kind = "buffer" if key.startswith("bn.running") or key.endswith("num_batches_tracked") else "parameter"
            problem = diff_report(got.float(), want.float(), f"rank {rank}, {kind} {key} right after construction",
                                  rtol=0, atol=0)
            if problem:
                problems.append(problem)
    assert_no_problems(problems, "every rank starts from a different model here; BucketedDDP(...) must make every "
                                 "parameter AND buffer (BatchNorm's running statistics) equal to rank 0's:")


def test_3_2_one_async_all_reduce_per_bucket(grade):
    ranks = _results(grade("3.2"), "train")
    problems = []
    for rank, r in enumerate(ranks):
        for step, s in enumerate(r["steps"], start=1):
            problems += _count_problems(s["calls"], f"step {step}, rank {rank}")
    assert_no_problems(problems, "the collectives of one training step (forward + backward):")


def test_3_2_all_reduce_launched_during_backward(grade):
    ranks = _results(grade("3.2"), "train")
    problems = []
    for rank, r in enumerate(ranks):
        events = r["events"]
        kinds = [e[0] for e in events]
        if "collective" not in kinds or "backward reaches" not in kinds:
            problems.append(f"rank {rank}: no all_reduce, or backward never reached the first layer, in step 1: {events}")
            continue
        first_collective, first_layer = kinds.index("collective"), kinds.index("backward reaches")
        if first_collective > first_layer:
            problems.append(f"rank {rank}: the first all_reduce came after backward reached the FIRST layer, "
                            f"when only that layer's backward was left to overlap with; launch each bucket "
                            f"(in bucket order) from the gradient hook that completes it. Events: {events}")
        returned = kinds.index("backward returned")
        late = [e for e in events[returned:] if e[0] == "collective"]
        if late:
            problems.append(f"rank {rank}: {len(late)} collective(s) after loss.backward() returned; backward must "
                            f"return with the gradients reduced. Events: {events}")
    assert_no_problems(problems, "when the all-reduces start (order of events in step 1; bucket 0 holds the last and "
                                 "branch layers, so its gradients are ready long before backward reaches `first`):")


def test_3_2_gradients_are_views_into_the_buckets(grade):
    """After each synced backward every .grad is a view into its bucket's flat buffer (the docstring; torch's
    gradient_as_bucket_view=True): the gradients of one bucket share one storage, the same in every step (the
    buffers are allocated once), so no gradient is copied back and nothing is allocated per step."""
    ranks = _results(grade("3.2"), "train")
    problems = []
    for rank, r in enumerate(ranks):
        first = [set(bucket) for bucket in r["steps"][0]["storages"]]
        for step, s in enumerate(r["steps"], start=1):
            for b, bucket in enumerate(s["storages"]):
                if None in bucket or len(set(bucket)) != 1:
                    problems.append(f"step {step}, rank {rank}: the .grad of the {len(bucket)} parameters of bucket "
                                    f"{b} lie in {len(set(bucket) - {None})} different storage(s)"
                                    + (" (some .grad is None)" if None in bucket else "")
                                    + "; each must be a view of the bucket's one flat buffer")
                elif step > 1 and set(bucket) != first[b]:
                    problems.append(f"step {step}, rank {rank}: the gradients of bucket {b} lie in another storage "
                                    "than in step 1; the flat buffers are allocated once, and .grad stays a view of "
                                    "them")
    assert_no_problems(problems, "where the gradients live after loss.backward() (3 steps, zero_grad(set_to_none="
                                 "True) before each):")


def test_3_2_float16_divides_before_the_sum(grade):
    ranks = _results(grade("3.2"), "half")
    problems = []
    for rank, r in enumerate(ranks):
        problems += _grad_problems(r["ours"], r["torch"], f"rank {rank}")
    assert_no_problems(problems, f"a float16 model, a gradient of {_HALF_GRAD:g} on each of {_WORLD} ranks: their "
                                 f"mean, {_HALF_GRAD:g}, fits float16 (largest finite value 65504), their sum does not; "
                                 "each bucket is divided by the world size BEFORE its SUM all-reduce (the docstring; "
                                 "torch's allreduce_hook), as torch DDP does:")


def test_3_2_no_sync_decided_at_forward_like_ddp(grade):
    ranks = _results(grade("3.2"), "no_sync")
    problems = []
    syncs = {"forward inside no_sync(), backward outside": False,
             "forward outside no_sync(), backward inside": True,
             "2 micro-batches, the first inside no_sync()": True,
             _NESTED: False, _EVALUATION: True, _KEYWORDS: True}
    for rank, r in enumerate(ranks):
        for what, should_sync in syncs.items():
            case = r[what]
            problems += _grad_problems(case["ours"], case["torch"], f"{what}, rank {rank}")
            names = [name for name, _ in case["calls"]]
            if should_sync:
                problems += _count_problems(case["calls"], f"{what}, rank {rank}")
            elif names:
                problems.append(f"{what}, rank {rank}: called {names}; torch DDP does not sync (its forward "
                                "prepared no reduction)")
    assert_no_problems(problems, "no_sync(): torch DDP decides at FORWARD whether the backward syncs, and leaving a "
                                 "no_sync() block restores the setting in force when it was entered (an inner block "
                                 "ending inside an outer one leaves sync off):")


def test_3_2_unused_parameter_neither_hangs_nor_breaks_the_average(grade):
    ranks = _results(grade("3.2"), "unused")  # a hang would have failed here, with every rank's stack
    problems = []
    branch = {"branch.weight", "branch.bias"}
    for rank, (some, none) in enumerate(ranks):
        problems += _grad_problems(some["ours"], some["torch"],
                                   f"`branch` unused on rank 0 only, rank {rank} (torch DDP: find_unused_parameters=True)")
        problems += _count_problems(some["calls"], f"`branch` unused on rank 0 only, rank {rank}")
        others = {k: v for k, v in none["torch"].items() if k not in branch}
        problems += _grad_problems(none["ours"], others, f"`branch` unused on every rank, rank {rank}")
        problems += _count_problems(none["calls"], f"`branch` unused on every rank, rank {rank}")
        for name in branch:
            got = none["ours"][name]
            if got is not None and got.abs().max().item() != 0:
                problems.append(f"`branch` unused on every rank, rank {rank}: {name}.grad is not None nor zeros "
                                f"(max |grad| {got.abs().max().item():.3g}); no rank computed a gradient for it")
    assert_no_problems(problems, "a parameter without a gradient this step counts as a zero gradient on its rank:")


def test_3_2_unused_parameter_contributes_its_accumulated_grad(grade):
    ranks = _results(grade("3.2"), "unused_accumulated")
    problems = []
    for rank, steps in enumerate(ranks):
        for step, s in enumerate(steps, start=1):
            what = (f"synced backward {step} after a no_sync() micro-batch, `branch` unused on rank 0 only, "
                    f"rank {rank}")
            problems += _grad_problems(s["ours"], s["torch"], what)
            problems += _count_problems(s["calls"], what)
    assert_no_problems(problems, "a parameter this rank did not use in the backward contributes its .grad as it "
                                 "stands (here: what a no_sync() micro-batch, then the previous step, accumulated), "
                                 "zeros only if it has none; torch DDP (find_unused_parameters=True) does the same. "
                                 "`branch` used everywhere inside no_sync(), then skipped by rank 0 in 2 synced "
                                 "backwards without zero_grad:")


def test_3_2_backward_returns_after_every_all_reduce_completes(grade):
    ranks = _results(grade("3.2"), "late_delivery")
    problems = []
    for rank, steps in enumerate(ranks):
        for step, s in enumerate(steps, start=1):
            problems += _grad_problems(s["ours"], s["torch"], f"step {step}, rank {rank}, read as backward() returned")
    assert_no_problems(problems, "here an async all-reduce puts its result into the bucket only when ITS Work is "
                                 "waited for (as a slow network may: collectives can finish in any order); every "
                                 ".grad must hold the average once loss.backward() returns, so the final callback "
                                 "waits for every bucket's Work, not only the last one's:")


def test_3_2_subgroup_without_global_rank_0(grade):
    ranks = _results(grade("3.2"), "subgroup")
    group_rank0 = _net(seed=_SUBGROUP[0]).state_dict()
    problems = []
    for rank in _SUBGROUP:
        r = ranks[rank]
        for key, want in group_rank0.items():
            problem = diff_report(r["after_init"][key].float(), want.float(),
                                  f"global rank {rank}, {key} right after construction (expected the group's rank 0, "
                                  f"global rank {_SUBGROUP[0]})", rtol=0, atol=0)
            if problem:
                problems.append(problem)
        for step, s in enumerate(r["steps"], start=1):
            problems += _grad_problems(s["ours"], s["torch"], f"step {step}, global rank {rank} (torch DDP with "
                                       f"process_group={_SUBGROUP})")
    assert_no_problems(problems, f"BucketedDDP(net, group=new_group({_SUBGROUP})) in a world of {_WORLD}: everything is "
                                 "relative to `group` (its rank 0 broadcasts, its size averages), not to the world:")


def test_3_2_tied_and_frozen_parameters_like_ddp(grade):
    ranks = _results(grade("3.2"), "tied_frozen")
    rank0 = _tied_frozen_net(seed=0).state_dict()
    problems = []
    for rank, r in enumerate(ranks):
        for key, want in rank0.items():
            problem = diff_report(r["after_init"][key], want, f"rank {rank}, {key} right after construction", 0, 0)
            if problem:
                problems.append(problem)
        for step, s in enumerate(r["steps"], start=1):
            what = f"step {step}, rank {rank}"
            problems += _grad_problems(s["ours"], s["torch"], what)
            if s["elements"] != _TIED_FROZEN_ELEMENTS:
                problems.append(f"{what}: all-reduced {s['elements']} elements; torch DDP all-reduces each trainable "
                                f"parameter once: {_TIED_FROZEN_ELEMENTS} (the tied weight once, no frozen one)")
            blocking = sum(1 for name, is_async in s["calls"] if name == "all_reduce" and not is_async)
            if blocking:
                problems.append(f"{what}: {blocking} all_reduce call(s) without async_op=True")
        for key, want in r["final"]["torch"].items():
            problem = diff_report(r["final"]["ours"][key], want, f"rank {rank}, {key} after 2 SGD steps", **_TOL)
            if problem:
                problems.append(problem)
    assert_no_problems(problems, "a model with mid2.weight tied to mid.weight and frozen parameters (frozen.*, "
                                 "last.bias), a different one on every rank, 2 SGD steps with weight decay, against "
                                 "torch DDP: every parameter, frozen ones too, is rank 0's after construction; a "
                                 "frozen parameter gets no gradient (.grad None) and no bucket slot; a tied one is "
                                 "all-reduced once, with the sum of both uses' gradients:")


def test_3_2_mixed_dtypes_one_parameter_buckets_and_a_backward_of_the_module_alone(grade):
    """MixedNet (float32 then float64 layers, each bias registered before its weight) with a bucket per parameter,
    against torch DDP: the synced step's gradients equal DDP's (each bucket's flat buffer in its parameters' dtype,
    each .grad of its parameter's dtype), the first all_reduce starts before backward reaches the first layer
    (a bucket launches when its parameter is ready, whatever the registration order), and a backward through
    the wrapped module alone afterwards (model.module(x): no forward of the wrapper prepared a sync, as in torch
    DDP) issues no collective and leaves each rank its own gradient."""
    ranks = _results(grade("3.2"), "mixed")
    problems = []
    for rank, r in enumerate(ranks):
        what = f"rank {rank} of {_WORLD} (local batch {3 + 2 * rank})"
        problems += _grad_problems(r["synced"]["ours"], r["synced"]["torch"], f"{what}, the synced step")
        for name, grad in r["synced"]["ours"].items():
            want = r["synced"]["torch"][name]
            if grad is not None and want is not None and grad.dtype != want.dtype:
                problems.append(f"{what}: {name}.grad is {grad.dtype}, its parameter {want.dtype}")
        kinds = [e[0] for e in r["events"]]
        if "collective" in kinds and "backward reaches" in kinds \
                and kinds.index("collective") > kinds.index("backward reaches"):
            problems.append(f"{what}: the first all_reduce came after backward reached the first layer: the buckets "
                            f"of the second layer's parameters (complete long before) waited. Events: {r['events']}")
        if r["unwrapped_calls"]:
            problems.append(f"{what}: a backward through model.module (no forward of the wrapper) called "
                            f"{[name for name, _ in r['unwrapped_calls']]}; only a forward of the wrapper prepares a "
                            "sync, for its own backward (a decision left armed after the synced backward?)")
        problems += _grad_problems(r["unwrapped"]["ours"], r["unwrapped"]["torch"],
                                   f"{what}, a backward through model.module alone (each rank's own gradient)")
    assert_no_problems(problems, "a float32 + float64 model, a bucket per parameter (bucket_cap_mb = 1 byte), "
                                 "against torch DDP:")
