"""One layer's training step: GradWhitenConv2d (and friends) vs nn.Conv2d, with a profile of the overhead.

A 3x3 convolution, ``C -> C`` channels, ``B x C x H x W`` input that requires
grad (as inside a network), bias-free (the ResNet case), SGD with momentum;
a step is ``zero_grad``, forward, ``(y**2).mean()``, backward, ``step``. The
whitening layers use the defaults (``block_size`` 10: folds inside the timed
steps; the timed rounds are a multiple of 10). Interleaved, medians, means,
paired ratios.

``grad (pre-#6 statistics)`` is the same layer with the statistics computed
as before the optimisation of issue 6 (one activation-sized shifted copy, then
one batched product), kept here as the before/after reference. ``grad, conv
bias (pre-#6 centring)`` passes the centring term ``-W mu`` to the convolution
as its bias, as the layer did before; the layer now adds it to the output in
place, because the CPU convolution backward's own bias gradient is slower than
autograd's reduction for that add.

    python benchmarks/layer_step.py                  # B=128, C=64, 32x32
    python benchmarks/layer_step.py --tiny
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict

from _common import Interleaved, add_common_args, sgd_layer_steps, md_table, ratio_stats, setup, write_json

import torch
from torch import nn

import whitenlayers as wl


class _BeforeStats(wl.GradWhitenConv2d):
    """Statistics as before issue 6: always the shifted product (an activation-sized shifted copy, then one
    batched product), never the sums about 0 that the layer now uses where its statistics allow."""

    def _accumulate(self, x):
        self._stats_unshifted = False
        super()._accumulate(x)


class _ConvBias(wl.GradWhitenConv2d):
    """The centring term passed to the convolution as its bias, as the grad layer did before issue 6."""

    def forward(self, x):
        training, state = self._forward_state()
        if training:
            self._accumulate(x)
        w = self._weight_for_forward(state)
        out = self._conv_forward(x, w, self._effective_bias(w, state))
        if training:
            self._end_batch()
        return out


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    b, c, hw, rounds = (8, 8, 8, 10) if args.tiny else (args.batch, args.channels, args.size, args.rounds)
    x = torch.randn(b, c, hw, hw).relu_().requires_grad_(True)

    def conv():
        torch.manual_seed(args.seed)
        return nn.Conv2d(c, c, 3, padding=1, bias=False)

    mods = {
        "plain": conv(),
        "grad": wl.GradWhitenConv2d.from_conv(conv()),
        "recursive": wl.RecursiveWhitenConv2d.from_conv(conv()),
        "direct": nn.Sequential(wl.DirectWhiten(c), conv()),
        "grad (pre-#6 statistics)": _BeforeStats.from_conv(conv()),
        "grad, conv bias (pre-#6 centring)": _ConvBias.from_conv(conv()),
    }
    steps = sgd_layer_steps(mods, x)

    for step in steps.values():
        step()
    bench = Interleaved(steps).run(rounds, warmup=2)
    st = ratio_stats(bench.times, "plain")
    rows = [[k, 1e3 * s["median_s"], 1e3 * s["mean_s"], s["ratio_median"], s["ratio_mean"], s["ratio_paired_median"]]
            for k, s in st.items()]
    text = (f"3x3 conv {c} -> {c}, input {b}x{c}x{hw}x{hw} (requires grad), bias-free, SGD momentum; "
            f"{rounds} interleaved rounds after 2 warm-up rounds.\n\n"
            + md_table(["layer", "median (ms)", "mean (ms)", "median / plain", "mean / plain", "paired median ratio"], rows))
    print(text)
    write_json(args.json, {"stats": st, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
