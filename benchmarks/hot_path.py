#!/usr/bin/env python
"""The hot path: ATen ops per training step and per whitening layer, host synchronisations, step-time ratios.

On a GPU every ATen op is at least one kernel launch (several microseconds of host time), so for small models in
eager mode the op count, not the arithmetic, sets the step time. This script counts, with a
``TorchDispatchMode``, every non-view ATen op of whole blocks of SGD training steps (forward, loss, backward,
optimizer step and the folds), after one warm-up block, and reports per model and variant:

* ops per training step, and the extra ops per whitening layer: ``(variant - plain) / layers``;
* host synchronisations: ``_local_scalar_dense`` calls (the op behind ``.item()`` / ``bool(tensor)``) and
  ``Tensor.tolist()`` calls (a device-to-host copy on CUDA, no ATen op on the CPU, so counted by a patch)
  per step, inside and outside the folds (the CPU-only accuracy check of the unshifted product is one; on CUDA
  that path is never taken);
* view ops (no kernel, but a dispatch each: host time on a GPU) per whitening layer: inside the folds per step
  (a fold's per-layer indexing shows here) and on the median step that does not fold (the hot path's slicing);
* the largest op groups per whitening layer (what a regression shows first);
* step-time ratios against the plain model, interleaved round by round in one process (``--timing-depths``).

Variants: each method with its defaults, and with statistics on a schedule (``:every5``: ``stats_every=5``, the
first of every 5 training forwards of a block gathers statistics).

Models: a CIFAR ResNet-20 (32x32, batch 8) and torchvision's ResNet-50 layout (``benchmarks/_resnet50.py``, no
torchvision needed; 32x32, batch 2, 10 classes; op counts do not depend on the image size except where the CPU picks the unshifted
product for inputs of at least ``functional._CPU_UNSHIFTED_MIN_ELEMENTS`` values).

    python benchmarks/hot_path.py                       # counts for ResNet-20 and ResNet-50, timing ResNet-20, -110
    python benchmarks/hot_path.py --tiny --json out.json  # seconds (CI): counts of a narrow ResNet-8, blocks of 2
"""
# ruff: noqa: E501  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
from typing import Dict, List, Optional, Tuple

import _common  # noqa: F401  (puts the repository on sys.path)
import torch
import torch.nn.functional as F
from _common import (
    Interleaved,
    add_common_args,
    command_line,
    loadavg,
    machine_description,
    md_table,
    ratio_stats,
    setup,
    write_json,
)
from _models import Variant, build_base, random_batches
from _resnet50 import resnet50
from torch.utils._python_dispatch import TorchDispatchMode

import whitenlayers as wl
import whitenlayers.coordinator as wl_fold  # the coordinator's fold_layers: the one a model's forward calls
import whitenlayers.functional as F_w

#: variant name -> (method, layer keyword arguments beyond the defaults)
#: Count the statistics' two-op path, the one CUDA takes (``functional.fused_moments``); ``--cpu-path``: the CPU's.
FUSED = [True]

VARIANTS: Dict[str, Tuple[str, Dict[str, object]]] = {
    "plain": ("plain", {}),
    "grad": ("grad", {}),
    "recursive": ("recursive", {}),
    "direct": ("direct", {}),
    "grad:every5": ("grad", {"stats_every": 5}),
    "recursive:every5": ("recursive", {"stats_every": 5}),
    "direct:every5": ("direct", {"stats_every": 5}),
}


#: Multi-tensor ops that torch implements as a composite (a loop of one op per tensor, no fused kernel, on CUDA
#: too): counted once per tensor, as the kernels they launch.
PER_TENSOR_OPS = ("_foreach_clone",)


