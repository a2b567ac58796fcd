"""The asynchronous fold: the step that ends a block against the steps that do not, with the fold on
the training thread (``fold_async=False``, the default) and in a worker thread (``fold_async=True``).

The ResNet-50 layout at 1/8 width (``width=8``: ``M`` up to 256), ``method="grad"``, ``block_size=4``, batch 4,
``--size`` px, SGD with momentum, ``torch.set_num_threads(1)``: the training thread and the fold's worker thread
are single-threaded each (the setting is the process's), so on a 2-core machine the fold can run on the other core.
The two variants are interleaved round by round: each round trains one model for ``--blocks`` blocks and then the
other; the first block of each round is not timed (the asynchronous variant's fold in flight is waited for at the
end of its round, outside the timings, so that it never runs during the other variant's steps). The load average
is recorded: on a loaded machine the worker has no core of its own, and the wall clock shows it.

Reported per variant: the median step that ends a block, the median step that does not, their ratio, in wall
clock and in the training thread's CPU time (``time.thread_time``: what the step costs that thread when the worker
has a core of its own; a CPU backward runs on the calling thread); for the asynchronous fold also the median time
of a block's end on the training thread (the coordinator's part: the wait for the fold in flight, copies, the
pending fold written, the worker started) and the worker's median time per fold (wall and thread CPU time). The
training thread's share of a fold is the step that ends a block minus the step that does not. Last, by the step's
place in its block: the median wall clock, the host time until the step was queued, the training thread's CPU time
and (CUDA) the wait for the device after that: the steps that run beside a fold in flight, and what slows them (host
time above CPU time: the thread waited on the host, e.g. for the GIL; a longer device wait: a busier device).

    python benchmarks/fold_async.py              # a few minutes
    python benchmarks/fold_async.py --tiny       # CI
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from _common import add_common_args, command_line, loadavg, machine_description, md_table, setup, write_json
from _resnet50 import resnet50

import whitenlayers as wl
import whitenlayers.coordinator as wl_fold

VARIANTS = ("sync", "async")


def _instrument() -> Dict[str, List[float]]:
    """Time the worker's fold (wall and thread CPU) and the training thread's wait for it."""
    log: Dict[str, List[float]] = {"worker_wall": [], "worker_cpu": [], "wait": [], "launch": []}
    compute, wait, launch = wl_fold._compute_jobs, wl_fold.FoldCoordinator.wait, wl_fold.FoldCoordinator._fold_async

    def timed_compute(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = compute(*args, **kwargs)
        log["worker_wall"].append(time.perf_counter() - t0)
        log["worker_cpu"].append(time.thread_time() - c0)
        return out

    def timed_wait(self):
        t0 = time.perf_counter()
        wait(self)
        if log.get("_timing"):
            log["wait"].append(time.perf_counter() - t0)

    def timed_launch(self, layers):
        t0 = time.perf_counter()
        launch(self, layers)
        if log.get("_timing"):
            log["launch"].append(time.perf_counter() - t0)

    wl_fold._compute_jobs = timed_compute
    wl_fold.FoldCoordinator.wait = timed_wait
    wl_fold.FoldCoordinator._fold_async = timed_launch
    return log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--size", type=int, default=224, help="input size in pixels (default 224)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=4, help="block_size (default 4)")
    parser.add_argument("--blocks", type=int, default=3, help="timed blocks per variant per round (default 3)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--width", type=int, default=8, help="the ResNet-50 layout's width (default 8: 1/8 of 64)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (bf16 autocast, channels_last)")
    parser.add_argument("--plain", action="store_true", help="also time the plain model (mean step ratios)")
    parser.add_argument("--method", default="grad", choices=("grad", "recursive"), help="default grad")
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    if args.tiny:
        args.size, args.rounds, args.blocks = 32, 1, 2
    setup(args.threads, args.seed, "wall")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    variants = (("plain",) if args.plain else ()) + VARIANTS
    log = _instrument()
    models, opts = {}, {}
    for name in variants:
        torch.manual_seed(args.seed)
        model = resnet50(args.width, num_classes=100)
        if name != "plain":
            model = wl.convert_model(model, args.method, block_size=args.block, fold_async=name == "async")
        model.to(device, memory_format=torch.channels_last if cuda else torch.preserve_format)
        models[name] = model
        opts[name] = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    layers = wl.whitening_layers(models["sync"])
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device)
    y = torch.randint(0, 100, (args.batch,), generator=gen).to(device)
    if cuda:
        x = x.contiguous(memory_format=torch.channels_last)

    def step(name: str) -> Tuple[float, float, float, float]:
        """Wall clock, the training thread's CPU time, its wall clock until the step was queued (host), and the
        wait for the device after that (CUDA)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        opts[name].zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(models[name](x), y)
        loss.backward()  # a CPU backward runs on the calling thread
        opts[name].step()
        t1 = time.perf_counter()
        if cuda:  # this thread's stream, as loss.item() waits: the fold's own stream goes on (a device-wide
            torch.cuda.current_stream(device).synchronize()  # synchronisation would wait for it at every step)
        t2 = time.perf_counter()
        return t2 - t0, time.thread_time() - c0, t1 - t0, t2 - t1

    times: Dict[str, Dict[str, List[Tuple[float, float, float, float]]]] = {name: {"ends": [], "within": []}
                                                                              for name in variants}
    after_end: Dict[str, Dict[int, List[Tuple[float, float, float, float]]]] = {name: {} for name in variants}
    loads = [loadavg()]
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name in order:
            for _ in range(args.block):  # the round's first block: untimed
                step(name)
            log["_timing"] = [1.0]
            for _ in range(args.blocks):
                for i in range(args.block):
                    t = step(name)
                    times[name]["ends" if i == args.block - 1 else "within"].append(t)
                    after_end[name].setdefault(i, []).append(t)  # i: steps since the last block end
            log["_timing"] = []
            for h in models[name]._forward_hooks.values():
                if isinstance(h, wl_fold.FoldCoordinator):
                    h.wait()
        loads.append(loadavg())
        print(f"  round {r + 1}/{args.rounds}  load {loads[-1]}", file=sys.stderr, flush=True)

    rows, out, means = [], {}, []
    for name in variants:
        every = [t[0] for t in times[name]["ends"] + times[name]["within"]]
        means.append([name, 1e3 * statistics.fmean(every),
                      statistics.fmean(every) / statistics.fmean(t[0] for t in times["plain"]["ends"] +
                                                                 times["plain"]["within"]) if args.plain else
                      float("nan")])
        res: Dict[str, float] = {"n_ends": len(times[name]["ends"]), "n_within": len(times[name]["within"])}
        for c, clock in enumerate(("wall", "thread_cpu")):
            ends = statistics.median(t[c] for t in times[name]["ends"])
            within = statistics.median(t[c] for t in times[name]["within"])
            res.update({f"{clock}_ends_ms": 1e3 * ends, f"{clock}_within_ms": 1e3 * within,
                        f"{clock}_ratio": ends / within})
            rows.append([name, clock, 1e3 * within, 1e3 * ends, ends / within, 1e3 * (ends - within)])
        out[name] = res
    out.update({f"{name}_mean_ms": row[1] for name, row in zip(variants, means)})
    worker = {k: 1e3 * statistics.median(v) for k, v in log.items()
              if k in ("worker_wall", "worker_cpu", "wait", "launch") and v}
    out["worker_ms"] = worker
    # Where the steps after a block end go (the asynchronous fold runs beside them): by the step's place in its
    # block, the median wall clock, the training thread's host time until the step was queued, its CPU time, and
    # the wait for the device after that. Host time above CPU time: the thread waited on the host (the GIL, a
    # lock); a longer device wait: the device was busier (the fold's kernels beside the step's).
    places = []
    for name in VARIANTS:
        for i, ts in sorted(after_end[name].items()):
            if i < 8 or i == args.block - 1:
                places.append([name, i + 1] + [1e3 * statistics.median(t[c] for t in ts) for c in (0, 2, 1, 3)])
    out["after_block_end"] = places
    where = device.type + (" (bf16 autocast, channels_last)" if cuda else "")
    lines = [
        f"ResNet-50 layout, width {args.width} on {where} ({len(layers)} {args.method} layers, M up to "
        f"{max(layer.num_features for _, layer in layers)}), batch {args.batch}, {args.size} px, block_size "
        f"{args.block}, {args.threads} thread(s); {args.rounds} rounds x {args.blocks} timed blocks per variant",
        "",
        md_table(["variant", "clock", "median step within a block (ms)", "median step ending a block (ms)", "ratio",
                  "training thread's share of a fold (ms)"], rows, nd=2),
        "",
        f"async: a block's end on the training thread {worker.get('launch', float('nan')):.1f} ms (median; the "
        f"wait for the fold in flight {worker.get('wait', float('nan')):.2f} ms of it); the worker's fold "
        f"{worker.get('worker_wall', float('nan')):.1f} ms wall, {worker.get('worker_cpu', float('nan')):.1f} ms "
        "thread CPU (median)",
        "",
        md_table(["variant", "mean step, folds included (ms)", "vs plain"], means, nd=3),
        "",
        md_table(["variant", "step of the block", "wall (ms)", "host until queued (ms)", "thread CPU (ms)",
                  "device wait (ms)"], places, nd=2),
        "",
        f"load average during the run: {' -> '.join(loads)}",
        "",
        command_line(),
    ]
    markdown = "\n".join(lines)
    print(markdown)
    write_json(args.json, {"machine": machine_description(), "args": vars(args), "results": out, "loads": loads,
                           "markdown": markdown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
