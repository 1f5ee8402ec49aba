"""fp16 gradients underflow without loss scaling and survive with it (exercise 2.2), measured.

    python benchmarks/loss_scaling.py                          # 12-layer GELU MLP, batch 1024, CPU
    python benchmarks/loss_scaling.py --depth 8 --scales 0 4 8 16 32

A deep MLP (PyTorch's default init, GELU, no normalisation, no residuals: its gradients
shrink layer by layer towards the input) takes one forward + backward on a fixed batch:
in float32 (the truth); under torch.autocast(device, float16) with the loss multiplied by
S = 2^s before backward and the gradients divided by S after it, in float32 (what
GradScaler.scale / unscale_ do); and under bfloat16 without scaling. The parameters stay
float32 (autocast), so what underflows is the float16 activation gradients flowing back
and the float16 matmuls that produce the weight gradients. Per run it reports:

  flushed     weight-gradient elements nonzero in float32 but exactly 0 here (float16's
              smallest subnormal is 6.0e-8, its smallest normal 6.1e-5)
  rel. err    ||g - g_fp32|| / ||g_fp32|| of the first layer (input side) and of the last
  overflow    some gradient is inf/nan: GradScaler would skip this step and halve S

torch >= 2.4 runs float16 autocast on CPU (slowly: no float16 matmul units); --device cuda
runs it on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run without installing
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.launch import exit_on_user_error  # noqa: E402
from _util import OneLineParser  # noqa: E402  (benchmarks/ is sys.path[0])


def build_mlp(depth: int, width: int, in_features: int, classes: int, device: torch.device) -> nn.Sequential:
    """Linear -> GELU, `depth` Linear layers in all, PyTorch's default init (seed 0)."""
    torch.manual_seed(0)
    sizes = [in_features] + [width] * (depth - 1) + [classes]
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < depth - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers).to(device)


def weight_grads(model: nn.Sequential, inputs, targets, dtype: torch.dtype | None, scale: float) -> list[torch.Tensor]:
    """Float32 weight gradients of one step, per Linear (input side first): autocast to `dtype`
    (None: plain float32), backward of loss * scale, gradients / scale."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(inputs)
    loss = F.cross_entropy(logits.float(), targets)
    (loss * scale).backward()
    return [m.weight.grad.float() / scale for m in model if isinstance(m, nn.Linear)]


def compare(grads: list[torch.Tensor], truth: list[torch.Tensor]) -> dict:
    """Flushed fraction (all layers, first layer), relative errors (first, last layer), overflow."""
    nonzero = [t != 0 for t in truth]
    flushed = [((g == 0) & nz).sum().item() for g, nz in zip(grads, nonzero)]
    counts = [nz.sum().item() for nz in nonzero]

    def rel(g, t):
        return ((g - t).norm() / t.norm()).item() if t.norm() > 0 else float("nan")

    return {"flushed": sum(flushed) / max(sum(counts), 1), "first_flushed": flushed[0] / max(counts[0], 1),
            "first_err": rel(grads[0], truth[0]), "last_err": rel(grads[-1], truth[-1]),
            "overflow": any(not torch.isfinite(g).all() for g in grads)}


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12, help="Linear layers (default 12)")
    parser.add_argument("--width", type=int, default=256, help="hidden features (default 256)")
    parser.add_argument("--batch", type=int, default=1024, help="samples in the batch (default 1024)")
    parser.add_argument("--scales", type=int, nargs="+", default=[0, 8, 16, 24, 32], metavar="s",
                        help="float16 loss scales S = 2^s to try (default 0 8 16 24 32)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    args = parser.parse_args(argv)
    if min(args.depth, args.width, args.batch, args.threads) < 1 or args.depth < 2:
        parser.error("--depth must be >= 2; --width, --batch and --threads >= 1")
    if any(not 0 <= s <= 120 for s in args.scales):
        parser.error("--scales are exponents s of S = 2^s, 0 <= s <= 120")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.batch, 64, generator=gen).to(device)
    targets = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    model = build_mlp(args.depth, args.width, 64, 10, device)
    truth = weight_grads(model, inputs, targets, None, 1.0)

    print(f"{args.depth}-layer GELU MLP (default init), width {args.width}, batch {args.batch}, on {device}, "
          f"torch {torch.__version__}")
    print("float32 median |weight gradient| per layer, input side first:")
    print("  " + " ".join(f"{t.abs().median().item():.0e}" for t in truth))
    print()
    header = f"{'precision':<10}{'loss scale':>11}{'flushed to 0':>14}{'layer 1 flushed':>17}" \
             f"{'layer 1 rel. err':>18}{f'layer {args.depth} rel. err':>19}  overflow"
    print(header)
    print("-" * len(header))
    runs = [(torch.float16, s) for s in args.scales] + [(torch.bfloat16, 0)]
    for dtype, s in runs:
        r = compare(weight_grads(model, inputs, targets, dtype, 2.0**s), truth)
        name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        print(f"{name:<10}{f'2^{s}':>11}{r['flushed']:>13.1%}{r['first_flushed']:>17.1%}"
              f"{r['first_err']:>18.2g}{r['last_err']:>19.2g}  {'inf/nan: skip, S/2' if r['overflow'] else 'no'}")
    print()
    print("S = 2^0 is float16 without a scaler. Relative errors of inf/nan runs are meaningless: such a step is "
          "skipped. bfloat16 has float32's exponent range: nothing flushes, at ~2 digits of precision.")


if __name__ == "__main__":
    with exit_on_user_error():
        main()
