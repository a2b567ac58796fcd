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
import logging
import time
from typing import Dict, List

import _common  # noqa: F401  (puts the repository on sys.path)
import torch
import torch._dynamo
import torch.nn.functional as F
from _common import add_common_args, command_line, loadavg, machine_description, md_table, setup, write_json
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
        for name in ["plain"] + methods:
            model = copy.deepcopy(base)
            if name != "plain":
                model = wl.convert_model(model, name, block_size=block_size)
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


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--methods", default="grad,recursive,direct")
    p.add_argument("--skip-timing", action="store_true", help="graph counts only (no inductor compilation)")
    p.add_argument("--rounds", type=int, default=6, help="steady steps measured: 5 x rounds per variant")
    args = p.parse_args(argv)
    setup(args.threads, args.seed, args.clock)
    methods = [m for m in args.methods.split(",") if m]
    machine = machine_description()
    if args.tiny:  # CI: the script runs (a CIFAR ResNet-8, 2 blocks of 2), no timing
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
