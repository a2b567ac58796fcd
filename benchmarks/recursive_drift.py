"""Recursive whitening across precision: a float32 layer against its float64 twin, fold by fold, and the fold's cost.

Part 1 -- ``RecursiveWhitenConv2d`` of 4, 16 and 64 channels fed the post-ReLU features of a random 3x3
convolution of spatially smooth random images (correlated channels), one batch per block (``accumulate``,
``fold``), 100 folds. Pairs: a float32 layer against a float64 twin fed the same float32 numbers, and a float64
layer whose first batch is multiplied by ``1 + 1e-13 z`` (``z`` standard normal, entry by entry) against the
unperturbed one. Entries: ``max |a - b| / max |b|`` of ``T`` (``whitening_matrix``), ``Q`` (``whitening_gram``),
``Q_s`` (``grad_transform``), ``Phi_y`` (``running_cov_whitened``), the rotation of ``T`` (its polar factor ``U``
of ``T = U (T^T T)^(1/2)``: what ``Q`` does not see) and the whitened spectrum (eigenvalues of ``T Phi_x T^T``,
which depend on ``Q`` alone); ``Q`` against ``T^T T`` of the first layer; the growth per fold of the difference
in ``Q_s`` (geometric mean up to 1e-3). Variants: the package's direction estimate (``coherence``: columns
weighted by ``c_m / c_m'``), the printed one (``printed``: divided by ``c_m``, eq. ``tve``), and each with the
fold computed in float64 (``+f64``: the rule's working dtype float64, the buffers float32 as registered).

Part 2 -- how far ``v_e`` moves for a relative change ``1e-9`` of ``Phi_y`` (``|dv| / 1e-9``, the worst of 4 random
symmetric changes), at the float64 layer's ``Phi_y`` every 10 folds: median and worst.

Part 3 -- a converted CIFAR ResNet-8 (recursive, width 8), bf16 autocast, SGD, ``block_size=10``: every whitening
layer against a float64 twin fed its inputs; the worst layer after ``--steps`` steps.

Part 4 -- the fold of all recursive layers of CIFAR ResNet-110 (``fold_layers``), variants interleaved.

    python benchmarks/recursive_drift.py --threads 1 --clock cpu   # about a minute
    python benchmarks/recursive_drift.py --tiny                    # seconds (CI)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys

import torch
from _common import Interleaved, add_common_args, md_table, setup, write_json
from fold_cost import _resnet110_layers

import whitenlayers as wl
import whitenlayers.functional.recursive as R
from whitenlayers.fold import fold_layers
from whitenlayers.rules import RecursiveRule

VARIANTS = ["coherence", "printed", "coherence+f64", "printed+f64"]
SHOWN = (1, 10, 20, 50, 100)


def printed_subspace(phi_y, *, c_rel, c_abs):
    """``principal_subspace_grouped`` with the printed weights ``1 / c_m`` (eq. ``tve``)."""
    k = phi_y.shape[-1]
    xi = torch.linalg.vector_norm(phi_y, dim=-2)
    mp = torch.argmax(xi, dim=-1, keepdim=True)
    c = (phi_y.transpose(-1, -2) @ torch.gather(phi_y, 2, mp.unsqueeze(-1).expand(-1, k, 1))).squeeze(-1)
    sel = c.abs() >= torch.clamp(torch.gather(xi, 1, mp) * c_rel * xi, min=c_abs)
    v = (phi_y @ torch.where(sel, c.reciprocal(), 0.0).unsqueeze(-1)).squeeze(-1)
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    e = (torch.arange(k) == mp).to(phi_y.dtype)
    return torch.where((norm > 0) & (norm < math.inf), v / norm, e)


@contextlib.contextmanager
def variant(name: str):
    """The package with ``name``'s direction estimate and working dtype (patched for the ``with`` block)."""
    real_ps, real_wd = R.principal_subspace_grouped, RecursiveRule.work_dtype
    if name.startswith("printed"):
        R.principal_subspace_grouped = printed_subspace
    if name.endswith("+f64"):
        RecursiveRule.work_dtype = lambda self, state_dtype: torch.float64
    try:
        yield
    finally:
        R.principal_subspace_grouped, RecursiveRule.work_dtype = real_ps, real_wd


