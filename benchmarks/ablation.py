"""Where the grad method's step-time overhead goes (CIFAR ResNet-20, batch 128, 32x32, 100 classes).

Variants, interleaved with the plain model (ratios of the same run):

* ``grad``: the converted model as shipped (every block conv feeds a
  BatchNorm, so its centring is absorbed by it: no centring pass);
* ``grad, centred (pre-#12)``: ``convert_model(..., absorb_centring=False)``:
  each layer adds its centring term to the conv output in place (and reduces
  the output gradient for it in the backward), as before issue 12;
* ``grad, conv bias (pre-#6 centring)``: the centring term passed to each
  convolution as its bias (as before issue 6);
* ``grad, no statistics``: ``_accumulate`` and the block counting disabled
  (no per-batch ``sum x x^T``, no folds);
* ``grad, no Q``: the weight-gradient transform disabled;
* ``grad, neither``: both disabled -- what is left is the layers' Python
  overhead and their small per-forward tensor ops.

These are diagnostics, not usable layers. ``--threads 1`` gives timings that
the other processes of a shared machine disturb less (no thread barriers);
``--threads 1 --clock cpu`` times each step in this process's CPU time, which
a loaded machine disturbs least.

    python benchmarks/ablation.py [--threads 1] [--clock cpu]
    python benchmarks/ablation.py --tiny
"""
from __future__ import annotations

import argparse
import sys
import types
from typing import Dict

from _common import Interleaved, add_common_args, loadavg, md_table, ratio_stats, setup, write_json

import whitenlayers as wl
from _models import Variant, build_base, random_batches


def _no_stats(model) -> None:
    for m in model.modules():
        if isinstance(m, wl.WhiteningLayer):
            m.freeze()  # the public switch: no statistics, no block counting, the transform still applied


def _conv_bias(model) -> None:
    from layer_step import _ConvBias

    for m in model.modules():
        if isinstance(m, wl.GradWhitenConv2d):
            m.forward = types.MethodType(_ConvBias.forward, m)


def _no_q(model) -> None:
    for m in model.modules():
        if isinstance(m, wl.WhiteningLayer):
            m._weight_for_forward = (lambda mm: (lambda state: mm.weight))(m)


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    depth, batch, size, classes, width, rounds = (8, 8, 16, 10, 4, 10) if args.tiny else (20, 128, 32, 100, 16, args.rounds)
    base = build_base(depth, classes, width=width, seed=args.seed)
    batches = random_batches(2, batch, size, classes, seed=args.seed)
    vs = {"plain": Variant("plain", base, batches), "grad": Variant("grad", base, batches),
          "grad, centred (pre-#12)": Variant("grad:centred", base, batches)}
    for name, edits in (("grad, conv bias (pre-#6 centring)", [_conv_bias]), ("grad, no statistics", [_no_stats]),
                        ("grad, no Q", [_no_q]), ("grad, neither", [_no_stats, _no_q])):
        vs[name] = Variant("grad", base, batches)
        for e in edits:
            e(vs[name].model)
    for v in vs.values():
        v.step()
    bench = Interleaved({k: v.step for k, v in vs.items()}).run(rounds, warmup=2)
    st = ratio_stats(bench.times, "plain")
    rows = [[k, 1e3 * s["median_s"], s["ratio_median"], s["ratio_mean"], s["ratio_paired_median"]] for k, s in st.items()]
    text = (f"ResNet-{depth}, batch {batch}, torch threads {args.threads}, {args.clock} clock, {rounds} interleaved rounds; "
            f"load average at the end {loadavg()}.\n\n"
            + md_table(["variant", "median (ms)", "median / plain", "mean / plain", "paired median ratio"], rows))
    print(text)
    write_json(args.json, {"stats": st, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