class OpCounter(TorchDispatchMode):
    """Counts non-view ATen ops by name, separately inside and outside the folds (a composite multi-tensor op,
    :data:`PER_TENSOR_OPS`, once per tensor of its list), and view ops apart (:attr:`views`: no kernel, but a
    dispatch of host time each)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"step": collections.Counter(), "fold": collections.Counter()}
        self.views = {"step": 0, "fold": 0}
        self.phase = "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views[self.phase] += 1
        else:
            per_tensor = func.overloadpacket.__name__ in PER_TENSOR_OPS
            self.counts[self.phase][func.__name__] += len(args[0]) if per_tensor else 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        real = self._real_tolist = torch.Tensor.tolist

        def tolist(t, *args, **kwargs):
            self.counts[self.phase][TOLIST] += 1
            return real(t, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._real_tolist
        return super().__exit__(*exc)


#: The counter's name for ``Tensor.tolist()`` calls (host synchronisations without an ATen op on the CPU).
TOLIST = "Tensor.tolist (host sync)"
#: What counts as a host synchronisation.
SYNCS = ("_local_scalar_dense.default", TOLIST)


def _folding(counter: OpCounter):
    """Patch the fold entry point so that its ops are counted apart; returns the undo function."""
    real = wl_fold.fold_layers

    def counted(*args, **kwargs):
        before, counter.phase = counter.phase, "fold"
        try:
            return real(*args, **kwargs)
        finally:
            counter.phase = before

    wl_fold.fold_layers = counted
    return lambda: setattr(wl_fold, "fold_layers", real)


def build(model: str, seed: int = 0) -> Tuple[torch.nn.Module, List[Tuple[torch.Tensor, torch.Tensor]]]:
    if model == "resnet8":  # --tiny
        return build_base(8, 10, width=4, seed=seed), random_batches(4, 8, 16, 10, seed=seed)
    if model == "resnet20":
        return build_base(20, 10, seed=seed), random_batches(4, 8, 32, 10, seed=seed)
    if model == "resnet50":
        torch.manual_seed(seed)
        return resnet50(num_classes=10), random_batches(4, 2, 32, 10, seed=seed)
    raise ValueError(f"model must be resnet8, resnet20 or resnet50, but got {model!r}")


def count_variant(model: str, name: str, blocks: int = 1, block_size: int = 10) -> Dict[str, object]:
    """Op counts of ``blocks`` whole blocks of training steps of ``name`` on ``model`` (one warm-up block first)."""
    method, kw = VARIANTS[name]
    base, batches = build(model)
    net = copy.deepcopy(base)
    if method != "plain":
        wl.convert_model(net, method, block_size=block_size, **kw)
    layers = len(wl.whitening_layers(net))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    for i in range(block_size):  # warm-up block: momentum buffers, first fold
        step(i)
    counter = OpCounter()
    undo = _folding(counter)
    per_step = []  # non-view ops of each step outside its fold
    per_step_views = []  # and its view ops
    try:
        with counter, F_w.fused_moments(FUSED[0]):
            for i in range(blocks * block_size):
                before = sum(v for k, v in counter.counts["step"].items() if k != TOLIST)
                views = counter.views["step"]
                step(i)
                per_step.append(sum(v for k, v in counter.counts["step"].items() if k != TOLIST) - before)
                per_step_views.append(counter.views["step"] - views)
    finally:
        undo()
    steps = blocks * block_size
    total = {k: sum(v for name, v in c.items() if name != TOLIST) / steps for k, c in counter.counts.items()}
    syncs = {k: sum(c[name] for name in SYNCS) / steps for k, c in counter.counts.items()}
    return {"model": model, "variant": name, "layers": layers, "steps": steps,
            "ops_per_step": total["step"] + total["fold"], "fold_ops_per_step": total["fold"],
            "fold_views_per_step": counter.views["fold"] / steps,
            "median_nonfold_step_ops": statistics.median(per_step),
            "median_nonfold_step_views": statistics.median(per_step_views),
            "syncs_per_step": syncs["step"], "fold_syncs_per_step": syncs["fold"],
            "by_op": {k: (counter.counts["step"][k] + counter.counts["fold"][k]) / steps
                      for k in set(counter.counts["step"]) | set(counter.counts["fold"])}}


def count_table(models: List[str], names: List[str], block_size: int = 10) -> Tuple[List[Dict[str, object]], str, str]:
    rows, groups = [], []
    for model in models:
        plain = count_variant(model, "plain", block_size=block_size)
        for name in names:
            r = plain if name == "plain" else count_variant(model, name, block_size=block_size)
            n = r["layers"]
            r["extra_per_layer"] = (r["ops_per_step"] - plain["ops_per_step"]) / n if n else 0.0
            r["extra_per_layer_nonfold"] = ((r["median_nonfold_step_ops"] - plain["median_nonfold_step_ops"]) / n
                                            if n else 0.0)
            r["extra_views_per_layer_nonfold"] = ((r["median_nonfold_step_views"]
                                                   - plain["median_nonfold_step_views"]) / n if n else 0.0)
            rows.append(r)
            if n:
                diff = {k: (v - plain["by_op"].get(k, 0.0)) / n for k, v in r["by_op"].items()}
                top = sorted(((k, v) for k, v in diff.items() if v > 0.05), key=lambda t: -t[1])[:8]
                groups.append([model, name, ", ".join(f"{k.split('.')[0]} {v:.1f}" for k, v in top)])
    table = md_table(["model", "variant", "whitening layers", "ops per step", "extra ops per layer",
                      "of which fold, per layer", "extra ops per layer, median step that does not fold",
                      "host syncs per step (outside folds)", "host syncs in folds",
                      "view ops in folds, per layer and step", "extra view ops per layer, median step that does not fold"],
                     [[r["model"], r["variant"], r["layers"], r["ops_per_step"], r["extra_per_layer"],
                       (r["fold_ops_per_step"] / r["layers"]) if r["layers"] else 0.0, r["extra_per_layer_nonfold"],
                       r["syncs_per_step"], r["fold_syncs_per_step"],
                       (r["fold_views_per_step"] / r["layers"]) if r["layers"] else 0.0,
                       r["extra_views_per_layer_nonfold"]] for r in rows], nd=1)
    return rows, table, md_table(["model", "variant", "largest extra op groups per layer and step"], groups)


def timing_table(depths: List[int], names: List[str], rounds: int, warmup: int, batch: int = 128
                 ) -> Tuple[Dict[str, object], str]:
    out, table_rows = {}, []
    for depth in depths:
        base = build_base(depth, 10)
        batches = random_batches(4, batch, 32, 10)
        variants = {}
        for name in names:
            method, kw = VARIANTS[name]
            v = Variant(method, base, batches) if not kw else _variant_with(method, base, batches, kw)
            variants[name] = v
        runner = Interleaved({k: v.step for k, v in variants.items()}).run(rounds, warmup, progress=f"resnet{depth}")
        stats = ratio_stats(runner.times, "plain")
        out[f"resnet{depth}"] = stats
        for name in names:
            s = stats[name]
            table_rows.append([f"resnet{depth}", name, s["median_s"] * 1e3, s["ratio_median"], s["ratio_mean"],
                               s["ratio_paired_median"]])
    return out, md_table(["model", "variant", "median step (ms)", "ratio of medians", "ratio of means",
                          "median paired ratio"], table_rows)


def _variant_with(method: str, base, batches, kw: Dict[str, object]) -> Variant:
    v = Variant("plain", base, batches)  # a plain copy, converted here with the variant's keywords
    v.name = method
    wl.convert_model(v.model, method, **kw)
    v.opt = torch.optim.SGD(v.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return v


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--models", default="resnet20,resnet50", help="models whose ops are counted")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--timing-depths", default="20,110", help="CIFAR ResNet depths timed ('' for none)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=128, help="batch of the timed steps (32x32 inputs)")
    p.add_argument("--cpu-path", action="store_true",
                   help="count the statistics' CPU path (five ops) instead of the two-op path CUDA takes")
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    FUSED[0] = not args.cpu_path
    names = [n for n in args.variants.split(",") if n]
    if "plain" not in names:
        names.insert(0, "plain")
    models = ["resnet8"] if args.tiny else [m for m in args.models.split(",") if m]
    depths = [] if args.tiny else [int(d) for d in args.timing_depths.split(",") if d]
    machine = machine_description()
    rows, counts_md, groups_md = count_table(models, names, block_size=2 if args.tiny else 10)
    timings, timing_md = ({}, "") if not depths else timing_table(depths, names, args.rounds, warmup=2,
                                                                  batch=args.batch)
    md = "\n\n".join(x for x in [
        f"Command: `{command_line()}`; {machine['cpu']}; torch {machine['torch']}; commit {machine['commit']}; "
        f"load before/after {machine['loadavg']} / {loadavg()}",
        f"Non-view ATen ops per SGD training step (whole blocks of {2 if args.tiny else 10} steps, folds included; the statistics' "
        f"{'CPU path' if args.cpu_path else 'two-op path, as on CUDA'}):", counts_md,
        groups_md, (f"Step time vs plain (batch {args.batch}, 32x32, interleaved, {args.rounds} rounds, "
                    f"{args.threads} threads, {args.clock} clock):\n\n{timing_md}") if timing_md else ""] if x)
    print(md)
    payload = {"machine": machine, "counts": rows, "timings": timings, "markdown": md}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
