"""The Fashion-MNIST budget study of docs/CONVERGENCE.md: frontier, paired differences, time to target.

    python docs/convergence.py run fm-val fm-test --jobs 2      # train (about 75 minutes on 2 cores)
    python docs/fashion_frontier.py                             # tables and figure from the runs
    python docs/fashion_frontier.py --runs DIR --out DIR        # elsewhere (the tests use tiny runs)

Reads ``fm-b<B>-s<S>/metrics.csv`` (budget ``B`` epochs, seed ``S``; the six methods interleaved in each run)
and writes ``fashion.md`` (tables) and ``fashion-frontier.png`` (figure) to ``--out``:

* the frontier: per method and budget, the final test accuracy (mean and 95 % t-interval over seeds) against
  the run's training seconds (the summed epoch times, evaluation excluded);
* paired differences from the baseline at every budget (same seed: same initial weights and data order);
* time to fixed targets: per method and seed, the fewest training seconds after which any epoch of any of its
  budget runs reached the target (the cheapest model seen to reach it); the paired ratio to the baseline's as a
  geometric mean with the t-interval of the logs, over the seeds where both reached it;
* per-epoch cost: each method's epoch time over the baseline's, paired by run and epoch.

Targets: each seed's baseline final accuracy at the largest budget (the issue's goal: the same model sooner),
and the fixed levels :data:`LEVELS`, chosen before the test runs from the validation runs' range.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from whitenlayers.experiment.config import METHOD_COLORS, METHOD_LABELS  # noqa: E402
from whitenlayers.experiment.report import (  # noqa: E402
    MAX_SPAN,
    MIN_SEEDS,
    geometric_t_interval,
    informative,
    no_estimate,
    read_metrics,
    t_interval,
)

#: Fixed accuracy targets (percent).
LEVELS = (85.0, 88.0, 90.0)
RUN = re.compile(r"^fm-b(\d+)-s(\d+)$")

Runs = Dict[Tuple[int, int], List[dict]]  # (budget, seed) -> metric rows


def load_runs(runs_dir: str) -> Runs:
    out: Runs = {}
    for name in sorted(os.listdir(runs_dir)):
        m = RUN.match(name)
        path = os.path.join(runs_dir, name, "metrics.csv")
        if m and os.path.isfile(os.path.join(runs_dir, name, "summary.md")):
            out[(int(m.group(1)), int(m.group(2)))] = read_metrics(path)
    return out


def _curve(rows: List[dict], method: str) -> List[dict]:
    return sorted((r for r in rows if r["method"] == method), key=lambda r: r["epoch"])


def methods_of(runs: Runs) -> List[str]:
    seen: List[str] = []
    for rows in runs.values():
        for r in rows:
            if r["method"] not in seen:
                seen.append(r["method"])
    return seen


def frontier(runs: Runs, method: str) -> Dict[int, Dict[int, Tuple[float, float]]]:
    """budget -> seed -> (final test accuracy, training seconds) of the complete runs."""
    out: Dict[int, Dict[int, Tuple[float, float]]] = {}
    for (b, s), rows in runs.items():
        c = _curve(rows, method)
        if len(c) == b:
            out.setdefault(b, {})[s] = (c[-1]["test_acc"], c[-1]["train_time"])
    return out


def time_to_target(runs: Runs, method: str, target: Union[float, Dict[int, float]]) -> Dict[int, float]:
    """seed -> the fewest training seconds at which an epoch of any budget run reached ``target`` (inf: never).

    ``target``: one accuracy, or one per seed (e.g. that seed's baseline final accuracy)."""
    out: Dict[int, float] = {}
    for (_, s), rows in runs.items():
        best = out.get(s, math.inf)
        goal = target.get(s, math.inf) if isinstance(target, dict) else target
        for r in _curve(rows, method):
            if r["test_acc"] >= goal:
                best = min(best, r["train_time"])
                break
        out[s] = best
    return out


def _fmt(m: float, lo: float, hi: float, d: int = 2, sign: bool = False) -> str:
    if not math.isfinite(m):
        return "—"
    f = f"{{:{'+' if sign else ''}.{d}f}}"
    return f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]" if math.isfinite(lo) else f.format(m)


def _ratio(ratios: Sequence[float], n: Optional[int] = None) -> str:
    """Geometric mean [95 %] of paired ratios; ``no estimate (k/n)`` over fewer than MIN_SEEDS of them or when
    the interval spans more than a factor MAX_SPAN (``n``: the pairs possible, default ``len(ratios)``)."""
    k, n = len(ratios), len(ratios) if n is None else n
    if k == 0:
        return "—"
    m, lo, hi = geometric_t_interval(ratios)
    if k < MIN_SEEDS or not informative(lo, hi, MAX_SPAN):
        return no_estimate(k, n)
    return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"


