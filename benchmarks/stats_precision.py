"""Accuracy of the statistics of bf16 activations summed about a shift (issue 30): mu, Phi_x and T per path.

A layer's block statistics are sums of its batch about a shift (the mean in force, or the first batch's mean) in
float32. For a bf16 batch there are three ways to the products, compared here against float64 sums of the same bf16
numbers about the same shift, on real activations (MNIST digits through a CIFAR ResNet-20 under bf16 autocast,
channels_last, training-mode BatchNorm; every conv's input, a block of 4 batches of 64):

- **float32** (eager layers' path for a shifted batch): the batch converted to float32, shifted, the float32
  product (on CUDA's SIMT cores: ~5x the tensor-core path's time for ResNet-50's layers on an H100);
- **split** (a compiled layer's path, ``functional.accumulate_moments_split``): the float32 differences split in two
  bf16 numbers each, two bf16 products with float32 output (tensor cores);
- **bf16 once** (rejected): the shift rounded to bf16 and ``x - shift`` rounded to bf16 once, one bf16 product.

Relative Frobenius errors of ``mu``, ``Phi_x`` (the block covariance) and ``T`` (the EVD rule's ZCA transform of
``Phi_x``, default ``eps`` / ``gmax``), max and median over the layers. Kernel times are the GPU's to measure
(``benchmarks/gpu_probe.py --only stats``).

    python benchmarks/stats_precision.py           # a minute on a CPU
    python benchmarks/stats_precision.py --tiny    # CI: seconds, random images
"""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List

from _common import md_table, setup, write_json

import torch

import whitenlayers as wl

F = wl.functional


def activations(tiny: bool) -> List[List[torch.Tensor]]:
    """Each conv's bf16 inputs (4 batches), captured by forward pre-hooks."""
    if tiny:
        images = torch.rand(32, 1, 12, 12)
    else:
        from whitenlayers.experiment.data import load_mnist5k
        train = load_mnist5k().train
        images = (train.images[:256].float() / 255.0 - train.mean[0]) / train.std[0]
    torch.manual_seed(0)
    model = wl.models.cifar_resnet(depth=8 if tiny else 20, num_classes=10, in_channels=1,
                                   width=4 if tiny else 16).to(memory_format=torch.channels_last).train()
    seen: Dict[str, List[torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Conv2d):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name, []).append(args[0].detach().to(torch.bfloat16))))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in images.split(images.shape[0] // 4):
            model(batch.contiguous(memory_format=torch.channels_last))
    for h in hooks:
        h.remove()
    return list(seen.values())


def reference(batches: List[torch.Tensor], shift: torch.Tensor):
    """float64 sums of the same bf16 numbers about ``shift``: count, s1, s2."""
    rows = torch.cat([b.permute(0, 2, 3, 1).reshape(-1, b.shape[1]) for b in batches]).double() - shift.double()
    return rows.shape[0], rows.sum(0), rows.t() @ rows


def stats_of(n, s1, s2, shift):
    mu = shift.double() + s1.double() / n
    cov = s2.double() / n - torch.outer(s1.double() / n, s1.double() / n)
    cfg = wl.EVDConfig()
    out = F.evd_transform(F.symmetrize(cov), eps=cfg.eps, gmax=cfg.gmax, gains=cfg.gains)
    assert out is not None
    return mu, cov, out[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def run(tiny: bool) -> List[List[object]]:
    errors: Dict[str, List[List[float]]] = {"float32": [], "split": [], "bf16 once (rejected)": []}
    ratio = []
    for batches in activations(tiny):
        m = batches[0].shape[1]
        shift32 = batches[0].float().mean((0, 2, 3))  # a block's first shift: its first batch's mean
        shift_bf16 = shift32.to(torch.bfloat16)
        want = {}
        for key, k in (("32", shift32), ("bf16", shift_bf16)):
            n, s1, s2 = reference(batches, k)
            want[key] = stats_of(n, s1, s2, k)
        mean, cov = want["32"][0], want["32"][1]
        ratio.append(float((mean.square() / cov.diagonal().clamp_min(1e-30)).max()))
        with F.fused_moments(True):
            for name in errors:
                acc = F.moments_accumulator(m)
                for b in batches:
                    if name == "float32":
                        F.accumulate_moments(acc, b, shift32.view(1, m, 1, 1))
                    elif name == "split":
                        F.accumulate_moments_split(acc, b, shift32.view(1, m, 1, 1))
                    else:
                        F.accumulate_moments(acc, b - shift_bf16.view(1, m, 1, 1), None)
                n = sum(b.numel() // m for b in batches)
                k = shift_bf16 if name.startswith("bf16") else shift32
                got = stats_of(n, acc[:m, m], acc[:m, :m], k)
                ref = want["bf16" if name.startswith("bf16") else "32"]
                errors[name].append([rel(g, r) for g, r in zip(got, ref)])
    rows: List[List[object]] = []
    for name, errs in errors.items():
        row: List[object] = [name]
        for j in range(3):
            col = [e[j] for e in errs]
            row += [f"{max(col):.1e}", f"{statistics.median(col):.1e}"]
        rows.append(row)
    print(f"{len(ratio)} layers; max mean^2/var per layer: median {statistics.median(ratio):.2f}, "
          f"max {max(ratio):.2f}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="random images, a small model: seconds (CI)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the table here")
    args = p.parse_args()
    setup(args.threads, 0)
    table = md_table(["path", "mu max", "mu median", "Phi_x max", "Phi_x median", "T max", "T median"],
                     run(args.tiny))
    print(f"\nrelative error against float64 sums of the same bf16 numbers\n\n{table}")
    write_json(args.json, {"markdown": table})


if __name__ == "__main__":
    main()
