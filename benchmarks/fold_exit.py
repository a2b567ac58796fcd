"""An exiting process with a fold in flight: how long it takes from the last step to the exit.

A script trains ``--layers`` ``nn.Linear(width, width)`` layers (``method="grad"``, every layer whitened,
``block_size=3``) for 3 steps, the third ending a block, and exits: with the synchronous fold (``sync``, the default,
which folds the block in the third step) and with ``fold_async=True`` (``async``: the block's fold is in flight in the
worker at exit, read by no one). Each variant runs in a fresh process (``--world 2``: two gloo ranks under
``torch.distributed.run``, one thread each), the variants alternated round by round. Reported per variant: the
seconds from the end of the last step to the process's exit (the parent's clock after the child wrote its time),
the training's seconds, and the exit's ratio to the synchronous one of the same round. The asynchronous exit waits
for the part of the fold in progress (one stack of at most ``ASYNC_CHUNK_ELEMENTS``), not for the whole fold.

    python benchmarks/fold_exit.py                 # one process, six 2048-wide layers: about a minute
    python benchmarks/fold_exit.py --world 2       # two gloo ranks: about two minutes
    python benchmarks/fold_exit.py --tiny          # seconds (CI)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from _common import ROOT, command_line, loadavg, machine_description, md_table, write_json

VARIANTS = ("sync", "async")


def child(width: int, layers: int, variant: str, out: str) -> None:
    """The measured script: train 3 steps and write the end of the last one (rank 0), then exit."""
    import torch
    from torch import nn

    import whitenlayers as wl

    distributed = "LOCAL_RANK" in os.environ
    rank = 0
    if distributed:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = wl.convert_model(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), method="grad",
                             targets="all", include_linear=True, include_stem=True, include_classifier=True,
                             fold_async=variant == "async", block_size=3)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1 + rank)
    start = time.perf_counter()
    for _ in range(3):  # the third step ends the block: its fold runs (sync) or starts in the worker (async)
        opt.zero_grad()
        model(torch.randn(16, width, generator=gen) + 1).square().mean().backward()
        opt.step()
    trained = time.perf_counter() - start
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(f"{trained} {time.time()}")


def run_once(args: argparse.Namespace, variant: str, out: str) -> Dict[str, float]:
    """One fresh process (or ``--world`` ranks) of ``variant``: its training and exit seconds."""
    script = [str(Path(__file__).resolve()), "--child", variant, "--width", str(args.width),
              "--layers", str(args.layers), "--out", out]
    if args.world > 1:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.world}", *script]
    else:
        command = [sys.executable, *script]
    # (torch.distributed.run sets OMP_NUM_THREADS=1 for its ranks; the child sets one thread a rank as well)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: exit code {proc.returncode}\n{proc.stderr[-3000:]}")
    trained, stamp = map(float, Path(out).read_text().split())
    return {"train": trained, "exit": ended - stamp}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048, help="the layers' width (default 2048)")
    parser.add_argument("--layers", type=int, default=6, help="how many layers (default 6)")
    parser.add_argument("--world", type=int, default=1, help="gloo ranks under torch.distributed.run (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="seconds (CI): no meaningful numbers")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.width, args.layers, args.child, args.out)
        return 0
    if args.tiny:
        args.width, args.layers, args.rounds = 64, 2, 1
    loads = [loadavg()]
    runs: Dict[str, List[Dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in VARIANTS[r % 2:] + VARIANTS[: r % 2]:  # the order alternated round by round
                runs[variant].append(run_once(args, variant, os.path.join(tmp, "stamp")))
            loads.append(loadavg())
    ratios = [a["exit"] / s["exit"] for a, s in zip(runs["async"], runs["sync"])]
    rows = []
    for variant in VARIANTS:
        exits, trains = [x["exit"] for x in runs[variant]], [x["train"] for x in runs[variant]]
        ratio = statistics.median(ratios) if variant == "async" else 1.0
        rows.append([variant, statistics.median(exits), min(exits), max(exits), statistics.median(trains), ratio])
    title = f"## An exit with a fold in flight{' (tiny: no meaningful numbers)' if args.tiny else ''}"
    print(title)
    machine = machine_description()
    print(f"\n`{command_line()}`: {args.layers} layers of width {args.width}, {args.world} process(es), "
          f"{args.rounds} rounds; load {' -> '.join(loads)}; {machine['cpu']}; torch {machine['torch']}; "
          f"commit {machine['commit']}\n")
    print(md_table(["variant", "exit s (median)", "min", "max", "train s (median)", "exit / sync (paired median)"],
                   rows, nd=2))
    write_json(args.json, {"runs": runs, "ratios": ratios, "loads": loads, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
