"""The run's outputs: ``metrics.csv``, the summary table, the six-panel figure, ``config.json``.

Everything here reads or writes files of an output folder; nothing trains.
:func:`replot` redraws the figure and summary of a finished (or partial) run
from its ``metrics.csv`` and ``config.json`` alone. ``matplotlib`` is
imported only to draw the figure (it is in the ``experiment`` extra).
"""
from __future__ import annotations

import csv
import datetime
import glob
import json
import math
import os
import platform
import re
import shlex
import subprocess
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from .config import METHOD_LABELS, METHODS, RunConfig, fingerprint, model_spec
from .context import Context
from .data import DATASET_LABELS
from .figure import plot_metrics, rows_by_method

__all__ = ["CSV_FIELDS", "TIME_FIELDS", "write_metrics", "read_metrics", "summarize", "format_summary",
           "time_to_accuracy", "format_time_to_accuracy", "no_estimate_notes", "load_note", "MIN_SEEDS", "MAX_SPAN",
           "no_estimate", "informative", "plot_metrics", "replot", "format_epoch_line", "prepare_out", "STEP_FIELDS",
           "write_steps", "read_steps", "steps_to_target", "format_steps_to_target"]

CSV_FIELDS = ["method", "seed", "epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "kappa_mean",
              "kappa_sem", "rho_mean", "rho_sem", "epoch_time", "eval_time", "train_time", "cpu_time", "load1",
              "wall_clock"]
#: Columns that depend on the machine, not on the computation (``train_time``: cumulative ``epoch_time``;
#: ``cpu_time``: the process's CPU seconds in the epoch's training loop, all threads; ``load1``: the 1-minute
#: load average after the epoch; ``wall_clock``: Unix time after the epoch).
TIME_FIELDS = ("epoch_time", "eval_time", "train_time", "cpu_time", "load1", "wall_clock")
#: ``steps.csv`` (with ``--eval-every-steps``, ``--stop-acc`` or ``--max-steps``): one row per evaluation, every K
#: steps and at each epoch's end; ``step`` counts optimizer steps, ``examples`` the training images they saw
#: (``step`` x the global batch); ``train_time`` and ``cpu_time`` are the training's seconds up to that step,
#: evaluations excluded.
STEP_FIELDS = ["method", "seed", "step", "examples", "epoch", "lr", "test_loss", "test_acc", "train_time", "cpu_time",
               "wall_clock"]


def format_epoch_line(row: Dict[str, Any], epochs: int) -> str:
    """The line printed after each epoch."""
    w = len(str(epochs))
    return (f"{METHOD_LABELS[row['method']]:>12s} seed {row['seed']}  epoch {row['epoch']:{w}d}/{epochs}  "
            f"lr {row['lr']:.3g}  loss {row['train_loss']:.4f}  train {row['train_acc']:6.2f}%  "
            f"test {row['test_acc']:6.2f}%  kappa {row['kappa_mean']:.3f}±{row['kappa_sem']:.3f}  "
            f"rho {row['rho_mean']:.3f}±{row['rho_sem']:.3f}  time {row['epoch_time']:.1f}s")


