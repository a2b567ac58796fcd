"""The benchmark suite's harness: timing, statistics, tables, machine description (``bench.py`` runs the scenarios).

Rules every scenario follows:

* ``torch.set_num_threads(2)`` (``--threads`` to change it);
* variants are **interleaved** step by step (round ``r`` runs every variant
  once, in an order rotated each round, so no variant always runs first or
  right after a given one), after warm-up rounds that are not timed;
* figures are **ratios against the plain model measured in the same run**:
  ratio of medians, ratio of means, and the median of the per-round paired
  ratios (each round's variant time over the same round's plain time, robust
  to slow drifts of the machine's speed);
* no absolute time is used on its own; absolute medians are printed only to
  show the scale.
"""
# ruff: noqa: E741  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

# torch is imported in the functions that use it: bench.py, which runs each scenario in a process, never needs it.
_CLOCK: Callable[[], float] = time.perf_counter


#: Keyword arguments every converted variant gets (``--layer-kwargs``), e.g. ``{"gains": "damped"}``.
LAYER_KWARGS: Dict[str, object] = {}


def parse_layer_kwargs(text: str) -> Dict[str, object]:
    """``"gains=damped,block_size=50"`` -> ``{"gains": "damped", "block_size": 50}`` (Python literals where they
    parse, else strings)."""
    import ast

    out: Dict[str, object] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--layer-kwargs takes KEY=VALUE[,KEY=VALUE...], but got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def kwargs_for(method: str) -> Dict[str, object]:
    """The ``LAYER_KWARGS`` of one method: the unprefixed ones and those written ``METHOD:KEY=VALUE`` for it
    (``--layer-kwargs grad:gains=damped`` leaves the recursive variants as they are)."""
    out = {k: v for k, v in LAYER_KWARGS.items() if ":" not in k}
    out.update({k.split(":", 1)[1]: v for k, v in LAYER_KWARGS.items() if k.split(":", 1)[0] == method})
    return out


def setup(threads: int = 2, seed: int = 0, clock: str = "wall", layer_kwargs: str = "") -> None:
    """Threads, seed, the clock of :class:`Interleaved`: ``"wall"`` (``perf_counter``, the default) or
    ``"cpu"`` (``process_time``: this process's CPU time, which other processes on a shared machine disturb
    far less; meaningful with ``--threads 1``, where no thread waits on another), and the keyword arguments
    of every converted variant (``LAYER_KWARGS``)."""
    import torch
    global _CLOCK
    LAYER_KWARGS.clear()
    LAYER_KWARGS.update(parse_layer_kwargs(layer_kwargs))
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', but got {clock!r}")
    _CLOCK = time.perf_counter if clock == "wall" else time.process_time


def add_common_args(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="a seconds-long configuration (CI): no meaningful numbers")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="clock of the interleaved timings: wall (default) or this process's CPU time "
                             "(use with --threads 1 on a loaded machine)")
    parser.add_argument("--layer-kwargs", default="", metavar="KEY=VALUE,...",
                        help="keyword arguments of every converted variant, e.g. gains=damped, or of one method's: "
                             "grad:gains=damped (scenarios step, fold, compile)")


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_description() -> Dict[str, str]:
    """CPU model, core count, torch build, date: recorded next to every table."""
    import torch

    from whitenlayers.experiment.report import git_state

    lscpu = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    keep = ("Architecture", "Model name", "CPU(s):", "Thread(s) per core", "Core(s) per socket", "L2 cache", "L3 cache")
    lines = [l.strip() for l in lscpu.splitlines() if l.strip().startswith(keep)]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu,
        "cpu": "; ".join(" ".join(l.split()) for l in lines) or platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
        "blas": "MKL" if torch.backends.mkl.is_available() else "other",
        "loadavg": loadavg(),
        "commit": git_state() or "n/a",
    }


class Interleaved:
    """Times named step functions interleaved round by round.

    ``run(rounds, warmup)`` calls every function once per round (rotated
    order), discards the first ``warmup`` rounds and keeps per-step
    times (wall clock, or CPU time after ``setup(clock="cpu")``) in
    ``self.times[name]``.
    """

    def __init__(self, steps: Mapping[str, Callable[[], object]]):
        self.steps = dict(steps)
        self.times: Dict[str, List[float]] = {k: [] for k in self.steps}

    def run(self, rounds: int, warmup: int = 1, progress: Optional[str] = None) -> "Interleaved":
        names = list(self.steps)
        for r in range(warmup + rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                t0 = _CLOCK()
                self.steps[name]()
                dt = _CLOCK() - t0
                if r >= warmup:
                    self.times[name].append(dt)
            if progress:
                print(f"  [{progress}] round {r + 1}/{warmup + rounds}  load {loadavg()}", file=sys.stderr, flush=True)
        return self


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> List[float]:
    return [x / y for x, y in zip(a, b) if y > 0]


def ratio_stats(times: Mapping[str, Sequence[float]], base: str) -> Dict[str, Dict[str, float]]:
    """Per variant: median, mean (s), ratio of medians, of means, median of paired ratios vs ``base``."""
    out = {}
    tb = times[base]
    for name, t in times.items():
        out[name] = {
            "median_s": statistics.median(t),
            "mean_s": statistics.fmean(t),
            "n": len(t),
            "ratio_median": statistics.median(t) / statistics.median(tb),
            "ratio_mean": statistics.fmean(t) / statistics.fmean(tb),
            "ratio_paired_median": statistics.median(paired_ratios(t, tb)),
        }
    return out


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (the growth exponent)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den if den > 0 else float("nan")


def fmt(v: object, nd: int = 3) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) >= 1e4 or abs(v) < 10 ** (-nd)):
            return f"{v:.2e}"
        return f"{v:.{nd}f}"
    return str(v)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]], nd: int = 3) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v, nd) for v in row) + " |")
    return "\n".join(lines)


def write_json(path: Optional[str], payload: Dict[str, object]) -> None:
    """``payload`` as JSON at ``path`` (nothing without one), with the machine that ran it (bench.py's provenance)."""
    if path:
        Path(path).write_text(json.dumps({"machine": machine_description(), **payload}, indent=1, default=str))


def command_line() -> str:
    rel = os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0]
    return "python " + " ".join([rel] + [a for a in sys.argv[1:]])
