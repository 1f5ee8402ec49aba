"""Parameter servers (exercise 3.4): bytes per server per step vs ring all-reduce, and images/s of
synchronous vs asynchronous training with one slow worker.

    python benchmarks/ps_bench.py                                # 3 workers, 1 and 2 servers
    python benchmarks/ps_bench.py --workers 3 --servers 1 2 --width 256 --slow-ms 20 --json ps.json
    python benchmarks/ps_bench.py --learner                      # YOUR phase3_multi_node/parameter_server.py

Traffic: every rank counts the bytes of the point-to-point calls it makes (sent + received,
common.measure.CollectiveLog) during synchronous training of an MLP, parameters assigned
to servers by the greedy bin packing; per step a server moves 2 W S_k (W gradients of its
shard S_k in, W copies out), a worker 2 Psi, where a ring all-reduce rank moves
4 (W-1)/W Psi (2 (W-1)/W sent, as much received) with no hot spot.
Throughput: one server, W workers share the digits (each takes the next batch from a
shared counter until the epochs are done); the last worker sleeps --slow-ms per step (a
slow machine). Sync waits for it every round; async lets the others run on; a staleness
bound s lets them run at most s steps ahead. Images/s = samples / (last worker's end -
first worker's start); the test accuracy and mean staleness show what async costs.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing; spawned ranks re-run this
    sys.path.insert(0, str(REPO_ROOT))

import importlib  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.data import load_digits  # noqa: E402
from common.launch import exit_on_user_error, run_world  # noqa: E402
from common.measure import CollectiveLog  # noqa: E402
from _util import OneLineParser, save_outputs  # noqa: E402  (benchmarks/ is sys.path[0])

_P2P = ("send", "recv", "isend", "irecv")


def build(width: int, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _assignment(mod, model: nn.Module, servers: int) -> list[int]:
    return list(mod.assign_parameters([p.numel() * p.element_size() for p in model.parameters()], servers))


def _traffic(mod, servers: int, width: int, steps: int, batch: int) -> dict:
    """Sync training on random digits-shaped data; bytes this rank moved over the run."""
    model = build(width)
    assignment = _assignment(mod, model, servers)
    with CollectiveLog(names=_P2P, also_in=(mod,)) as log:
        if dist.get_rank() < servers:
            mod.ParameterServer(list(model.parameters()), assignment, servers, 0.05, mode="sync").serve()
        else:
            gen = torch.Generator().manual_seed(dist.get_rank())
            batches = [(torch.rand(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
                       for _ in range(steps)]
            mod.run_worker(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), assignment, servers)
    return {"bytes": log.bytes(), "assignment": assignment}


class SharedBatches:
    """Batches of the digits handed out first come, first served through the world's store."""

    def __init__(self, key: str, epochs: int, batch: int, slow_s: float):
        images, labels = load_digits("train").tensors
        self.images, self.labels = images.flatten(1), labels
        gen = torch.Generator().manual_seed(0)
        self.order = torch.cat([torch.randperm(len(labels), generator=gen) for _ in range(epochs)]).split(batch)
        self.store, self.key, self.slow_s = dist.distributed_c10d._get_default_store(), key, slow_s
        self.samples = 0

    def __iter__(self):
        while (i := self.store.add(self.key, 1) - 1) < len(self.order):
            if self.slow_s:
                time.sleep(self.slow_s)  # a slow machine: this worker's every step takes longer
            idx = self.order[i]
            self.samples += len(idx)
            yield self.images[idx], self.labels[idx]


def _throughput(mod, width: int, epochs: int, batch: int, lr: float, slow_ms: float, runs: list) -> dict:
    """One server; for each (mode, bound) in runs: samples, start/end time per worker, the server's record."""
    out = {}
    for mode, bound in runs:
        name = mode if bound is None else f"{mode} s={bound}"
        model = build(width, seed=1)
        assignment = [0] * len(list(model.parameters()))
        dist.barrier()
        if dist.get_rank() == 0:
            record = mod.ParameterServer(list(model.parameters()), assignment, 1, lr, mode, bound).serve()
            out[name] = {"params": [record.params[i] for i in sorted(record.params)],
                         "staleness": [s for _, s in record.staleness]}
        else:
            slow = dist.get_rank() == dist.get_world_size() - 1
            batches = SharedBatches(f"ps_bench/{name}", epochs, batch, slow_ms / 1e3 if slow else 0.0)
            start = time.time()
            mod.run_worker(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), assignment, 1)
            out[name] = {"samples": batches.samples, "start": start, "end": time.time()}
    return out


def bench_rank(module_name: str, servers: int, args: dict, runs: list) -> dict:
    mod = importlib.import_module(module_name)
    result = {"traffic": _traffic(mod, servers, args["width"], args["steps"], args["batch"])}
    if runs:
        result["throughput"] = _throughput(mod, args["width"], args["epochs"], args["batch"], args["lr"],
                                           args["slow_ms"], runs)
    return result


def accuracy(width: int, params: list[torch.Tensor]) -> float:
    model = build(width)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        images, labels = load_digits("test").tensors
        return (model(images.flatten(1)).argmax(1) == labels).float().mean().item()