# ==========================================================================
# CSV and summary
# ==========================================================================
def write_metrics(rows: Iterable[Dict[str, Any]], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:  # rows of a run resumed from an older checkpoint may lack the newer columns
            w.writerow({k: r.get(k, float("nan")) for k in CSV_FIELDS})
    os.replace(tmp, path)


def write_steps(rows: Iterable[Dict[str, Any]], path: str) -> None:
    """``steps.csv`` (:data:`STEP_FIELDS`), written to a temporary file and renamed."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=STEP_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, float("nan")) for k in STEP_FIELDS})
    os.replace(tmp, path)


def read_steps(path: str) -> List[Dict[str, Any]]:
    """Rows of a ``steps.csv`` with numbers parsed."""
    out: List[Dict[str, Any]] = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: Dict[str, Any] = dict(r)
            for k in ("seed", "step", "examples", "epoch"):
                row[k] = int(r[k])
            for k in STEP_FIELDS[5:]:
                row[k] = float(r[k]) if r.get(k) not in (None, "") else float("nan")
            out.append(row)
    return out


def steps_to_target(rows: Sequence[Dict[str, Any]], level: float) -> Dict[str, Dict[int, Dict[str, float]]]:
    """Per method and seed of ``steps.csv`` rows: the first evaluation at or above ``level`` percent, as
    ``{"step", "examples", "train_time", "cpu_time"}`` (nan where no evaluation reached it), and ``"budget"``, the
    steps the run took.

    Example:
        >>> rows = [dict(method="grad", seed=0, step=s, examples=8 * s, test_acc=a, train_time=s / 10, cpu_time=s / 10)
        ...         for s, a in ((10, 50.0), (20, 81.0), (30, 85.0))]
        >>> steps_to_target(rows, 80.0)["grad"][0]["step"], steps_to_target(rows, 90.0)["grad"][0]["budget"]
        (20.0, 30.0)
    """
    nan = float("nan")
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    for r in sorted(rows, key=lambda r: (r["method"], r["seed"], r["step"])):
        rec = out.setdefault(r["method"], {}).setdefault(
            r["seed"], dict(step=nan, examples=nan, train_time=nan, cpu_time=nan, budget=0.0))
        rec["budget"] = max(rec["budget"], float(r["step"]))
        if not math.isfinite(rec["step"]) and r["test_acc"] >= level:
            rec.update(step=float(r["step"]), examples=float(r["examples"]), train_time=float(r["train_time"]),
                       cpu_time=float(r["cpu_time"]))
    return out


def format_steps_to_target(rows: Sequence[Dict[str, Any]], level: float) -> str:
    """A Markdown table: per method, the steps (and examples, training seconds) to ``level`` percent per seed,
    and how many seeds reached it."""
    lines = [f"| method | steps to {level:g}% per seed | examples | training s | reached |", "|---|---|---|---|---|"]
    def cell(seeds: Dict[int, Dict[str, float]], key: str, fmt: str) -> str:
        return ", ".join(format(v[key], fmt) if math.isfinite(v[key]) else f">{v['budget']:.0f} steps"
                         if key == "step" else "—" for v in seeds.values())

    for m, seeds in steps_to_target(rows, level).items():
        lines.append(f"| {METHOD_LABELS.get(m, m)} | {cell(seeds, 'step', '.0f')} | {cell(seeds, 'examples', '.0f')} | "
                     f"{cell(seeds, 'train_time', '.1f')} | {sum(math.isfinite(v['step']) for v in seeds.values())}/"
                     f"{len(seeds)} |")
    return "\n".join(lines)


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """Rows of a ``metrics.csv`` with numbers parsed."""
    out: List[Dict[str, Any]] = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: Dict[str, Any] = dict(r)
            row["seed"], row["epoch"] = int(r["seed"]), int(r["epoch"])
            for k in CSV_FIELDS[3:]:
                row[k] = float(r[k]) if r.get(k) not in (None, "") else float("nan")
            if not math.isfinite(row["train_time"]):  # an older CSV: cumulate the epoch times
                done = [q for q in out if q["method"] == row["method"] and q["seed"] == row["seed"]]
                row["train_time"] = sum(q["epoch_time"] for q in done) + row["epoch_time"]
            out.append(row)
    return out


def _mean_std(values: Sequence[float]) -> Tuple[float, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def _fmt(mean: float, std: float, nseeds: int, digits: int = 2) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if nseeds > 1 else "")


#: The default target accuracy of the summary's 'epochs to' column, as a fraction of the lowest, over the methods,
#: of the best test accuracy of a method's curve averaged over seeds (rounded down to 0.1 point): every method's
#: mean curve reaches it.
TARGET_FRACTION = 0.99


def summarize(rows: Sequence[Dict[str, Any]], methods: Optional[Sequence[str]] = None,
              target_acc: Optional[float] = None) -> Tuple[List[Dict[str, Any]], float]:
    """Per-method summary: final/best accuracy, epochs to target, last kappa/rho, epoch time (and vs baseline).

    Returns the summary rows and the target accuracy used: ``target_acc``, or by default
    :data:`TARGET_FRACTION` of the lowest best mean-over-seeds accuracy of the methods, rounded down to 0.1.
    """
    groups = rows_by_method(rows)
    methods = [m for m in (methods or METHODS) if m in groups] + [m for m in groups if m not in (methods or METHODS)]
    if target_acc is None:
        bests = []
        for m in methods:
            curves = [np.array([r["test_acc"] for r in lst]) for lst in groups[m].values()]
            length = min(len(c) for c in curves)
            bests.append(float(np.mean([c[:length] for c in curves], axis=0).max()))
        target_acc = math.floor(TARGET_FRACTION * min(bests) * 10) / 10 if bests else 0.0
    out = []
    base_time = None
    for m in methods:
        seeds = groups[m]
        final = [lst[-1]["test_acc"] for lst in seeds.values()]
        best = [max(r["test_acc"] for r in lst) for lst in seeds.values()]
        reach = []
        for lst in seeds.values():
            hit = [r["epoch"] for r in lst if r["test_acc"] >= target_acc]
            reach.append(hit[0] if hit else float("nan"))
        times = [float(np.mean([r["epoch_time"] for r in lst])) for lst in seeds.values()]
        s: Dict[str, Any]
        s = dict(method=m, seeds=len(seeds), epochs=max(len(lst) for lst in seeds.values()),
                 final_acc=_mean_std(final), best_acc=_mean_std(best),
                 epochs_to_target=_mean_std([v for v in reach if math.isfinite(v)]),
                 reached=sum(math.isfinite(v) for v in reach),
                 kappa=_mean_std([lst[-1]["kappa_mean"] for lst in seeds.values()]),
                 rho=_mean_std([lst[-1]["rho_mean"] for lst in seeds.values()]),
                 epoch_time=_mean_std(times))
        if m == "baseline":
            base_time = s["epoch_time"][0]
        out.append(s)
    for s in out:
        s["time_ratio"] = s["epoch_time"][0] / base_time if base_time else float("nan")
    return out, target_acc


def format_summary(summary: Sequence[Dict[str, Any]], target: float) -> str:
    head = ["method", "final acc (%)", "best acc (%)", f"epochs to {target:.1f}%", "kappa (last)", "rho (last)",
            "epoch time (s)", "time vs baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    # The ignores below: mypy spreads a starred Any (a (mean, std) pair here) over every parameter of _fmt.
    for s in summary:
        n = s["seeds"]
        ratio = f"{s['time_ratio']:.2f}x" if math.isfinite(s["time_ratio"]) else "n/a"
        lines.append("| " + " | ".join([
            METHOD_LABELS.get(s["method"], s["method"]),
            _fmt(*s["final_acc"], n), _fmt(*s["best_acc"], n), _reach_cell(s)[0],  # type: ignore[call-arg]
            _fmt(*s["kappa"], n, 3), _fmt(*s["rho"], n, 3), _fmt(*s["epoch_time"], n, 1),  # type: ignore[call-arg]
            ratio]) + " |")
    return "\n".join(lines)


def _reach_cell(s: Dict[str, Any]) -> Tuple[str, Optional[str]]:
    """The summary table's 'epochs to' cell of the row ``s``, and why it gives no estimate (None where it gives one):
    :func:`no_estimate` where fewer than :data:`MIN_SEEDS` seeds reach the target."""
    n, reached = s["seeds"], s["reached"]
    if reached == 0:
        return "not reached", None
    if reached < MIN_SEEDS:
        return no_estimate(reached, n), _too_few(reached, n)
    reach = _fmt(*s["epochs_to_target"], reached, 1)  # type: ignore[call-arg]
    return reach + (f" ({reached}/{n} seeds)" if reached < n else ""), None


# ==========================================================================
# Time to accuracy
# ==========================================================================
def _first_reach(lst: Sequence[Dict[str, Any]], level: float) -> Tuple[float, float]:
    """(epoch, cumulative training seconds) at which test accuracy first reaches ``level``; nan when never."""
    elapsed = 0.0
    for r in lst:
        elapsed = r["train_time"] if math.isfinite(r.get("train_time", float("nan"))) else elapsed + r["epoch_time"]
        if r["test_acc"] >= level:
            return float(r["epoch"]), float(elapsed)
    return float("nan"), float("nan")


def t_interval(values: Sequence[float]) -> Tuple[float, float, float]:
    """Mean and the 95 % Student-t interval ``(mean, low, high)`` of the finite values (nan with fewer than two).

    Example:
        >>> [round(v, 3) for v in t_interval([1.0, 2.0, 3.0])]
        [2.0, -0.484, 4.484]
    """
    a = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if a.size == 0:
        return float("nan"), float("nan"), float("nan")
    if a.size == 1:
        return float(a[0]), float("nan"), float("nan")
    half = T95[min(a.size - 1, len(T95)) - 1] * a.std(ddof=1) / math.sqrt(a.size)
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


_t_interval = t_interval  # the name the study scripts of earlier versions imported


def geometric_t_interval(values: Sequence[float]) -> Tuple[float, float, float]:
    """Geometric mean and 95 % interval of positive ratios: :func:`t_interval` of their logarithms, mapped back.

    A ratio's interval then stays positive and is symmetric in ``a/b`` against ``b/a`` (an arithmetic interval
    of ratios 0.5x and 2.0x would reach below zero). Non-positive and non-finite values are left out.

    Example:
        >>> [round(v, 3) for v in geometric_t_interval([0.9, 1.1, 1.0, 1.2])]
        [1.044, 0.857, 1.271]
    """
    logs = [math.log(v) for v in values if math.isfinite(v) and v > 0]
    mean, lo, hi = (math.exp(v) if math.isfinite(v) else v for v in t_interval(logs))
    return mean, lo, hi


#: Two-sided 95 % Student-t quantiles for 1..30 degrees of freedom (30 and beyond: 2.042, ~normal).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def time_to_accuracy(rows: Sequence[Dict[str, Any]], methods: Optional[Sequence[str]] = None,
                     levels: Sequence[float] = ()) -> List[Dict[str, Any]]:
    """Per method: epochs and cumulative training seconds to the baseline's final accuracy and to fixed levels.

    The target of seed ``s`` is the baseline's final test accuracy on seed
    ``s`` (paired: same initial weights and data order). Per method the result
    holds, for each seed, ``(epoch, seconds)`` to that target (nan when not
    reached) and ``ratio``, the method's seconds over the baseline's (on the
    same seed); ``levels`` gives the same at fixed accuracies. Seconds are
    the training loop's (``train_time``, the cumulative ``epoch_time``), so
    evaluation is not counted. Without a baseline the target part is empty.
    """
    groups = rows_by_method(rows)
    methods = [m for m in (methods or METHODS) if m in groups] + [m for m in groups if m not in (methods or METHODS)]
    base = groups.get("baseline", {})
    targets = {seed: lst[-1]["test_acc"] for seed, lst in base.items()}
    base_reach = {seed: _first_reach(lst, targets[seed]) for seed, lst in base.items()}
    out = []
    for m in methods:
        seeds = groups[m]
        per_seed = {}
        for seed, lst in sorted(seeds.items()):
            cpu = [r.get("cpu_time", float("nan")) for r in lst]
            rec: Dict[str, Any] = {"final": lst[-1]["test_acc"], "epochs_run": len(lst),
                                   "train_time": lst[-1].get("train_time", float("nan")),
                                   "epoch_time": float(np.mean([r["epoch_time"] for r in lst])),
                                   "cpu_time": float(np.nanmean(cpu)) if any(map(math.isfinite, cpu)) else float("nan")}
            if seed in targets:
                ep, sec = _first_reach(lst, targets[seed])
                cpu = [r.get("cpu_time", float("nan")) for r in lst]
                cpu_sec = float(np.sum(cpu[:int(ep)])) if math.isfinite(ep) else float("nan")
                base_ep = base_reach[seed][0]
                base_cpu = float(np.sum([r.get("cpu_time", float("nan")) for r in base[seed][:int(base_ep)]])) \
                    if math.isfinite(base_ep) else float("nan")
                rec.update(cpu_seconds=cpu_sec, cpu_ratio=cpu_sec / base_cpu if base_cpu > 0 else float("nan"))
                rec.update(target=targets[seed], epoch=ep, seconds=sec,
                           ratio=sec / base_reach[seed][1] if base_reach[seed][1] > 0 else float("nan"),
                           epoch_ratio=ep / base_reach[seed][0] if base_reach[seed][0] > 0 else float("nan"))
            rec["levels"] = {lv: _first_reach(lst, lv) for lv in levels}
            per_seed[seed] = rec
        out.append({"method": m, "seeds": per_seed})
    return out


#: Marks an interval clipped to the possible range (explained under the table).
CLIPPED = "†"
#: Fewest seeds that must reach a target before a mean or interval over seeds of the time to it is printed.
MIN_SEEDS = 3
#: Widest 95 % interval of a positive quantity (seconds, time ratios) that is printed, as ``high / low``; an
#: interval reaching 0 or below spans an infinite factor.
MAX_SPAN = 4.0
#: What a cell says instead of an interval that carries no information (with the count of seeds, ``(k/n)``).
NO_ESTIMATE = "no estimate"


def no_estimate(k: int, n: int) -> str:
    """The cell printed instead of a mean and interval: ``no estimate (k/n)``, ``k`` of ``n`` seeds reached it.

    Example:
        >>> no_estimate(2, 5)
        'no estimate (2/5)'
    """
    return f"{NO_ESTIMATE} ({k}/{n})"


def informative(low: float, high: float, max_span: float = MAX_SPAN) -> bool:
    """Whether the interval ``[low, high]`` of a positive quantity carries information: ``low > 0`` and
    ``high / low <= max_span``.

    Example:
        >>> informative(0.9, 1.3), informative(0.03, 49.94), informative(-29.8, 211.6)
        (True, False, False)
    """
    return math.isfinite(low) and math.isfinite(high) and low > 0 and high <= max_span * low


def _too_few(k: int, n: int) -> str:
    """Why a cell that only ``k`` of ``n`` seeds reached gives no estimate."""
    return f"only {k} of {n} seeds reached the target, fewer than the {MIN_SEEDS} an estimate needs"


def _uninformative(vals: Sequence[float], lo: float, hi: float, suffix: str, max_span: float) -> str:
    """Why a cell whose seeds' ``vals`` have the 95 % interval ``[lo, hi]`` (not :func:`informative`) gives no
    estimate: the values and the interval (to 3 significant digits, which a cell's rounding may hide) and what is
    wrong with it."""
    shown = ", ".join(f"{v:#.3g}{suffix}" for v in vals)
    interval = f"[{lo:#.3g}, {hi:#.3g}]"
    if not lo > 0:
        return f"the seeds' values {shown} give a 95 % interval {interval} that reaches 0"
    return (f"the seeds' values {shown} give a 95 % interval {interval} that spans a factor {hi / lo:.1f}, more "
            f"than {max_span:g}")


def _ci_cell(values: Sequence[float], digits: int = 2, suffix: str = "", *, lower: Optional[float] = None,
             upper: Optional[float] = None, geometric: bool = False,
             max_span: Optional[float] = None) -> Tuple[str, Optional[str]]:
    """:func:`_mean_ci`'s cell, and why it gives no estimate (None where it gives one, or where no seed reached
    the target: the cell says so)."""
    n = len(values)
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "—", None
    if len(vals) < MIN_SEEDS:
        return no_estimate(len(vals), n), _too_few(len(vals), n)
    mean, lo, hi = (geometric_t_interval if geometric else t_interval)(vals)
    if max_span is not None and not informative(lo, hi, max_span):
        return no_estimate(len(vals), n), _uninformative(vals, lo, hi, suffix, max_span)
    text = f"{mean:.{digits}f}{suffix}"
    if math.isfinite(lo):
        clipped = (lower is not None and lo < lower) or (upper is not None and hi > upper)
        lo = max(lo, lower) if lower is not None else lo
        hi = min(hi, upper) if upper is not None else hi
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]" + (CLIPPED if clipped else "")
    return text + ("" if len(vals) == n else f" ({len(vals)}/{n})"), None


def _mean_ci(values: Sequence[float], digits: int = 2, suffix: str = "", *, lower: Optional[float] = None,
             upper: Optional[float] = None, geometric: bool = False, max_span: Optional[float] = None) -> str:
    """``mean [low, high] (k/n)``: the 95 % t-interval (``geometric``: of the logs, for ratios) over the ``k``
    finite of the ``n`` values (one per seed; nan where the seed did not reach the target), clipped to
    ``[lower, upper]`` (the possible range) and then marked with :data:`CLIPPED`.

    :func:`no_estimate` instead when fewer than :data:`MIN_SEEDS` values are finite, or, with ``max_span``
    (a positive quantity: seconds, ratios), when the interval reaches 0 or spans more than that factor.
    ``—`` when no value is finite.
    """
    return _ci_cell(values, digits, suffix, lower=lower, upper=upper, geometric=geometric, max_span=max_span)[0]


def format_time_to_accuracy(tta: Sequence[Dict[str, Any]], levels: Sequence[float] = ()) -> str:
    """The time-to-accuracy table (Markdown): mean over seeds, 95 % t-intervals in brackets; k/n = seeds reaching.

    A cell reads ``no estimate (k/n)`` instead when fewer than :data:`MIN_SEEDS` seeds reach the target, or,
    for seconds and time ratios, when the interval reaches 0 or spans more than a factor :data:`MAX_SPAN`.
    """
    head = _time_head(levels)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for t in tta:
        lines.append("| " + " | ".join(cell for cell, _ in _time_cells(t, levels)) + " |")
    return "\n".join(lines)


#: The time-to-accuracy table's columns of seconds to the target and of their paired ratio to the baseline's, which
#: the notes under the tables set side by side.
SECONDS_TO_TARGET = "seconds to target"
PAIRED_RATIO = "time vs baseline (paired)"


def _time_head(levels: Sequence[float]) -> List[str]:
    """The columns of the time-to-accuracy table."""
    head = ["method", "final acc (%)", "target: baseline final (%)", "epochs to target", SECONDS_TO_TARGET,
            PAIRED_RATIO, "CPU time vs baseline (paired)"]
    head += [f"s to {lv:g}%" for lv in levels]
    return head + ["train s (total)", "CPU s / wall s"]


def _time_cells(t: Dict[str, Any], levels: Sequence[float]) -> List[Tuple[str, Optional[str]]]:
    """One method's row of the time-to-accuracy table (:func:`_time_head`'s columns): each cell, and why it gives
    no estimate (None where it gives one)."""
    recs = list(t["seeds"].values())
    n = len(recs)
    cells: List[Tuple[str, Optional[str]]] = [(METHOD_LABELS.get(t["method"], t["method"]), None),
                                              (_fmt(*_mean_std([r["final"] for r in recs]), n), None)]
    if any("target" in r for r in recs):
        reached = any(math.isfinite(r["epoch"]) for r in recs)
        cells += [(_fmt(*_mean_std([r["target"] for r in recs]), n), None),
                  _ci_cell([r["epoch"] for r in recs], 1, lower=1.0, upper=float(max(r["epochs_run"] for r in recs)))
                  if reached else (f"not reached (0/{n})", None),
                  _ci_cell([r["seconds"] for r in recs], 1, max_span=MAX_SPAN),
                  _ci_cell([r["ratio"] for r in recs], 2, "x", geometric=True, max_span=MAX_SPAN),
                  _ci_cell([r.get("cpu_ratio", float("nan")) for r in recs], 2, "x", geometric=True,
                           max_span=MAX_SPAN)]
    else:
        cells += [("—", None)] * 5
    for lv in levels:
        secs = [r["levels"][lv][1] for r in recs]
        k = sum(math.isfinite(v) for v in secs)
        if k == 0:
            cells.append(("—", None))
        elif k < MIN_SEEDS:
            cells.append((no_estimate(k, n), _too_few(k, n)))
        else:
            mean = float(np.mean([v for v in secs if math.isfinite(v)]))
            cells.append((f"{mean:.1f}" + ("" if k == n else f" ({k}/{n})"), None))
    cpu = [r["cpu_time"] / r["epoch_time"] for r in recs if r["epoch_time"] > 0 and math.isfinite(r["cpu_time"])]
    cells += [(_fmt(*_mean_std([r["train_time"] for r in recs]), n, 1), None),
              (f"{np.mean(cpu):.2f}" if cpu else "n/a", None)]
    return cells


def no_estimate_notes(summary: Sequence[Dict[str, Any]], target: float, tta: Sequence[Dict[str, Any]],
                      levels: Sequence[float] = ()) -> str:
    """Why each cell of the two tables that reads ``no estimate (k/n)`` gives none, one line per cell, with the
    seeds' values where they were too spread (empty when every cell gives an estimate). Written under the tables
    of ``summary.md``.

    Args:
        summary: :func:`summarize`'s rows; ``target``: its target accuracy (the first table's 'epochs to').
        tta: :func:`time_to_accuracy`'s result, and its ``levels``.
    """
    notes = []
    for s in summary:
        why = _reach_cell(s)[1]
        if why:
            notes.append(f"- {METHOD_LABELS.get(s['method'], s['method'])}, epochs to {target:.1f}%: {why}.")
    head = _time_head(levels)
    seconds_without_ratio = False  # a cell of seconds without an estimate beside a paired ratio with one
    for t in tta:
        row = dict(zip(head, _time_cells(t, levels)))
        for column, (_, why) in row.items():
            if why:
                notes.append(f"- {METHOD_LABELS.get(t['method'], t['method'])}, {column}: {why}.")
        seconds_without_ratio |= row[SECONDS_TO_TARGET][1] is not None and row[PAIRED_RATIO][1] is None
    if not notes:
        return ""
    text = "Why no estimate:\n" + "\n".join(notes)
    if seconds_without_ratio:
        text += ("\n\nSeconds to target can have no estimate beside a paired time ratio that has one: how long a "
                 "seed takes to reach its target varies with the seed (its initial weights and data order, and its "
                 "own target), for the baseline as for the method; the paired ratio divides each seed's seconds by "
                 "the baseline's on the same seed, which cancels that variation.")
    return text


def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ...", "AMD EPYC ..."): Linux's ``/proc/cpuinfo``, macOS's ``sysctl``,
    else the platform's processor (which on Linux says only "x86_64"). A rerun is comparable to the bit only on the
    same model."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            import subprocess

            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def l3_cache() -> Optional[str]:
    """The size of the CPU's level-3 cache as Linux reports it ("32 MiB"; sysfs, else ``lscpu``); None elsewhere.
    The model name alone does not fix the machine (a hypervisor may report "AMD EPYC" for parts of 8 to 384 MiB
    of L3), and the cache is what shared CPUs contend for."""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(index, "level")) as fh:
                if fh.read().strip() != "3":
                    continue
            with open(os.path.join(index, "size")) as fh:
                size = fh.read().strip()  # e.g. "32768K"
        except OSError:
            continue
        if size.endswith("K") and size[:-1].isdigit():
            kib = int(size[:-1])
            return f"{kib // 1024} MiB" if kib % 1024 == 0 else f"{kib} KiB"
        return size
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"^L3 cache:\s*(\S+ \S+)", text, re.MULTILINE)
    return found.group(1) if found else None


def cpu_description() -> str:
    """The CPU as a page names it: model and L3 cache, e.g. ``"AMD EPYC, 32 MiB L3"``."""
    l3 = l3_cache()
    return cpu_model() + (f", {l3} L3" if l3 else "")


def load_note(rows: Sequence[Dict[str, Any]], threads: Optional[int] = None, cores: Optional[int] = None) -> str:
    """A line on the machine's load during the run; flags the run when it changed notably.

    Notable: the 1-minute load average's range over the epochs exceeds half the
    machine's cores (or 1), or some epochs' CPU-to-wall ratio differs from the
    median by more than 25 % (the process got less of the CPU than at other
    times; epochs under 0.5 s are too short to say). Timing comparisons then rest on the interleaving alone.
    """
    cores = cores or os.cpu_count() or 1
    loads = np.array([r.get("load1", float("nan")) for r in rows], dtype=float)
    loads = loads[np.isfinite(loads)]
    ratios = np.array([r["cpu_time"] / r["epoch_time"] for r in rows
                       if math.isfinite(r.get("cpu_time", float("nan"))) and r["epoch_time"] > 0.5], dtype=float)
    if loads.size == 0:
        return "Machine load: not recorded."
    spread = float(loads.max() - loads.min())
    flags = []
    if spread > max(1.0, 0.5 * cores):
        flags.append(f"the 1-minute load average ranged {loads.min():.2f}-{loads.max():.2f} on {cores} cores")
    if ratios.size >= 2:
        med = float(np.median(ratios))
        off = int(np.sum(np.abs(ratios - med) > 0.25 * med))
        if off:
            flags.append(f"{off} of {ratios.size} epochs had a CPU/wall ratio more than 25 % away from the median "
                         f"{med:.2f}")
    text = (f"Machine load: 1-minute load average {loads.min():.2f}-{loads.max():.2f} (mean {loads.mean():.2f}) on "
            f"{cores} cores" + (f", {threads} thread(s) per process" if threads else "") + ".")
    if loads.mean() > cores:
        text += " The machine was oversubscribed (load above its cores): absolute times are inflated."
    if flags:
        text += (" **Flag: the load changed notably during the run** (" + "; ".join(flags) + "). Methods trained "
                 "interleaved epoch by epoch (--order interleaved, the default) still shared it alike; compare "
                 "absolute times with care.")
    return text

def title(cfg: RunConfig, data_label: str) -> str:
    """The figure's and summary's title."""
    kind, depth = model_spec(cfg.model)
    model = "ResNet-50 (torchvision)" if kind == "torchvision" else f"CIFAR ResNet-{depth}"
    if kind == "cifar" and int(cast(int, cfg.width)) != 16:  # width and seeds: resolved in __post_init__
        model += f" (width {cfg.width})"
    nseeds = len(cast(List[int], cfg.seeds))
    seeds = (f"{nseeds} seeds, mean ± std" if nseeds > 1
             else f"seed {cast(List[int], cfg.seeds)[0]}, band ± s.e. over layers")
    pooled = int(cast(int, cfg.downsample))  # resolved in __post_init__
    data_label += f" (pooled {pooled}x{pooled})" if pooled > 1 else ""
    return (f"{data_label}, {model}: {int(cfg.epochs)} epochs, batch {cfg.batch_size}, "
            f"lr {cfg.lr:g} ({cfg.schedule})  [{seeds}]")


# ==========================================================================
# Summary file, replot, output folder
# ==========================================================================
def target_note(target: float, given: bool) -> str:
    """What the summary's target accuracy is and how it was chosen (``given``: by ``--target-acc``)."""
    text = f"Target accuracy {target:.1f}%: the level of the first table's 'epochs to {target:.1f}%' column, "
    if given:
        text += "set by --target-acc."
    else:
        text += (f"chosen so that every method's curve averaged over seeds reaches it: {TARGET_FRACTION * 100:g} % "
                 f"of the lowest, over the methods, of that curve's best test accuracy, rounded down to 0.1 "
                 f"(--target-acc sets another).")
    return text + " The second table's target is another: each seed's baseline final accuracy."


