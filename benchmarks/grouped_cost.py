"""Cost of grouped and depthwise whitening (issue 14): the fold, the per-batch statistics, a training step.

    python benchmarks/grouped_cost.py [--threads 1] [--repeats 30] [--clock cpu]

Times are CPU time of the process (``--clock cpu``, the default), which other
jobs on a shared machine do not inflate; ``--clock wall`` for wall time.

* **Fold of a depthwise layer** (``M = 960``, MobileNetV2's widest depthwise
  conv): one ``fold_layers([layer])`` (moments, transform, bias compensation)
  for the EVD and the recursive rule, next to the fold of an ungrouped
  ``M = 960`` layer (one ``960 x 960`` eigendecomposition) for scale; and a
  ResNeXt-50 stage-4 grouped conv (``32`` groups of ``32``).
* **Per-batch statistics** of that depthwise conv's input ``(32, 960, 7, 7)``
  (its size in MobileNetV2 at 224x224): the grouped moments (``M`` numbers)
  against the dense ``M x M`` product an ungrouped layer computes, and the
  depthwise convolution's own forward.
* **Training step** (forward, backward, SGD with momentum; default
  ``block_size=10``, folds amortised) of a MobileNetV2 inverted residual block
  and of ``whitenlayers.testing.mobilenet_like``, converted with
  ``targets="all"``, as a ratio to the plain model; variants interleaved step
  by step, medians.

Prints a Markdown table (used in the issue-14 report).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import whitenlayers as wl  # noqa: E402
from whitenlayers import functional as F  # noqa: E402
from whitenlayers.fold import fold_layers  # noqa: E402


CLOCK = time.process_time


def median_time(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def fold_cost(repeats: int):
    rows = []
    x = torch.randn(8, 960, 7, 7) * torch.linspace(0.2, 3, 960).view(1, 960, 1, 1) + 1.0
    cases = [
        ("depthwise 960 (groups=960), EVD", wl.GradWhitenConv2d(960, 960, 3, padding=1, groups=960, bias=False), x),
        ("depthwise 960 (groups=960), recursive",
         wl.RecursiveWhitenConv2d(960, 960, 3, padding=1, groups=960, bias=False), x),
        ("grouped 1024 (32 groups of 32), EVD", wl.GradWhitenConv2d(1024, 1024, 3, padding=1, groups=32, bias=False),
         torch.randn(8, 1024, 7, 7) + 1.0),
        ("grouped 1024 (32 groups of 32), recursive",
         wl.RecursiveWhitenConv2d(1024, 1024, 3, padding=1, groups=32, bias=False), torch.randn(8, 1024, 7, 7) + 1.0),
        ("ungrouped 960 (for scale), EVD", wl.GradWhitenConv2d(960, 16, 1, bias=False), x),
    ]
    for name, layer, inp in cases:
        layer.block_size = 10**9
        with torch.no_grad():
            layer(inp)
            layer.fold()  # block 0 (no recursion) out of the way

            def setup(layer=layer, inp=inp):
                with torch.no_grad():
                    layer(inp)

            t = median_time(lambda: fold_layers([layer]), repeats, setup)
        rows.append((name, t))
    return rows


def stats_cost(repeats: int):
    x = torch.randn(32, 960, 7, 7) + 1.0
    shift = x.mean((0, 2, 3)).double()
    conv = nn.Conv2d(960, 960, 3, padding=1, groups=960, bias=False)
    with torch.no_grad():
        return [
            ("depthwise conv forward (32, 960, 7, 7)", median_time(lambda: conv(x), repeats)),
            ("grouped statistics (960 numbers)", median_time(lambda: F.batch_moments(x, shift, groups=960), repeats)),
            ("dense statistics (960 x 960, what groups=1 would cost)",
             median_time(lambda: F.batch_moments(x, shift), repeats)),
        ]


class InvertedResidual(nn.Module):
    def __init__(self, c: int, expand: int = 6) -> None:
        super().__init__()
        h = c * expand
        self.block = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(inplace=True),
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(inplace=True),
            nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.block(x)


def step_ratio(build, shape, repeats: int, methods=("grad", "recursive", "direct")):
    base = build()
    variants = {"plain": base}
    for m in methods:
        variants[m] = wl.convert_model(copy.deepcopy(base), m, targets="all", include_stem=True)
    opts = {k: torch.optim.SGD(v.parameters(), lr=0.01, momentum=0.9) for k, v in variants.items()}
    x = torch.randn(shape) + 0.5
    times = {k: [] for k in variants}
    for i in range(repeats + 3):
        for k, model in variants.items():
            t0 = CLOCK()
            out = model(x)
            loss = out.square().mean()
            opts[k].zero_grad()
            loss.backward()
            opts[k].step()
            if i >= 3:  # warm-up
                times[k].append(CLOCK() - t0)
    plain = statistics.median(times["plain"])
    return {k: statistics.median(v) / plain for k, v in times.items() if k != "plain"}, plain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} time, medians of {args.repeats}\n")
    print("| fold (one layer) | time |\n|---|---|")
    for name, t in fold_cost(args.repeats):
        print(f"| {name} | {1000 * t:.2f} ms |")
    print("\n| per batch | time |\n|---|---|")
    for name, t in stats_cost(args.repeats):
        print(f"| {name} | {1000 * t:.2f} ms |")
    print("\n| training step vs plain (targets='all', include_stem) | plain | grad | recursive | direct |")
    print("|---|---|---|---|---|")
    for name, build, shape in [
        ("inverted residual block, c=32, expand 6, (32, 32, 32, 32)", lambda: InvertedResidual(32), (32, 32, 32, 32)),
        ("mobilenet_like(width=16), (32, 3, 64, 64)", lambda: wl.testing.mobilenet_like(width=16), (32, 3, 64, 64)),
    ]:
        ratios, plain = step_ratio(build, shape, args.repeats)
        print(f"| {name} | {1000 * plain:.1f} ms | {ratios['grad']:.2f}x | {ratios['recursive']:.2f}x | "
              f"{ratios['direct']:.2f}x |")


if __name__ == "__main__":
    main()