def run(args) -> dict:
    module_name = ("" if args.learner else "solutions.") + "phase3_multi_node.parameter_server"
    knobs = {k: getattr(args, k) for k in ("width", "steps", "batch", "epochs", "lr", "slow_ms")}
    runs = [("sync", None), ("async", None)] + [("async", s) for s in args.bounds]
    psi = sum(p.numel() * p.element_size() for p in build(args.width).parameters())
    results = {"psi_bytes": psi, "workers": args.workers, "knobs": knobs, "traffic": {}, "throughput": {}}
    for k in args.servers:
        with exit_on_user_error():
            ranks = run_world(bench_rank, k + args.workers, args=(module_name, k, knobs, runs if k == 1 else []),
                              timeout=args.timeout)
        assignment = ranks[0]["traffic"]["assignment"]
        sizes = [p.numel() * p.element_size() for p in build(args.width).parameters()]
        shards = [sum(s for s, a in zip(sizes, assignment) if a == j) for j in range(k)]
        results["traffic"][k] = {"server_bytes": [ranks[j]["traffic"]["bytes"] for j in range(k)],
                                 "worker_bytes": [r["traffic"]["bytes"] for r in ranks[k:]], "shards": shards}
        if k == 1:
            for name, server in ranks[0]["throughput"].items():
                workers = [r["throughput"][name] for r in ranks[1:]]
                samples = sum(w["samples"] for w in workers)
                seconds = max(w["end"] for w in workers) - min(w["start"] for w in workers)
                st = server["staleness"]
                results["throughput"][name] = {
                    "images_per_s": samples / seconds, "seconds": seconds, "samples_per_worker": [w["samples"] for w in workers],
                    "accuracy": accuracy(args.width, server["params"]),
                    "mean_staleness": sum(st) / max(len(st), 1), "max_staleness": max(st, default=0)}
    return results


def report(r: dict, args) -> str:
    w, psi, steps = r["workers"], r["psi_bytes"], args.steps
    ring = 4 * (w - 1) / w * psi

    def vs_ring(nbytes: float) -> str:
        return f"{nbytes / ring:>11.2f}x" if ring else f"{'-':>12}"  # one worker: no all-reduce at all
    impl = "your parameter_server.py" if args.learner else "reference parameter_server.py"
    lines = [f"{impl}; MLP 64-{args.width}-{args.width}-10, Psi = {psi:,} B (fp32), W = {w} workers",
             "", f"traffic, sync mode, {steps} steps, bytes sent + received per step (whole run / steps: includes the "
                 "first pull and the headers)",
             f"{'K':>2} {'rank':<10} {'shard B':>10} {'measured B/step':>16} {'formula':>12} {'/ ring rank':>12}"]
    for k, t in r["traffic"].items():
        for j, (got, shard) in enumerate(zip(t["server_bytes"], t["shards"])):
            lines.append(f"{k:>2} {'server ' + str(j):<10} {shard:>10,} {got / steps:>16,.0f} {2 * w * shard:>12,} "
                         f"{vs_ring(got / steps)}   (2 W S_k; max/min shard {max(t['shards']) / min(t['shards']):.2f})")
        worst = max(t["worker_bytes"])
        lines.append(f"{k:>2} {'worker':<10} {psi:>10,} {worst / steps:>16,.0f} {2 * psi:>12,} {vs_ring(worst / steps)}"
                     "   (2 Psi, the busiest worker)")
    lines.append(f"   ring all-reduce among the W workers: {ring:,.0f} B per rank per step = 4 (W-1)/W Psi, on every rank")
    if r["throughput"]:
        lines += ["", f"throughput, 1 server, {w} workers sharing {args.epochs} epochs of the digits (batch {args.batch}, "
                      f"lr {args.lr}), the last worker sleeping {args.slow_ms:g} ms per step",
                  f"{'mode':<12} {'images/s':>9} {'vs sync':>8} {'samples per worker':<22} {'staleness mean/max':>19} "
                  f"{'test acc':>9}"]
        base = r["throughput"]["sync"]["images_per_s"]
        for name, t in r["throughput"].items():
            lines.append(f"{name:<12} {t['images_per_s']:>9,.0f} {t['images_per_s'] / base:>7.2f}x "
                         f"{str(t['samples_per_worker']):<22} {t['mean_staleness']:>10.2f} / {t['max_staleness']:<6} "
                         f"{t['accuracy']:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3, help="worker ranks W (default 3)")
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2],
                        help="server counts K for the traffic table (default 1 2); throughput runs with K = 1")
    parser.add_argument("--width", type=int, default=256, help="MLP hidden width (default 256: ~85k parameters)")
    parser.add_argument("--steps", type=int, default=20, help="sync steps for the traffic table (default 20)")
    parser.add_argument("--batch", type=int, default=32, help="samples per worker step (default 32)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the digits shared by the workers (default 3)")
    parser.add_argument("--lr", type=float, default=0.1, help="server learning rate (default 0.1)")
    parser.add_argument("--slow-ms", type=float, default=20.0, help="extra time per step of the slow worker (default 20)")
    parser.add_argument("--bounds", type=int, nargs="*", default=[0, 1], help="staleness bounds to run too (default 0 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a world is declared hung")
    parser.add_argument("--learner", action="store_true", help="measure YOUR phase3_multi_node/parameter_server.py")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers as JSON")
    args = parser.parse_args(argv)
    if args.workers < 1 or min(args.servers) < 1 or args.width < 1 or args.steps < 1 or args.batch < 1 \
            or args.epochs < 1 or args.slow_ms < 0 or any(s < 0 for s in args.bounds):
        parser.error("need --workers, --servers, --width, --steps, --batch, --epochs >= 1, --slow-ms >= 0, --bounds >= 0")
    if 1 not in args.servers:
        args.servers = [1] + args.servers  # the throughput runs need K = 1
    results = run(args)
    print(report(results, args))
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
