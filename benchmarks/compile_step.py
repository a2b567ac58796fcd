#!/usr/bin/env python
"""``torch.compile`` of converted models: graphs, compile time and the steady compiled step.

Two tables, each against the plain model measured in the same run:

1. dynamo's counters over 3 whole blocks (block_size 10, 31 SGD steps) of the torchvision ResNet-50 layout
   (``_resnet50.py``, 32x32, batch 2), traced with ``aot_eager`` (dynamo and AOTAutograd: the graph count does
   not depend on the backend, and this skips code generation): unique graphs, graph breaks, and whether a
   recompile limit was hit;
2. inductor (``mode`` default; on CUDA also ``reduce-overhead``) on CIFAR ResNet-20, batch 128: the first step
   (compile included), and the median steady step against the compiled plain model (``gpu.compiled_table``).

    python benchmarks/compile_step.py                 # both tables (minutes on 2 CPU cores)
    python benchmarks/compile_step.py --skip-timing   # the graph counts only
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import _common  # noqa: F401  (puts the repository on sys.path)
import torch
import torch._dynamo
import torch.nn.functional as F
from _common import (
    LAYER_KWARGS,
    add_common_args,
    command_line,
    kwargs_for,
    loadavg,
    machine_description,
    md_table,
    parse_layer_kwargs,
    setup,
    write_json,
)
from _resnet50 import resnet50
from gpu import compiled_table
from torch._dynamo.utils import counters

import whitenlayers as wl


class _LimitWatch(logging.Handler):
    """Catches dynamo's 'hit config.recompile_limit' warning (a log record, not a Python warning)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            self.hits += 1


def graph_counts(methods: List[str], blocks: int = 3, block_size: int = 10, tiny: bool = False) -> List[List[object]]:
    torch.manual_seed(0)
    base = wl.models.cifar_resnet(8, width=4) if tiny else resnet50(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, 10, (2,))
    rows: List[List[object]] = []
    watch = _LimitWatch()
    logging.getLogger("torch._dynamo").addHandler(watch)
    try:
        for name in ([] if tiny else ["plain"]) + methods:  # tiny: one converted model, the plain one left out
            model = copy.deepcopy(base)
            if name != "plain":
                model = wl.convert_model(model, name, **{**kwargs_for(name), "block_size": block_size})
            torch._dynamo.reset()
            counters.clear()
            watch.hits = 0
            compiled = torch.compile(model, backend="aot_eager")
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            t0 = time.perf_counter()
            for _ in range(blocks * block_size + 1):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(compiled(x), y).backward()
                opt.step()
            elapsed = time.perf_counter() - t0
            layers = wl.whitening_layers(model)
            folds = int(layers[0][1].num_blocks) if layers else 0
            rows.append([name, len(layers), counters["stats"]["unique_graphs"],
                         sum(counters["graph_break"].values()), watch.hits, folds, elapsed])
    finally:
        logging.getLogger("torch._dynamo").removeHandler(watch)
    return rows


def _cold_model(variant: str, device: torch.device, tiny: bool):
    """The cold run's model and batch: the ResNet-50 layout, 32x32, batch 2 on a CPU; 224x224, batch 128,
    channels_last and bf16 autocast on CUDA; ``tiny``: a CIFAR ResNet-8. ``variant``: "plain", a method, or
    "METHOD:KEY=VALUE,..." (conversion keyword arguments, e.g. ``grad:gains=damped``)."""
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if tiny:
        model, batch, hw, classes = wl.models.cifar_resnet(8, width=4), 2, 16, 10
    else:
        batch, hw, classes = (128, 224, 1000) if cuda else (2, 32, 10)
        model = resnet50(num_classes=classes)
    method, _, kwargs = variant.partition(":")
    if method != "plain":
        model = wl.convert_model(model, method, **{**kwargs_for(method), **parse_layer_kwargs(kwargs)})
    model = model.to(device).train()
    x = torch.randn(batch, 3, hw, hw, device=device)
    if cuda:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return model, x, torch.randint(0, classes, (batch,), device=device)