def tables(runs: Runs) -> Tuple[str, Dict[str, float]]:
    methods = methods_of(runs)
    budgets = sorted({b for b, _ in runs})
    fr = {m: frontier(runs, m) for m in methods}
    lines = ["### Frontier: final test accuracy (%) and training seconds per budget", "",
             "Mean [95 % t-interval] over seeds; seconds are the run's summed epoch times (evaluation excluded).", "",
             "| method | " + " | ".join(f"{b} epoch{'s' if b > 1 else ''}: acc / s" for b in budgets) + " | seeds |",
             "| --- | " + " | ".join("---" for _ in budgets) + " | --- |"]
    for m in methods:
        cells, n = [], set()
        for b in budgets:
            per = fr[m].get(b, {})
            n |= set(per)
            acc = [v[0] for v in per.values()]
            sec = [v[1] for v in per.values()]
            cells.append(f"{_fmt(*t_interval(acc))} / {np.mean(sec):.0f}" if per else "—")
        lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + f" | {len(n)} |")
    base = "baseline"
    lines += ["", "### Paired difference from the baseline (accuracy points; same seed)", "",
              "| method | " + " | ".join(f"{b} ep" for b in budgets) + " |",
              "| --- | " + " | ".join("---" for _ in budgets) + " |"]
    for m in methods:
        if m == base:
            continue
        cells = []
        for b in budgets:
            a, z = fr[m].get(b, {}), fr[base].get(b, {})
            d = [a[s][0] - z[s][0] for s in sorted(set(a) & set(z))]
            cells.append(_fmt(*t_interval(d), sign=True))
        lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    # per-epoch cost, paired by run and epoch
    lines += ["", "### Cost of an epoch relative to the baseline (same run, same epoch; geometric mean [95 %])", "",
              "| method | epoch time vs baseline |", "| --- | --- |"]
    for m in methods:
        if m == base:
            continue
        ratios = []
        for rows in runs.values():
            bt = {r["epoch"]: r["epoch_time"] for r in _curve(rows, base)}
            ratios += [r["epoch_time"] / bt[r["epoch"]] for r in _curve(rows, m) if r["epoch"] in bt]
        lines.append(f"| {METHOD_LABELS.get(m, m)} | {_ratio(ratios)} (n={len(ratios)}) |")
    # targets
    big = budgets[-1] if budgets else 0
    per_seed = {s: v[0] for s, v in fr[base].get(big, {}).items()}  # each seed's baseline final, largest budget
    base_final = float(np.mean(list(per_seed.values()))) if per_seed else math.nan
    targets: Dict[str, Union[float, Dict[int, float]]] = {
        f"the seed's baseline final at {big} ep (mean {base_final:.2f} %)": per_seed}
    targets.update({f"{t:g} %": t for t in LEVELS})
    lines += ["", "### Time to target (training seconds; any budget run, any epoch)", "",
              "Per seed the fewest training seconds after which an epoch reached the target; the ratio to the "
              "baseline's is paired by seed (geometric mean [95 %] over the seeds where both reached it); "
              f"'reached' counts seeds. 'no estimate (k/n)': fewer than {MIN_SEEDS} seeds reached the target, or "
              f"the ratio's interval spans more than a factor {MAX_SPAN:g}.", "",
              "| target | method | reached | seconds (mean) | vs baseline |", "| --- | --- | --- | --- | --- |"]
    summary: Dict[str, float] = {"baseline_final": base_final}
    for tname, t in targets.items():
        if not t:
            continue
        tb = time_to_target(runs, base, t)
        for m in methods:
            tm = time_to_target(runs, m, t)
            reached = [v for v in tm.values() if math.isfinite(v)]
            pairs = [tm[s] / tb[s] for s in tm if s in tb and math.isfinite(tm[s]) and math.isfinite(tb[s])]
            if isinstance(t, dict):  # the geometric mean, nan where the table says "no estimate"
                mean, lo, hi = geometric_t_interval(pairs) if m != base else (1.0, 1.0, 1.0)
                ok = m == base or (len(pairs) >= MIN_SEEDS and informative(lo, hi, MAX_SPAN))
                summary[f"ratio_{m}"] = mean if ok else math.nan
            sec = f"{np.mean(reached):.0f}" if len(reached) >= MIN_SEEDS else "no estimate" if reached else "—"
            rat = "1" if m == base else _ratio(pairs, len(tm))
            lines.append(f"| {tname} | {METHOD_LABELS.get(m, m)} | {len(reached)}/{len(tm)} | {sec} | {rat} |")
    loads = [r["load1"] for rows in runs.values() for r in rows if math.isfinite(r.get("load1", math.nan))]
    if loads:
        lines += ["", "Load during the runs (1-minute load average at the epochs' ends): "
                      f"median {np.median(loads):.2f}, range {min(loads):.2f}-{max(loads):.2f} on 2 cores "
                      "(two runs in parallel, one thread each)."]
    return "\n".join(lines) + "\n", summary


def figure(runs: Runs, path: str, target: Optional[float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for m in methods_of(runs):
        fr = frontier(runs, m)
        xs, ys, lo, hi = [], [], [], []
        for b in sorted(fr):
            acc = [v[0] for v in fr[b].values()]
            mean, a, z = t_interval(acc)
            xs.append(float(np.mean([v[1] for v in fr[b].values()])))
            ys.append(mean)
            lo.append(mean - a if math.isfinite(a) else 0.0)
            hi.append(z - mean if math.isfinite(z) else 0.0)
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=METHOD_COLORS.get(m),
                    label=METHOD_LABELS.get(m, m))
    if target is not None and math.isfinite(target):
        ax.axhline(target, ls="--", color="0.5", lw=1)
        ax.annotate(f"baseline's final accuracy at the largest budget ({target:.2f} %)", (ax.get_xlim()[0], target),
                    xytext=(4, 3), textcoords="offset points", fontsize=8, color="0.3")
    ax.set_xlabel("training seconds of the whole budget (2-core CPU, one thread per run)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("Fashion-MNIST, ResNet-8 (width 8): budgets of 1, 2, 4 epochs\n"
                 "mean and 95 % interval over paired seeds; one point per budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "convergence"))
    p.add_argument("--out", default=os.path.join(HERE, "convergence"))
    a = p.parse_args(argv)
    runs = load_runs(a.runs)
    if not runs:
        raise SystemExit(f"no finished fm-b<B>-s<S> runs under {a.runs}")
    text, summary = tables(runs)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fashion.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "fashion-summary.json"), "w") as f:
        json.dump({k: v if math.isfinite(v) else None for k, v in summary.items()}, f, indent=1)  # null: none
    figure(runs, os.path.join(a.out, "fashion-frontier.png"), summary.get("baseline_final"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