def features(width: int, n: int, seed: int = 0):
    """``n`` float32 batches of post-ReLU features ``(16, width, 8, 8)`` with correlated channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, 3, 3, 3, generator=g, dtype=torch.float64) / 3
    b = 0.1 * torch.randn(width, generator=g, dtype=torch.float64)
    smooth = (3 * torch.nn.functional.avg_pool2d(torch.randn(16, 3, 8, 8, generator=g, dtype=torch.float64), 3, 1, 1)
              for _ in range(n))
    return [torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)).float() for x in smooth]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def polar(t):
    u, _, vh = torch.linalg.svd(t.double())
    return u @ vh


def compare(a, b):
    """The differences between layers ``a`` and ``b`` now (Part 1's entries)."""
    spectrum = [torch.linalg.eigvalsh(wl.functional.whitened_covariance(x.whitening_matrix.double(),
                                                                        x.running_cov.double())) for x in (a, b)]
    t = a.whitening_matrix.double()
    return {"T": rel(a.whitening_matrix, b.whitening_matrix), "Q": rel(a.whitening_gram, b.whitening_gram),
            "Q_s": rel(a.grad_transform, b.grad_transform),
            "Phi_y": rel(a.running_cov_whitened, b.running_cov_whitened),
            "rotation": rel(polar(a.whitening_matrix), polar(b.whitening_matrix)), "spectrum": rel(*spectrum),
            "Q vs T^T T": rel(a.whitening_gram, t.t() @ t)}


def drift(width: int, folds: int, var: str, pair: str):
    xs = features(width, folds)
    dt = torch.float32 if pair == "f32" else torch.float64
    a, b = (wl.RecursiveWhitenConv2d(width, width, 3, padding=1, dtype=d) for d in (dt, torch.float64))
    rows, phis = [], []
    noise = torch.randn(xs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with variant(var):
        for i, x in enumerate(xs):
            a.accumulate(x.double() * (1 + 1e-13 * noise) if pair == "pert" and i == 0 else x.to(dt))
            b.accumulate(x.double())
            a.fold()
            b.fold()
            rows.append(compare(a, b))
            if (i + 1) % 10 == 0:
                phis.append(b.running_cov_whitened.clone())
    qs = [r["Q_s"] for r in rows]
    end = next((i for i, q in enumerate(qs) if q > 1e-3), len(qs) - 1)
    growth = (max(qs[end], 1e-300) / max(qs[0], 1e-300)) ** (1 / max(end, 1))
    worst = {k: max(r[k] for r in rows) for k in rows[0]}
    return [width, var, "float32 vs float64" if pair == "f32" else "float64, 1e-13 vs none"] + \
        [qs[i - 1] for i in SHOWN if i <= folds] + list(worst.values()) + [growth], phis


def sensitivity(phis, var: str):
    g = torch.Generator().manual_seed(0)
    est = printed_subspace if var.startswith("printed") else R.principal_subspace_grouped
    out = []
    for phi in phis:
        v0 = est(phi[None], c_rel=0.025, c_abs=1e-6)
        worst = 0.0
        for _ in range(4):
            e = torch.randn(phi.shape, generator=g, dtype=phi.dtype)
            d = (e + e.t()) * (1e-9 * phi.abs().max() / (e + e.t()).abs().max())
            worst = max(worst, float((est((phi + d)[None], c_rel=0.025, c_abs=1e-6) - v0).norm()) / 1e-9)
        out.append(worst)
    return [statistics.median(out), max(out)]


def model_run(var: str, steps: int):
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=8), "recursive", block_size=10).train()
    layers = [m for m in model.modules() if isinstance(m, wl.WhiteningLayer)]
    twins = [wl.RecursiveWhitenConv2d(m.in_channels, m.in_channels, 1, dtype=torch.float64) for m in layers]
    for m, t in zip(layers, twins):
        m.register_forward_pre_hook(lambda _, args, t=t: t.accumulate(args[0].detach().double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data, labels = torch.randn(20, 16, 3, 16, 16, generator=g), torch.randint(0, 10, (20, 16), generator=g)
    with variant(var):
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(data[step % 20]).float(), labels[step % 20])
            loss.backward()
            opt.step()
            for m, t in zip(layers, twins):
                if int(m.num_blocks) > int(t.num_blocks):
                    t.fold()
    diffs = [compare(m, t) for m, t in zip(layers, twins)]
    return [var, len(layers), int(layers[0].num_blocks)] + \
        [max(d[k] for d in diffs) for k in ("T", "Q", "Q_s", "Phi_y", "rotation")]


def cost(repeat: int, tiny: bool):
    layers, states = _resnet110_layers("recursive", tiny)

    def fold(var):
        def run():
            for layer, s in zip(layers, states):
                layer.set_extra_state(s)  # refill the block: the same work in every variant
            with variant(var):
                fold_layers(layers)
        return run
    times = Interleaved({v: fold(v) for v in VARIANTS}).run(repeat, warmup=1).times
    base = times["printed"]
    return [[v, len(layers), 1e3 * statistics.median(times[v]),
             statistics.median([x / y for x, y in zip(times[v], base)])] for v in VARIANTS]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--folds", type=int, default=100)
    p.add_argument("--steps", type=int, default=1000, help="Part 3's training steps (block_size 10)")
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    widths, folds = ([16], 30) if args.tiny else ([4, 16, 64], args.folds)
    steps, repeat = (30, 2) if args.tiny else (args.steps, args.repeat)
    drift_rows, sens_rows = [], []
    for width in widths:
        for var in VARIANTS:
            for pair in (("f32", "pert") if "+f64" not in var else ("f32",)):
                row, phis = drift(width, folds, var, pair)
                drift_rows.append(row)
                if pair == "f32" and "+f64" not in var:
                    sens_rows.append([width, var] + sensitivity(phis, var))
    shown = [f"Q_s @{i}" for i in SHOWN if i <= folds]
    md = [f"### Part 1: recursive layers, {folds} folds (max relative differences)", "",
          md_table(["M", "estimate", "pair", *shown, "T", "Q", "Q_s", "Phi_y", "rotation of T", "whitened spectrum",
                    "Q vs T^T T", "growth / fold"], drift_rows, nd=1), "",
          "### Part 2: |dv_e| for a relative change 1e-9 of Phi_y (divided by 1e-9)", "",
          md_table(["M", "estimate", "median", "worst"], sens_rows, nd=1), "",
          f"### Part 3: converted ResNet-8 (recursive), bf16 autocast, {steps} steps; the worst layer against its "
          "float64 twin", "",
          md_table(["estimate", "layers", "folds", "T", "Q", "Q_s", "Phi_y", "rotation of T"],
                   [model_run(v, steps) for v in ("coherence", "printed")], nd=1), "",
          f"### Part 4: fold of all recursive layers of CIFAR ResNet-{8 if args.tiny else 110}, medians of {repeat} "
          "interleaved repetitions", "",
          md_table(["variant", "layers", "fold (ms)", "/ printed (paired median)"], cost(repeat, args.tiny))]
    text = "\n".join(md)
    print(text)
    write_json(args.json, {"markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
