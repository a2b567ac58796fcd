"""Cost of a fold: EVD vs recursive transform, and a whole-model fold of ResNet-110.

Part 1 -- one fold of one layer, ``M = 64 ... 1024`` input features. A fold is
``WhiteningLayer._fold`` on a prepared block summary: the moment
recursion (eqs. ``vmuxi``/``vPhixi``), the new transform (EVD: ``eigh``, gains,
``T`` and ``Q``; recursive: tracking ``Phi_y = alpha Phi_y + (1-alpha) T C T^T``
and the rank-one step of section 4), the ``Q_s`` smoothing and the bias
compensation. EVD and recursive folds are interleaved; the table gives
medians, their ratio and the transform alone (``functional.evd_transform``
vs ``functional.recursive_step``, which is the ``O(M^2)`` part the paper
counts). Growth exponents are least-squares slopes of log(time) on log(M).

Part 3 -- ``gains="damped"`` against ``"practical"`` (grad): a step dominated by its fold (one layer,
``M = 768``, ``block_size=1``) and the whole fold of the ResNet-50 layout, interleaved (``--parts gains``).

Part 2 -- the fold of all 108 whitening layers of CIFAR ResNet-110 (widths
16/32/64), as ``fold_layers`` does it at the end of a block: each EVD layer
folded on its own (``fold_layers([layer])`` per layer) vs all together
(``fold_layers(layers)``, which groups the EVD layers by width and calls
``torch.linalg.eigh`` once per group), and the raw ``eigh`` calls alone.

    python benchmarks/fold_cost.py            # full (about a minute)
    python benchmarks/fold_cost.py --tiny     # seconds (CI)
"""
# ruff: noqa: B023, E501, E741  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List

import torch
from _common import Interleaved, add_common_args, kwargs_for, loglog_slope, md_table, ratio_stats, setup, write_json

import whitenlayers as wl
from whitenlayers import functional as F
from whitenlayers.fold import fold_layers


def _layer(cls, m: int, gen: torch.Generator, **kw):
    """A layer with one folded block behind it and a prepared summary of the next block."""
    layer = cls(m, m, bias=False, **kw)
    mix = torch.randn(m, m, generator=gen) / m**0.5
    for _ in range(2):
        z = torch.randn(4 * m, m, generator=gen)
        layer.accumulate(torch.relu(z @ mix + 0.1 * z))
        layer.fold()
    z = torch.randn(4 * m, m, generator=gen)
    layer.accumulate(torch.relu(z @ mix + 0.1 * z))
    return layer, layer.block_statistics()


def one_fold(sizes: List[int], repeat: int, gen: torch.Generator) -> Dict[str, object]:
    rows, per_m = [], []
    for m in sizes:
        evd, s_evd = _layer(wl.GradWhitenLinear, m, gen, **kwargs_for("grad"))
        rec, s_rec = _layer(wl.RecursiveWhitenLinear, m, gen, **kwargs_for("recursive"))
        cov = evd.running_cov.clone()
        t_prev = rec.whitening_matrix.double()
        q_prev = rec.whitening_gram.double()
        phi_y = rec.running_cov_whitened.double()
        power = rec.running_power.double().mean()
        kw = dict(gamma=rec.gamma, delta=rec.delta, eps=rec.eps, c_rel=rec.c_rel, c_abs=rec.c_abs)
        bench = Interleaved({
            "evd_fold": lambda: evd.fold(s_evd),
            "rec_fold": lambda: rec.fold(s_rec),
            "evd_transform": lambda: F.evd_transform(cov, eps=1e-5, gmax=10.0),
            "rec_step": lambda: F.recursive_step(t_prev, q_prev, phi_y, power, **kw),
        })
        bench.run(repeat, warmup=1)
        med = {k: statistics.median(v) for k, v in bench.times.items()}
        paired = statistics.median([r / e for r, e in zip(bench.times["rec_fold"], bench.times["evd_fold"])])
        per_m.append({"M": m, **{k + "_ms": 1e3 * v for k, v in med.items()}, "ratio_fold": paired,
                      "ratio_transform": med["rec_step"] / med["evd_transform"]})
        rows.append([m, 1e3 * med["evd_fold"], 1e3 * med["rec_fold"], paired,
                     1e3 * med["evd_transform"], 1e3 * med["rec_step"], med["rec_step"] / med["evd_transform"]])
    fit = [r for r in per_m if r["M"] >= 128]
    fit = fit if len(fit) >= 2 else per_m
    exps = {k: loglog_slope([r["M"] for r in fit], [r[k + "_ms"] for r in fit])
            for k in ("evd_fold", "rec_fold", "evd_transform", "rec_step")}
    table = md_table(
        ["M", "EVD fold (ms)", "recursive fold (ms)", "recursive / EVD (paired median)",
         "evd_transform (ms)", "recursive_step (ms)", "step / evd_transform"],
        rows,
    )
    fit_ms = ", ".join(str(r["M"]) for r in fit)
    table += (f"\n\nGrowth exponents (slope of log time on log M, M = {fit_ms}): EVD fold {exps['evd_fold']:.2f}, "
              f"recursive fold {exps['rec_fold']:.2f}, evd_transform {exps['evd_transform']:.2f}, "
              f"recursive_step {exps['rec_step']:.2f}.")
    return {"rows": per_m, "exponents": exps, "markdown": table}