def cold_child(variant: str, device: torch.device, mode: str, steps: int, steady: int, tiny: bool) -> Dict[str, object]:
    """One variant in this (fresh) process: the first ``steps`` compiled steps (compilation included), dynamo's
    counters, the graph's node count, where the compile time went, then ``steady`` steps after the first block
    (block_size 10: its fold included) with CUDA graph recordings and peak memory."""
    import resource

    model, x, y = _cold_model(variant, device, tiny)
    nodes: List[int] = []

    def backend(gm, example_inputs):
        nodes.append(len(gm.graph.nodes))
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    # default mode: inductor through a counting wrapper (dynamo's graph's node count); another mode as it is
    compiled = torch.compile(model, backend=backend) if mode == "default" else torch.compile(model, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cuda = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)

    torch._dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    first = time.perf_counter() - t0
    cpu = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    phases = {}
    for name, values in torch._dynamo.utils.compilation_time_metrics.items():
        if name in ("compile_fx.<locals>.fw_compiler_base", "backward._backward_impl", "bytecode_tracing"):
            phases[name.split(".")[-1]] = round(sum(values), 1)
    frames = sum(counters["frames"].values())
    times = []
    warm: Dict[str, int] = {}
    if steady:
        for _ in range(max(0, 12 - steps)):  # past the first block's fold
            step()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        warm = {k: v for k, v in counters["inductor"].items() if k.startswith("cudagraph")}
        for _ in range(steady):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    # CUDA graph trees' counters over the steady steps only (after the first block): 0 re-recordings expected
    recorded = {k: v - warm.get(k, 0) for k, v in counters["inductor"].items()
                if k.startswith("cudagraph")}
    return {"variant": variant, "first": first, "cpu": cpu, "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()), "recompiled": sum(counters["frames"].values()) - frames,
            "nodes": sum(nodes), "phases": phases, "steady_ms": 1e3 * sorted(times)[len(times) // 2] if times else None,
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda and steady else None,
            "recordings": recorded}


def cold_table(variants: List[str], rounds: int, device: str, mode: str, steps: int, steady: int,
               tiny: bool) -> List[List[object]]:
    """Each variant in a fresh process with an empty inductor cache, the variants interleaved ``rounds`` times:
    the median of each figure, the first steps against the plain model's, the load before each run."""
    runs: Dict[str, List[dict]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                           TORCHINDUCTOR_AUTOGRAD_CACHE="0")
                load = loadavg()
                out = subprocess.run([sys.executable, __file__, "--cold-child", variant, "--device", device, "--mode",
                                      mode, "--cold-steps", str(steps), "--steady", str(steady),
                                      "--layer-kwargs", ",".join(f"{k}={v!r}" for k, v in LAYER_KWARGS.items())]
                                     + (["--tiny"] if tiny else []), env=env, capture_output=True, text=True)
                line = [s for s in out.stdout.splitlines() if s.startswith("{")]
                if out.returncode != 0 or not line:
                    print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                    raise RuntimeError(f"cold run of {variant} failed")
                result = json.loads(line[-1])
                result["load"] = load
                print(variant, result, file=sys.stderr, flush=True)
                runs[variant].append(result)
    base = statistics.median(r["first"] for r in runs[variants[0]])
    rows: List[List[object]] = []
    for variant, results in runs.items():
        first = statistics.median(r["first"] for r in results)
        last = results[-1]
        steady_ms = [r["steady_ms"] for r in results if r["steady_ms"] is not None]
        rows.append([variant, first, first / base, statistics.median(r["cpu"] for r in results), last["graphs"],
                     last["breaks"], last["recompiled"], last["nodes"],
                     " / ".join(f"{k} {v}" for k, v in last["phases"].items()),
                     statistics.median(steady_ms) if steady_ms else "-",
                     last["peak_mib"] if last["peak_mib"] is not None else "-",
                     ", ".join(f"{k} {v}" for k, v in last["recordings"].items()) or "-",
                     "; ".join(r["load"] for r in results)])
    return rows


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--methods", default="grad,recursive,direct")
    p.add_argument("--skip-timing", action="store_true", help="graph counts only (no inductor compilation)")
    p.add_argument("--rounds", type=int, default=6, help="steady steps measured: 5 x rounds per variant")
    p.add_argument("--cold", default="", metavar="VARIANTS",
                   help="instead: cold compilation, each variant (plain first; METHOD:KEY=VALUE,... for conversion "
                        "keyword arguments) in a fresh process with an empty inductor cache (table 3)")
    p.add_argument("--cold-rounds", type=int, default=1, help="interleaved rounds of the cold runs")
    p.add_argument("--cold-steps", type=int, default=3, help="the first steps timed, compilation included")
    p.add_argument("--steady", type=int, default=0, help="cold runs: steady steps timed after the first block")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    p.add_argument("--cold-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock, args.layer_kwargs)
    if args.cold_child:
        print(json.dumps(cold_child(args.cold_child, torch.device(args.device), args.mode, args.cold_steps,
                                    args.steady, args.tiny)))
        return {}
    machine = machine_description()
    if args.cold:
        variants = [v for v in args.cold.split(",") if v]
        rows = cold_table(variants, args.cold_rounds, args.device, args.mode, args.cold_steps, args.steady, args.tiny)
        model = "CIFAR ResNet-8 (tiny)" if args.tiny else (
            "ResNet-50 layout, 224x224, batch 128, bf16 autocast, channels_last" if args.device == "cuda"
            else "ResNet-50 layout, 32x32, batch 2")
        md = "\n\n".join([
            f"Command: `{command_line()}`; {machine['cpu']}; torch {machine['torch']}; commit {machine['commit']}",
            f"{model}, {args.device}, mode {args.mode}, each variant in a fresh process with an empty inductor "
            f"cache, {args.cold_rounds} interleaved round(s), medians:",
            md_table(["variant", f"first {args.cold_steps} steps s", "vs plain", "CPU s (incl. compile workers)",
                      "unique graphs", "graph breaks", "frames recompiled", "dynamo graph nodes",
                      "compile phases s", "steady step ms", "peak MiB", "CUDA graph counters", "load before"],
                     rows, nd=2),
            f"load after {loadavg()}"])
        print(md)
        payload = {"machine": machine, "cold": rows, "markdown": md}
        write_json(args.json, payload)
        return payload
    methods = [m for m in args.methods.split(",") if m]
    if args.tiny:  # CI: the script runs (a CIFAR ResNet-8, one method, 2 blocks of 2), no timing
        methods, args.skip_timing = methods[:1], True
        counts = graph_counts(methods, blocks=2, block_size=2, tiny=True)
    else:
        counts = graph_counts(methods)
    parts = [f"Command: `{command_line()}`; {machine['cpu']}; torch {machine['torch']}; commit {machine['commit']}; "
             f"load before {machine['loadavg']}",
             ("CIFAR ResNet-8 (tiny)" if args.tiny else "ResNet-50 layout") + ", whole blocks + 1 step, `aot_eager`:",
             md_table(["variant", "whitening layers", "unique graphs", "graph breaks", "recompile-limit hits",
                       "blocks folded", "all steps incl. tracing (s)"], counts, nd=1)]
    timing: List[List[object]] = []
    if not args.skip_timing:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        timing = compiled_table(device, tiny=False, rounds=args.rounds)
        parts += [f"CIFAR ResNet-20, batch 128, inductor, {device.type}, {args.threads} threads:",
                  md_table(["torch.compile mode", "variant", "first step s", "median step ms",
                            "step vs compiled plain", "unique graphs"], timing, nd=3)]
    parts.append(f"load after {loadavg()}")
    md = "\n\n".join(parts)
    print(md)
    payload = {"machine": machine, "graph_counts": counts, "timing": timing, "markdown": md}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
