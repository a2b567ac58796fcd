"""Direct vs gradient whitening: per-layer cost as the batch grows (paper section 5).

The paper counts, per batch of ``B`` samples, ``2 B N M^2`` multiply-adds for
direct whitening (``y = T (x - mu)`` in the forward, ``dx = T^T dy`` in the
backward) against ``N S M^2`` for transforming the weight gradient, a ratio
grad / direct of ``S / (2B)``: the gradient transform wins once ``B > S / 2``.
That count is exact for a fully connected layer (``N = 1``). For a convolution
the weight is shared over the ``H W`` output positions: the gradient transform
costs ``S M^2 k^2`` per batch while direct whitening transforms ``B H W``
input vectors twice, a ratio ``S k^2 / (2 B H W)`` (far below 1 at any batch).

Measured here, interleaved, medians (statistics excluded: they are the same
for both methods and the paper leaves them out):

* direct: ``DirectWhitenFunction`` forward + backward on the layer input;
* grad: the weight-gradient transform (``transform_weight_grad``) plus the
  centring term (``b - W mu``) the layer adds;

for a linear layer (``M = S = 256``) and a 3x3 convolution (``M = S = 64``,
16x16), ``B = 8 ... 512``. The crossover is where the measured ratio crosses 1
(log-linear interpolation). A last table gives whole-layer training steps
(statistics included) relative to the plain layer.

    python benchmarks/crossover.py
    python benchmarks/crossover.py --tiny
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

from _common import Interleaved, add_common_args, sgd_layer_steps, md_table, ratio_stats, setup, write_json

import torch
from torch import nn

import whitenlayers as wl
from whitenlayers.autograd import direct_whiten
from whitenlayers.functional import transform_weight_grad


def _per_call(fn: Callable[[], object], target_s: float = 2e-3) -> Callable[[], float]:
    """A step running ``fn`` enough times to last about ``target_s``; returns seconds per call."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(target_s / one))

    def step():
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n
    return step


def _interleave(steps: Dict[str, Callable[[], float]], repeat: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(repeat):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(steps[name]())
    return {k: statistics.median(v) for k, v in times.items()}


def _crossing(bs: List[int], ratios: List[float]) -> Optional[float]:
    for (b0, r0), (b1, r1) in zip(zip(bs, ratios), zip(bs[1:], ratios[1:])):
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            f = (math.log(r0)) / (math.log(r0) - math.log(r1))
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
    return None


def transform_costs(kind: str, m: int, s: int, hw: int, bs: List[int], repeat: int) -> Dict[str, object]:
    k2 = 9 if kind == "conv" else 1
    t = torch.linalg.qr(torch.randn(m, m))[0] * 0.5 + torch.eye(m)
    mu = torch.randn(m)
    q = t.t() @ t
    wshape = (s, m, 3, 3) if kind == "conv" else (s, m)
    gw = torch.randn(*wshape)
    w = torch.randn(*wshape)
    bias = torch.randn(s)
    rows, data = [], []
    for b in bs:
        xshape = (b, m, hw, hw) if kind == "conv" else (b, m)
        x = torch.randn(*xshape, requires_grad=True)
        dy = torch.randn(*xshape)

        def direct():
            y = direct_whiten(x, t, mu)
            y.backward(dy)
            x.grad = None

        def grad():
            transform_weight_grad(gw, q)
            wm = w.reshape(s, m, -1).sum(-1)
            bias - wm @ mu

        med = _interleave({"direct": _per_call(direct), "grad": _per_call(grad)}, repeat)
        ratio = med["grad"] / med["direct"]
        paper = s / (2 * b)
        exact = s * k2 / (2 * b * (hw * hw if kind == "conv" else 1))
        rows.append([b, 1e3 * med["direct"], 1e3 * med["grad"], ratio, paper, exact])
        data.append({"B": b, "direct_ms": 1e3 * med["direct"], "grad_ms": 1e3 * med["grad"], "ratio": ratio,
                     "paper": paper, "counted": exact})
    cross = _crossing(bs, [d["ratio"] for d in data])
    label = (f"linear, M = S = {m}" if kind == "linear" else f"3x3 conv, M = S = {m}, {hw}x{hw}")
    pred = "B = S/2 = %d" % (s // 2) if kind == "linear" else "B = S k^2 / (2 H W) = %.2f" % (s * k2 / (2 * hw * hw))
    cross_txt = f"B = {cross:.0f}" if cross else ("none in range (grad cheaper at every B)" if data[0]["ratio"] < 1 else "none in range")
    md = (f"**{label}** -- measured crossover (grad = direct): {cross_txt}; counted: {pred}.\n\n"
          + md_table(["B", "direct fwd+bwd (ms)", "grad transform (ms)", "grad / direct measured",
                      "paper S/(2B)", "counted for this layer"], rows, nd=4))
    return {"kind": kind, "rows": data, "crossover_B": cross, "markdown": md}


def layer_steps(m: int, hw: int, bs: List[int], repeat: int) -> Dict[str, object]:
    """Whole training steps of one layer (forward with statistics, backward, SGD), ratio to nn.Conv2d."""
    rows, data = [], []
    for b in bs:
        x = torch.randn(b, m, hw, hw, requires_grad=True)
        torch.manual_seed(0)
        plain = nn.Conv2d(m, m, 3, padding=1, bias=False)
        grad = wl.GradWhitenConv2d.from_conv(nn.Conv2d(m, m, 3, padding=1, bias=False))
        direct = nn.Sequential(wl.DirectWhiten(m), nn.Conv2d(m, m, 3, padding=1, bias=False))
        mods = {"plain": plain, "grad": grad, "direct": direct}
        steps = sgd_layer_steps(mods, x)

        bench = Interleaved(steps).run(repeat, warmup=1)
        st = ratio_stats(bench.times, "plain")
        rows.append([b, 1e3 * st["plain"]["median_s"], st["grad"]["ratio_mean"], st["direct"]["ratio_mean"],
                     st["grad"]["ratio_paired_median"], st["direct"]["ratio_paired_median"]])
        data.append({"B": b, **{k: v for k, v in st.items()}})
    md = (f"3x3 conv, M = S = {m}, {hw}x{hw}, block_size 10 (folds inside the timed steps), {repeat} interleaved rounds.\n\n"
          + md_table(["B", "plain step median (ms)", "grad mean / plain", "direct mean / plain",
                      "grad paired median", "direct paired median"], rows))
    return {"rows": data, "markdown": md}


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--batches", default="8,16,32,64,128,256,512")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    if args.tiny:
        bs, repeat, lin_m, conv_m, hw, step_bs = [4, 16], 2, 16, 8, 4, [4]
    else:
        bs, repeat, lin_m, conv_m, hw = [int(b) for b in args.batches.split(",")], args.repeat, 256, 64, 16
        step_bs = [b for b in bs if b in (8, 32, 128, 512)] or bs
    lin = transform_costs("linear", lin_m, lin_m, 1, bs, repeat)
    conv = transform_costs("conv", conv_m, conv_m, hw, bs, repeat)
    steps = layer_steps(conv_m, hw, step_bs, 2 if args.tiny else 10)
    text = "\n".join(["### Transform cost: grad vs direct", "", lin["markdown"], "", conv["markdown"], "",
                      "### Whole-layer training step vs nn.Conv2d", "", steps["markdown"]])
    print(text)
    write_json(args.json, {"linear": lin, "conv": conv, "layer_steps": steps, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