def _resnet110_layers(method: str, tiny: bool):
    """The whitening layers of a converted CIFAR ResNet-110 (or ResNet-8 when tiny), with a filled block."""
    depth = 8 if tiny else 110
    model = wl.convert_model(wl.models.cifar_resnet(depth, num_classes=100), method,
                             **{**kwargs_for(method), "block_size": 10**6})
    layers = [m for m in model.modules() if isinstance(m, wl.WhiteningLayer)]
    model.train()
    for _ in range(2):  # two blocks, so the second fold is a regular (non-first) fold
        with torch.no_grad():
            model(torch.randn(8, 3, 32, 32))
        fold_layers(layers)
    with torch.no_grad():
        model(torch.randn(8, 3, 32, 32))
    return layers, [layer.get_extra_state() for layer in layers]


def whole_model(repeat: int, tiny: bool) -> Dict[str, object]:
    out = {}
    evd_layers, evd_state = _resnet110_layers("grad", tiny)
    rec_layers, rec_state = _resnet110_layers("recursive", tiny)

    def restore(layers, states):
        for layer, s in zip(layers, states):
            layer.set_extra_state(s)

    def timed(layers, states, fn):
        def step():
            restore(layers, states)  # refill the block (not timed: the fold resets it)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return step

    def per_layer(layers):
        for layer in layers:
            fold_layers([layer])

    widths: Dict[int, int] = {}
    for layer in evd_layers:
        widths[layer.num_features] = widths.get(layer.num_features, 0) + 1
    covs = {m: torch.stack([l.running_cov for l in evd_layers if l.num_features == m]) for m in widths}

    def eigh_per_layer():
        for c in covs.values():
            for i in range(c.shape[0]):
                torch.linalg.eigh(c[i])

    def eigh_batched():
        for c in covs.values():
            torch.linalg.eigh(c)

    steps = {
        "evd_per_layer": timed(evd_layers, evd_state, lambda: per_layer(evd_layers)),
        "evd_fold_layers": timed(evd_layers, evd_state, lambda: fold_layers(evd_layers)),
        "rec_fold_layers": timed(rec_layers, rec_state, lambda: fold_layers(rec_layers)),
        "eigh_per_layer": lambda: _t(eigh_per_layer),
        "eigh_batched": lambda: _t(eigh_batched),
    }
    times: Dict[str, List[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(repeat + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            dt = steps[name]()
            if r:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median([b / p for b, p in zip(times["evd_fold_layers"], times["evd_per_layer"])])
    rows = [
        ["EVD, per layer (fold_layers([layer]) x %d)" % len(evd_layers), 1e3 * med["evd_per_layer"], 1.0],
        ["EVD, fold_layers(all): eigh batched by width", 1e3 * med["evd_fold_layers"], paired],
        ["recursive, fold_layers(all)", 1e3 * med["rec_fold_layers"], med["rec_fold_layers"] / med["evd_per_layer"]],
        ["raw torch.linalg.eigh, one call per layer", 1e3 * med["eigh_per_layer"], med["eigh_per_layer"] / med["evd_per_layer"]],
        ["raw torch.linalg.eigh, one call per width", 1e3 * med["eigh_batched"], med["eigh_batched"] / med["evd_per_layer"]],
    ]
    wtxt = ", ".join(f"{n} x M={m}" for m, n in sorted(widths.items()))
    out["markdown"] = (f"{len(evd_layers)} layers ({wtxt}); medians of {repeat} interleaved repetitions.\n\n"
                       + md_table(["whole-model fold", "median (ms)", "vs EVD per layer"], rows))
    out["median_ms"] = {k: 1e3 * v for k, v in med.items()}
    out["batched_vs_per_layer_paired"] = paired
    out["layers"] = len(evd_layers)
    return out


def gains(repeat: int, tiny: bool) -> Dict[str, object]:
    """Part 3: ``gains="damped"`` (a Cholesky factorisation) against ``"practical"`` (``eigh``), grad, interleaved:
    (a) a training step dominated by its fold: one ``GradWhitenLinear`` with ``M = 768`` inputs and outputs,
    ``block_size=1`` (every step folds), batch 256, forward and backward; (b) the whole fold of the
    ResNet-50 layout (``_resnet50.py``: 52 layers, ``M`` up to 2048), as ``fold_layers`` runs it at a block's end."""
    from _resnet50 import resnet50

    m, batch = (16, 8) if tiny else (768, 256)
    gen = torch.Generator().manual_seed(1)
    x = torch.relu(torch.randn(batch, m, generator=gen) @ (torch.randn(m, m, generator=gen) / m**0.5))
    steps: Dict[str, object] = {}
    for g in ("practical", "damped"):
        layer = wl.GradWhitenLinear(m, m, bias=False, **{**kwargs_for("grad"), "gains": g, "block_size": 1})

        def step(layer=layer):
            layer(x).square().mean().backward()  # the block of one forward folds in it (block_size=1)
        for _ in range(2):
            step()
        steps[f"step {g}"] = step
    for g in ("practical", "damped"):
        base = wl.models.cifar_resnet(8, width=4) if tiny else resnet50(num_classes=10)
        model = wl.convert_model(base, "grad", **{**kwargs_for("grad"), "gains": g, "block_size": 10**6}).train()
        layers = [l for l in model.modules() if isinstance(l, wl.WhiteningLayer)]
        for r in range(3):  # two folds behind (the second a regular one), a block filled
            with torch.no_grad():
                model(torch.randn(2 if tiny else 8, 3, 32 if tiny else 64, 32 if tiny else 64, generator=gen))
            if r < 2:
                fold_layers(layers)
        states = [l.get_extra_state() for l in layers]

        def fold(layers=layers, states=states):
            for layer, st in zip(layers, states):
                layer.set_extra_state(st)  # refill the block (its cost is the same in both variants)
            fold_layers(layers)
        steps[f"fold {g}"] = fold
    times = Interleaved(steps).run(repeat, warmup=1).times
    rows = []
    for what, label in (("step", f"step of one layer, M = {m}, block_size=1 (forward and backward, folding)"),
                        ("fold", f"whole fold, {'CIFAR ResNet-8' if tiny else 'ResNet-50 layout'} ({len(layers)} layers)")):
        st = ratio_stats({g: times[f"{what} {g}"] for g in ("practical", "damped")}, "practical")
        rows.append([label, 1e3 * st["practical"]["median_s"], 1e3 * st["damped"]["median_s"],
                     st["damped"]["ratio_median"], st["damped"]["ratio_paired_median"]])
    md = (f"grad, medians of {repeat} interleaved repetitions (each includes refilling the block from a saved "
          "state: the same work in both variants).\n\n"
          + md_table(["scenario", "practical (ms)", "damped (ms)", "damped / practical (medians)",
                      "damped / practical (paired median)"], rows))
    return {"rows": rows, "markdown": md}


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--sizes", default="64,128,256,512,1024")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--parts", default="one,model,gains",
                   help="which parts to run: one (one layer, EVD vs recursive), model (ResNet-110's whole fold), "
                        "gains (damped vs practical gains: a fold-bound step, the ResNet-50 layout's fold)")
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock, args.layer_kwargs)
    gen = torch.Generator().manual_seed(args.seed)
    sizes = [8, 16] if args.tiny else [int(s) for s in args.sizes.split(",")]
    repeat = 2 if args.tiny else args.repeat
    parts = set(args.parts.split(","))
    md, out = [], {}
    if "one" in parts:
        out["one_fold"] = one_fold(sizes, repeat, gen)
        md += ["### One fold of one layer: EVD vs recursive", "",
               f"Medians of {repeat} interleaved repetitions; float32 statistics (the layers' default).", "",
               out["one_fold"]["markdown"], ""]
    if "model" in parts:
        out["whole_model"] = whole_model(2 if args.tiny else max(repeat, 7), args.tiny)
        md += ["### Whole-model fold: CIFAR ResNet-110", "", out["whole_model"]["markdown"], ""]
    if "gains" in parts:
        out["gains"] = gains(repeat, args.tiny)
        md += ["### Damped against practical gains", "", out["gains"]["markdown"], ""]
    text = "\n".join(md).rstrip()
    print(text)
    write_json(args.json, {**out, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
