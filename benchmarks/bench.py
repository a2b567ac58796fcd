#!/usr/bin/env python
"""The benchmark suite's entry point: named scenarios, each writing its tables with the command, the machine, the
commit, the torch version and the machine's load.

    python benchmarks/bench.py --help               # this text and the scenarios
    python benchmarks/bench.py list                 # the scenarios, one a line
    python benchmarks/bench.py step                 # one scenario, full size (prints its section)
    python benchmarks/bench.py step --tiny          # a smoke run (CI): one thread, seconds, no meaningful numbers
    python benchmarks/bench.py all --tiny           # every scenario, tiny
    python benchmarks/bench.py step --out step.md -- --depths 20 --layer-kwargs gains=damped
                                                    # options after "--" go to the scenario (its --help lists them)

Every figure is a ratio to the plain model measured in the same run, the variants interleaved step by step (see
``_common.py``). Each scenario runs in a process of its own, so that one scenario's allocations and thread pools
cannot disturb another's timings. ``benchmarks/RESULTS.md`` holds the current section of each scenario.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from _common import ROOT, loadavg

HERE = Path(__file__).resolve().parent
#: The scenario's environment unless set otherwise: no torch.profiler start/stop lines (kineto's USDT level, the
#: highest) and no c10 warnings (its allocator's about blocks allocated before the profiler started).
QUIET = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}


class Scenario(NamedTuple):
    script: str
    title: str
    what: str
    #: scenario options of the full-size run (the tiny run takes --tiny --threads 1 instead)
    full: tuple = ()


SCENARIOS: Dict[str, Scenario] = {
    "step": Scenario("step_time.py", "CPU training step and memory against peers",
                     "CIFAR ResNet-20 / -110, batch 128: plain, grad, recursive, direct, K-FAC, FOOF, IterNorm, "
                     "Shampoo, SOAP, Muon; mean step and peak memory vs plain (minutes to an hour)"),
    "ops": Scenario("hot_path.py", "Ops per step and host synchronisations",
                    "non-view ATen ops per step and per whitening layer (a GPU's kernel launches), host syncs, "
                    "ResNet-20 and the ResNet-50 layout; step time at batch 128, 2 threads"),
    "host": Scenario("host_overhead.py", "Host time per whitening layer (CPU proxy of a GPU step)",
                     "the ResNet-50 layout at width 2, bf16 autocast, one thread: extra microseconds per layer and "
                     "step; --ablate METHOD, --folds, --ddp (under torchrun) in the scenario's options",
                     ("--clock", "cpu")),
    "fold": Scenario("fold_cost.py", "Fold cost",
                     "one fold of one layer, EVD vs recursive, M = 64 ... 1024; a whole-model fold of ResNet-110"),
    "compile": Scenario("compile_step.py", "torch.compile",
                        "graphs, breaks and recompiles of converted models (aot_eager); the compiled step "
                        "(inductor) against the compiled plain model; --cold VARIANTS: each compiled in a fresh "
                        "process"),
    "async": Scenario("fold_async.py", "The asynchronous fold",
                      "the step that ends a block against one that does not, fold_async=False / True "
                      "(ResNet-50 layout at width 8, one thread each; --device cuda on a GPU)"),
    "gpu": Scenario("gpu.py", "GPU checks and step table",
                    "on CUDA: float64 equivalence, bf16 autocast, no host sync per batch, step time and memory of "
                    "ResNet-50 (bf16, batch 128) and ResNet-110 against plain, Muon and SOAP (minutes); runs tiny "
                    "on a CPU", ("--rounds", "50")),
}


def _epilog() -> str:
    return "scenarios:\n" + "\n".join(f"  {name:8s} {s.title}: {s.what} (benchmarks/{s.script})"
                                      for name, s in SCENARIOS.items())


def provenance(command: str, info: Dict[str, str], load_after: str, seconds: float) -> str:
    """The table above every scenario's results: what ran, where, on which code."""
    rows = [("command", f"`{command}`"), ("machine", info["cpu"]), ("GPU", info["gpu"]),
            ("commit", info["commit"]), ("torch", f"{info['torch']} (Python {info['python']})"),
            ("load average", f"{info['loadavg']} before, {load_after} after"),
            ("date", info["date"]), ("wall time", f"{seconds:.0f} s")]
    return "\n".join(["| run | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows]])


def run_scenario(name: str, tiny: bool, extra: List[str], command: str) -> Optional[str]:
    """Run one scenario in its own process; its Markdown section (provenance first), or None if it failed."""
    scenario = SCENARIOS[name]
    opts = (["--tiny", "--threads", "1"] if tiny else list(scenario.full)) + extra
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        load_before = loadavg()
        t0 = time.perf_counter()
        print(f"== {command}  (load {load_before})", file=sys.stderr, flush=True)
        # Its tables come back in its JSON, printed once below; what it prints comes back only if it fails.
        proc = subprocess.run([sys.executable, str(HERE / scenario.script), *opts, "--json", str(out)], cwd=ROOT,
                              env={**QUIET, **os.environ}, stdout=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            print(f"{proc.stdout}{name}: failed (exit code {proc.returncode})", file=sys.stderr)
            return None
        result = json.loads(out.read_text())
    info, markdown = {**result["machine"], "loadavg": load_before}, result["markdown"]
    head = f"## {scenario.title}" + (" (tiny: a smoke run, numbers meaningless)" if tiny else "")
    return "\n\n".join([head, provenance(command, info, loadavg(), seconds), markdown]) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=[*SCENARIOS, "all", "list"], metavar="SCENARIO",
                   help="a scenario below, 'all' (one after another) or 'list'")
    p.add_argument("--tiny", action="store_true", help="a seconds-long configuration of each scenario (CI)")
    p.add_argument("--out", metavar="PATH", help="also write the sections to this Markdown file")
    args = p.parse_args(argv)
    if args.scenario == "list":
        print("\n".join(SCENARIOS))
        return 0
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    if extra and len(names) > 1:
        p.error("scenario options (after --) go with one scenario, not 'all'")
    sections, failed = [], []
    for name in names:
        command = " ".join(["python benchmarks/bench.py", name] + (["--tiny"] if args.tiny else [])
                           + (["--", *map(shlex.quote, extra)] if extra else []))
        section = run_scenario(name, args.tiny, extra, command)
        if section is None:
            failed.append(name)
            continue
        sections.append(section)
        print(section, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(sections))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