def summary_text(title: str, table: str, target: float, wall: Optional[float], target_given: bool = False) -> str:
    """``summary.md``: the title, the tables (with their notes), what the target accuracy is (``target_given``: set
    by ``--target-acc``) and what the columns mean, and the total wall time."""
    text = (f"# {title}\n\n{table}\n\n{target_note(target, target_given)} Epoch time = training loop only "
            f"(forward, backward, step), mean over epochs; accuracies are test accuracies in percent; kappa and rho "
            f"at the last epoch, mean over layers. Time to accuracy (second table): per seed, the first epoch at "
            f"which test accuracy reaches that seed's baseline final accuracy (or a fixed level) and the cumulative "
            f"training seconds to the end of that epoch (evaluation not counted); mean over seeds with a 95 % "
            f"t-interval in brackets, (k/n) when only k of n seeds reach it; {CLIPPED} marks an interval clipped to "
            f"the possible range (epochs from the first to the last run). '{NO_ESTIMATE} (k/n)': fewer than "
            f"{MIN_SEEDS} seeds reached the target, or the interval of seconds or of a ratio reaches 0 or spans more "
            f"than a factor {MAX_SPAN:g} (upper/lower): the seeds say nothing about it. 'time vs baseline' is the "
            f"paired ratio of seconds to target on the same seed, its geometric mean with the interval of the logs "
            f"(a ratio's interval stays positive); 'CPU time vs baseline' the same with the process's CPU "
            f"seconds, which a busy machine inflates less than wall-clock seconds. The first table's 'epochs to' "
            f"follows the same rule (mean ± std over the seeds that reach it).")
    if wall is not None:
        text += f" Total wall time {wall:.0f} s."
    return text + "\n"


