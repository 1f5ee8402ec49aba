"""The trainer's optimizer step, torch's fused kernel against its foreach one, side by side.

    python benchmarks/optimizer_step.py                      # ResNet-50's parameters, on the GPU if any
    python benchmarks/optimizer_step.py --model resnet18 --steps 20 --json out.json

make_optimizer's groups (weight decay on the weights, none on norms and biases) over a
torchvision model's parameters, random gradients, then --steps optimizer steps and
zero_grad(set_to_none=False), foreach and fused alternating round by round (so drift hits
both alike), for SGD (nesterov momentum, the trainer's default) and AdamW. Times are CUDA
events on a GPU (perf_counter on the CPU), medians over the rounds. The trainer uses the fused
step on GPUs (trainer/step.py, make_optimizer); this is the measurement behind that choice.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._util import OneLineParser, save_outputs  # noqa: E402
from common.models import build_model  # noqa: E402
from solutions.phase4_production.trainer.config import OptimConfig  # noqa: E402
from solutions.phase4_production.trainer.step import parameter_groups  # noqa: E402


def _groups(optim: OptimConfig, model: torch.nn.Module) -> list[dict]:
    return [{"params": params, "weight_decay": decay} for _, decay, params in parameter_groups(optim, model)]


def time_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Seconds per optimizer.step(), over `steps` steps."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            optimizer.step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / steps
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - began) / steps


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision model of common.models")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per timing")
    parser.add_argument("--rounds", type=int, default=5, help="foreach/fused rounds, alternating")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, (3, 224, 224), 1000, seed=0).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim = OptimConfig()  # the trainer's defaults
    results = {}
    for name, make in {"sgd": lambda **kw: torch.optim.SGD(_groups(optim, model), lr=0.1, momentum=0.9,
                                                           nesterov=True, **kw),
                       "adamw": lambda **kw: torch.optim.AdamW(_groups(replace(optim, weight_decay=0.05), model),
                                                               lr=1e-3, **kw)}.items():
        times: dict[str, list[float]] = {"foreach": [], "fused": []}
        optimizers = {"foreach": make(foreach=True), "fused": make(fused=True)}
        for kind in optimizers:  # the first steps allocate the state
            time_steps(optimizers[kind], 3, device)
        for round_ in range(args.rounds):
            for kind in (("foreach", "fused") if round_ % 2 == 0 else ("fused", "foreach")):
                times[kind].append(time_steps(optimizers[kind], args.steps, device))
        foreach, fused = statistics.median(times["foreach"]), statistics.median(times["fused"])
        results[name] = {"foreach_s": foreach, "fused_s": fused, "fused_over_foreach": fused / foreach,
                         "rounds": times}
        print(f"{name:<6} foreach {foreach * 1e3:8.3f} ms  fused {fused * 1e3:8.3f} ms  fused/foreach "
              f"{fused / foreach:.3f}")
    print(f"{args.model} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'the CPU'}, "
          f"torch {torch.__version__}; medians of {args.rounds} rounds of {args.steps} steps")
    save_outputs(results, args.json)


if __name__ == "__main__":
    main()
