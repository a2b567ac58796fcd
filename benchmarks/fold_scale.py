"""Folds at scale (issue 13): the fold of a whole ResNet-50 and of ResNet-110, per step and per rank.

Part 1 -- one fold of all 52 whitening layers of a ResNet-50 (input widths 64 ... 2048, the torchvision
layout: 16 bottlenecks of three convolutions plus four downsample convolutions), EVD (batched by width:
``fold_layers(layers)``; looped: ``fold_layers([layer])`` per layer) and recursive, each on a prepared
block, single process. Then a plain ResNet-50 training step (SGD, batch ``--batch`` at 224x224; the
per-step fold overhead is ``fold / (block_size * step)``, printed for block sizes 1 ... 50).

Part 2 -- the same for CIFAR ResNet-110 (108 layers, widths 16/32/64) against its plain step at batch 128,
32x32: the goal is a fold overhead <= 1 % at the default block size (10).

Part 3 -- distributed folds of the ResNet-50 layers (and the ResNet-110 layers) on 2 and 4 ``gloo`` ranks
with one thread each, ``strategy="replicated"`` (every rank computes every transform) vs ``"owner"`` (each
layer folded on one rank: its scatter reduced to that rank, its new buffers broadcast from it). Per rank:
wall time of the fold and the process CPU time spent in it (the work the rank did, gloo's threads
included). On a machine with fewer cores than ranks the wall time of
concurrent ranks is inflated by sharing cores, so the CPU time is the per-rank cost to project from.

    python benchmarks/fold_scale.py             # full (~10 min on 2 cores)
    python benchmarks/fold_scale.py --tiny      # seconds (CI)
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import Dict, List

from _common import add_common_args, loadavg, machine_description, md_table, setup, write_json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import whitenlayers as wl
from _resnet50 import resnet50
from whitenlayers.fold import assign_owners, fold_layers

BLOCK_SIZES = (1, 2, 5, 10, 20, 50)
#: The single-process timer: wall clock, or (``--clock cpu``) the process CPU time, which a loaded shared
#: machine disturbs far less (use it with ``--threads 1``, where CPU time and idle wall time agree).
CLOCK = {"fn": time.perf_counter}


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------
def resnet50_widths(width: int = 64) -> List[int]:
    model = wl.convert_model(resnet50(width), method="grad", block_size=10**6)
    return [m.num_features for _, m in wl.whitening_layers(model)]


def resnet110_widths(tiny: bool) -> List[int]:
    model = wl.convert_model(wl.models.cifar_resnet(8 if tiny else 110, num_classes=100), method="grad")
    return [m.num_features for _, m in wl.whitening_layers(model)]


# --------------------------------------------------------------------------------------------------
# Layers with a prepared block (the fold's cost depends on M alone: the layers are linear, 1 output)
# --------------------------------------------------------------------------------------------------
def _block(m: int, seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(m, m, generator=g) / m**0.5
    z = torch.randn(rows, m, generator=g)
    return torch.relu(z @ mix + 0.1 * z)


def prepared_layers(widths: List[int], method: str, *, part: int = 0, parts: int = 1):
    cls = wl.GradWhitenLinear if method == "grad" else wl.RecursiveWhitenLinear
    layers = [cls(m, 1, bias=False, block_size=10**6) for m in widths]
    for block in range(2):  # one regular fold behind: the timed fold is not the first
        for i, (layer, m) in enumerate(zip(layers, widths)):
            x = _block(m, 1000 * block + i, 2 * m + 16)
            layer.accumulate(x[part::parts])
        if block == 0:
            fold_layers(layers, strategy="replicated")
    return layers, [layer.get_extra_state() for layer in layers]


def _restore(layers, states) -> None:
    for layer, s in zip(layers, states):
        layer.set_extra_state(s)


def time_fold(layers, states, fn, repeat: int) -> List[float]:
    clock = CLOCK["fn"]
    times = []
    for _ in range(repeat):
        _restore(layers, states)
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def single_process_folds(widths: List[int], repeat: int) -> Dict[str, float]:
    evd, evd_state = prepared_layers(widths, "grad")
    rec, rec_state = prepared_layers(widths, "recursive")
    out = {}
    runs = {
        "EVD, batched by width": (evd, evd_state, lambda: fold_layers(evd)),
        "EVD, looped per layer": (evd, evd_state, lambda: [fold_layers([l]) for l in evd]),
        "recursive": (rec, rec_state, lambda: fold_layers(rec)),
    }
    samples: Dict[str, List[float]] = {k: [] for k in runs}
    for _ in range(repeat):  # interleaved
        for k, (layers, states, fn) in runs.items():
            samples[k] += time_fold(layers, states, fn, 1)
    for k, v in samples.items():
        out[k] = statistics.median(v)
    return out


def plain_step_time(model: nn.Module, batch: int, hw: int, classes: int, repeat: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, hw, hw)
    y = torch.randint(0, classes, (batch,))
    clock = CLOCK["fn"]
    times = []
    for i in range(repeat + 1):
        t0 = clock()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:  # first step is warm-up
            times.append(clock() - t0)
    return statistics.median(times)


def overhead_table(fold: Dict[str, float], step: float) -> str:
    rows = []
    for name, t in fold.items():
        rows.append([name, 1e3 * t] + [100.0 * t / (b * step) for b in BLOCK_SIZES])
    return md_table(["fold", "ms per fold"] + [f"% of step, L={b}" for b in BLOCK_SIZES], rows, nd=2)


# --------------------------------------------------------------------------------------------------
# Distributed
# --------------------------------------------------------------------------------------------------
def _rank(rank: int, world: int, store: str, outdir: str, widths: List[int], method: str, repeat: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    result = {}
    try:
        layers, states = prepared_layers(widths, method, part=rank, parts=world)
        for strategy in ("replicated", "owner"):
            walls, cpus = [], []
            for _ in range(repeat):
                _restore(layers, states)
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                fold_layers(layers, strategy=strategy)
                cpus.append(time.process_time() - c0)
                walls.append(time.perf_counter() - w0)
            result[strategy] = (statistics.median(walls), statistics.median(cpus))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def distributed_folds(widths: List[int], method: str, world: int, repeat: int) -> Dict[str, Dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), tmp, widths, method, repeat), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    out = {}
    for strategy in ("replicated", "owner"):
        out[strategy] = {"wall_max": max(r[strategy][0] for r in per_rank),
                         "cpu_max": max(r[strategy][1] for r in per_rank)}
    return out


def single_thread_fold(widths: List[int], method: str, repeat: int) -> Dict[str, float]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers, states = prepared_layers(widths, method)
        walls, cpus = [], []
        for _ in range(repeat):
            _restore(layers, states)
            w0, c0 = time.perf_counter(), time.process_time()
            fold_layers(layers)
            cpus.append(time.process_time() - c0)
            walls.append(time.perf_counter() - w0)
        return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    finally:
        torch.set_num_threads(n)


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--batch", type=int, default=8, help="ResNet-50 step batch at 224x224 (default 8)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)  # --clock (add_common_args): also this script's single-process timer
    setup(args.threads, args.seed, args.clock)
    CLOCK["fn"] = time.process_time if args.clock == "cpu" else time.perf_counter
    tiny = args.tiny
    repeat = 1 if tiny else args.repeat
    width = 8 if tiny else 64
    hw = 32 if tiny else 224
    out: Dict[str, object] = {"machine": machine_description(), "load_before": loadavg()}
    text = [f"Machine: {out['machine']}", f"Load average before: {out['load_before']}",
            f"Single-process timer: {args.clock} clock, {args.threads} thread(s)", ""]

    # Part 1: ResNet-50
    w50 = resnet50_widths(width)
    fold50 = single_process_folds(w50, repeat)
    step50 = plain_step_time(resnet50(width), args.batch, hw, 1000, 1 if tiny else 2)
    out["resnet50"] = {"widths": w50, "fold_s": fold50, "step_s": step50, "batch": args.batch, "hw": hw}
    text += [f"### ResNet-50: one fold of {len(w50)} layers (M = {min(w50)} ... {max(w50)}), "
             f"plain SGD step {1e3 * step50:.0f} ms at batch {args.batch}, {hw}x{hw}, {args.threads} threads", "",
             overhead_table(fold50, step50), "",
             f"At batch 32 (a step ~{32 / args.batch:.0f}x longer, compute-bound) the overheads are "
             f"{args.batch / 32:.2f}x these.", ""]

    # Part 2: ResNet-110
    w110 = resnet110_widths(tiny)
    fold110 = single_process_folds(w110, repeat)
    model110 = wl.models.cifar_resnet(8 if tiny else 110, num_classes=100)
    step110 = plain_step_time(model110, 16 if tiny else 128, 32, 100, 1 if tiny else 3)
    out["resnet110"] = {"fold_s": fold110, "step_s": step110}
    text += [f"### CIFAR ResNet-110: one fold of {len(w110)} layers, plain SGD step {1e3 * step110:.0f} ms "
             f"(batch {16 if tiny else 128}, 32x32)", "", overhead_table(fold110, step110), ""]

    # Part 3: distributed
    rows = []
    dist_out = {}
    for name, widths in (("ResNet-50", w50),) if tiny else (("ResNet-50", w50), ("ResNet-110", w110)):
        base = single_thread_fold(widths, "grad", repeat)
        for world in (2,) if tiny else (2, 4):
            d = distributed_folds(widths, "grad", world, repeat)
            dist_out[f"{name}-{world}"] = {"single": base, **d}
            for strategy in ("replicated", "owner"):
                rows.append([name, world, strategy, 1e3 * base["wall"], 1e3 * d[strategy]["wall_max"],
                             1e3 * d[strategy]["cpu_max"], d[strategy]["cpu_max"] / base["cpu"]])
    owners = assign_owners([float(m) ** 3 for m in w50], 8)
    load8 = [sum(float(m) ** 3 for m, o in zip(w50, owners) if o == r) for r in range(8)]
    share8 = max(load8) / sum(load8)
    out["distributed"] = dist_out
    out["resnet50_owner_share_8_ranks"] = share8
    text += ["### Distributed EVD fold, gloo, one thread per rank (per rank: the slowest rank)", "",
             md_table(["layers", "ranks", "strategy", "1 process ms", "per-rank wall ms", "per-rank CPU ms",
                       "per-rank CPU / 1 process"], rows, nd=3), "",
             f"ResNet-50 on 8 ranks (owner): the most loaded rank holds {100 * share8:.1f} % of the summed M^3 "
             f"(LPT assignment; the 2048-wide layers bound it).", "",
             f"Load average after: {loadavg()}"]
    out["markdown"] = "\n".join(text)
    print(out["markdown"])
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