def replot(out: str, target_acc: Optional[float] = None) -> Tuple[str, str]:
    """Redraw ``figure.png`` and ``summary.md`` of a finished (or partial) run from its CSV and config."""
    rows = read_metrics(os.path.join(out, "metrics.csv"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = RunConfig.from_record(json.load(f))
    name = title(cfg, DATASET_LABELS.get(cfg.dataset, cfg.dataset))
    fig_path = os.path.join(out, "figure.png")
    plot_metrics(rows, fig_path, name, cfg.methods)
    given = target_acc if target_acc is not None else cfg.target_acc
    summary, target = summarize(rows, cfg.methods, given)
    table = format_summary(summary, target)
    tta = time_to_accuracy(rows, cfg.methods, cfg.time_levels)
    table += "\n\n" + format_time_to_accuracy(tta, cfg.time_levels)
    notes = no_estimate_notes(summary, target, tta, cfg.time_levels)
    if notes:
        table += "\n\n" + notes
    table += "\n\n" + load_note(rows, cfg.threads)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_text(name, table, target, None, target_given=given is not None))
    print(table)
    return fig_path, table


def git_state() -> Optional[str]:
    """``<commit>`` (``+dirty`` when the package has uncommitted changes) of the source tree, if it is a git checkout.

    Also what ``benchmarks/`` and ``docs/coverage.py`` record next to their tables."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def prepare_out(cfg: RunConfig, ctx: Context, argv: Sequence[str]) -> None:
    """Rank 0: check a resumed run's configuration, or clear an earlier run; write ``config.json``."""
    out = cast(str, cfg.out)  # resolved in RunConfig.__post_init__
    cfg_path = os.path.join(out, "config.json")
    record = cfg.to_record()
    if ctx.is_main:
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
        if cfg.resume and os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                old = json.load(f)
            a, b = fingerprint(old), fingerprint(record)
            a.update(methods=old["methods"], seeds=old["seeds"])
            b.update(methods=record["methods"], seeds=record["seeds"])
            if a != b:
                diff = sorted(k for k in set(a) | set(b) if json.dumps(a.get(k)) != json.dumps(b.get(k)))
                raise RuntimeError(f"--resume: the configuration differs from the run in {out} ({', '.join(diff)})")
        elif not cfg.resume:
            ckdir = os.path.join(out, "checkpoints")
            stale = [f for f in os.listdir(ckdir) if f.endswith(".pt")]
            for f in stale:
                os.remove(os.path.join(ckdir, f))
            for name in ("metrics.csv", "steps.csv", "summary.md", "figure.png"):
                if os.path.exists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            if stale:
                print(f"note: starting afresh in {out} (an earlier run there was discarded; use --resume to continue)",
                      flush=True)
        rank_dir = os.path.join(out, "ranks")
        if os.path.isdir(rank_dir):
            for f in os.listdir(rank_dir):
                os.remove(os.path.join(rank_dir, f))
        record.update(
            git=git_state(),
            command=" ".join(["python -m whitenlayers.experiment"] + [shlex.quote(a) for a in argv]),
            world_size=ctx.world, device=str(ctx.device), threads=ctx.threads, torch=torch.__version__,
            python=platform.python_version(), platform=platform.platform(),
            processor=platform.processor() or platform.machine(), cpu_model=cpu_model(), cpu_l3=l3_cache(),
            cpu=cpu_description(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
            started=datetime.datetime.now().isoformat(timespec="seconds"),
        )
        with open(cfg_path, "w") as f:
            json.dump(record, f, indent=2, default=str)
    ctx.barrier()


