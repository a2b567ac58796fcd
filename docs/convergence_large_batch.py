"""The large-batch stages' tables and figure (``python docs/convergence.py tables lb-time lb-val lb``).

Steps to a target validation accuracy against the batch size (Shallue et al. 2018): per batch and arm the rate
chosen on the validation seed, the steps (and examples) to the target over the measured seeds, the paired ratio
to the baseline's steps, each arm's critical batch size, and the seconds per step of every arm at every batch.
Everything is read from the runs under ``runs/convergence``; nothing here trains.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import convergence as cv  # noqa: E402  (its constants read at call time: a test may shrink the stage)
import numpy as np
from convergence import (  # noqa: E402
    _lb_budget,
    _lb_chosen,
    _lb_grid,
    _lb_name,
    _lb_rate,
    _lb_reach,
    _lb_score,
    _lb_time,
    _lb_val_name,
    _rows,
)

from whitenlayers.experiment.report import geometric_t_interval, read_steps

#: Doubling the batch must cut the steps to the target by at least this factor to count as still scaling.
SPEEDUP = 1.5
#: The goal's threshold: the best whitened arm's steps at most this fraction of the baseline's.
GOAL = 0.7
LABELS = {"baseline": "baseline", "grad": "grad", "grad-damped": "grad, damped gains", "recursive": "recursive",
          "kfac": "K-FAC", "soap": "SOAP", "muon": "Muon"}
COLORS = {"baseline": "#444444", "grad": "#1f77b4", "grad-damped": "#2ca02c", "recursive": "#d62728",
          "kfac": "#9467bd", "soap": "#17becf", "muon": "#ff7f0e"}


def _cmd(name: str) -> str:
    from convergence_tables import _cmd as cmd
    return cmd(name)


def _machine(cfgs: Sequence[dict]) -> str:
    """The CPU(s), torch and library commit(s) the runs' ``config.json`` name."""
    # cpu_model (and cpu_count); runs written before that key: cpu; before either, the architecture only
    cpus = sorted({str(c.get("cpu_model") or c["cpu"]) for c in cfgs if c.get("cpu_model") or c.get("cpu")})
    cpus = cpus or sorted({str(c.get("processor")) for c in cfgs})
    commits = sorted({str(c.get("git")) for c in cfgs})
    torch = sorted({str(c.get("torch")) for c in cfgs})
    return f"{' / '.join(cpus)}, torch {', '.join(torch)}, one thread; library commit {', '.join(commits)}"


def _every_text() -> str:
    return ", ".join(f"{cv._lb_every(b)} at {b}" for b in cv.LB_BATCHES)


def _geo(vals: Sequence[float]) -> float:
    v = [x for x in vals if math.isfinite(x) and x > 0]
    return float(np.exp(np.mean(np.log(v)))) if v else float("nan")


def _ratio_cell(vals: Sequence[float], n: int) -> str:
    """Paired ratios: geometric mean [95 % t-interval of the logs] (k pairs); too few: the values."""
    v = [x for x in vals if math.isfinite(x) and x > 0]
    if len(v) < 3:
        return ("—" if not v else ", ".join(f"{x:.2f}x" for x in v)) + f" ({len(v)}/{n} pairs)"
    m, lo, hi = geometric_t_interval(v)
    return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]" + (f" ({len(v)}/{n})" if len(v) < n else "")


# --------------------------------------------------------------------------
# Seconds per step
# --------------------------------------------------------------------------
def seconds_per_step() -> Dict[Tuple[int, str], Tuple[float, float]]:
    """(batch, arm) -> (CPU seconds, wall seconds) per step over steps 11-30 of the lb-time runs."""
    out: Dict[Tuple[int, str], Tuple[float, float]] = {}
    for name, args in _lb_time():
        if _rows(name) is None:
            continue
        batch = int(args[args.index("--batch-size") + 1])
        rows = read_steps(os.path.join(cv.RUNS, name, "steps.csv"))
        for method in {r["method"] for r in rows}:
            by = {r["step"]: r for r in rows if r["method"] == method}
            if 10 not in by or 30 not in by:
                continue
            plain = [a for a in cv.LB_ARMS if cv.LB_ARMS[a][0] == method and not cv.LB_ARMS[a][1]]
            arm = "grad-damped" if name.endswith("-damped") else plain[0]
            out[batch, arm] = ((by[30]["cpu_time"] - by[10]["cpu_time"]) / 20,
                               (by[30]["train_time"] - by[10]["train_time"]) / 20)
    return out


def lb_time_table() -> str:
    sps = seconds_per_step()
    arms = list(cv.LB_TIME_ARMS[:2]) + ["grad-damped"] + list(cv.LB_TIME_ARMS[2:])
    head = ["batch"] + [LABELS[a] for a in arms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in cv.LB_BATCHES:
        if (b, "baseline") not in sps:
            lines.append(f"| {b} | (not run) |" + " |" * (len(head) - 2))
            continue
        base = sps[b, "baseline"][0]
        cells = [f"{sps[b, a][0]:.4g} ({sps[b, a][0] / base:.2f}x)" if (b, a) in sps else "—" for a in arms]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    cfgs = [json.load(open(os.path.join(cv.RUNS, n, "config.json"))) for n, _ in _lb_time() if _rows(n) is not None]
    where = f"\n\nMachine: {_machine(cfgs)}." if cfgs else ""
    cmds = [n for n, _ in _lb_time() if n.startswith("lb-time-b32")]
    gpu = [(n, a) for n, a in _lb_time(["--device", "cuda"]) if n.startswith("lb-time-gpu-b32")]
    from convergence import command
    from convergence_tables import wrap_command
    gpu_cmds = "\n".join("    " + wrap_command(" ".join(["python"] + command(n, a)[1:]).replace(
        os.path.dirname(cv.RUNS) + "/", "runs/").replace(os.path.dirname(os.path.dirname(cv.RUNS)) + "/", ""))
        for n, a in gpu)
    return ("CPU seconds per training step (process CPU time over steps 11-30, evaluations excluded; in brackets "
            "against the baseline at the same batch). One run per batch, the arms interleaved every 10 steps; "
            "the damped gains in a second run right after (a run-wide flag)." + where + "\n\n" + "\n".join(lines)
            + "\n\nCommands (batch 32; the other batches change `--batch-size`, `--train-subset` (10 batches), the "
            "rates and `--out`):\n\n" + "\n".join(f"    {_cmd(n)}" for n in cmds)
            + "\n\nThe GPU row (not measured here; `python docs/convergence.py run lb-time-gpu` on a machine with "
            "CUDA, then the same table from `runs/convergence/lb-time-gpu-*`), batch 32:\n\n" + gpu_cmds + "\n")


# --------------------------------------------------------------------------
# The validation grids
# --------------------------------------------------------------------------
def _trial_cell(batch: int, arm: str, k: int, chosen: Optional[int]) -> str:
    score = _lb_score(batch, arm, k)
    lr = f"{_lb_rate(arm, batch, k):g}"
    if score is None:
        return f"{lr} → (not run)"
    text = f"{lr} → {score[0]:.0f}" if math.isfinite(score[0]) else f"{lr} → >{_lb_budget(batch)} ({-score[1]:.1f} %)"
    return f"**{text}**" if k == chosen else text


def lb_val_table() -> str:
    lines = ["| batch | arm | rate → steps to the target (not reached: > budget, best accuracy) | chosen rate |",
             "|---|---|---|---|"]
    for b in cv.LB_BATCHES:
        for arm in cv.LB_ARMS:
            ks, chosen, _ = _lb_grid(b, arm)
            cells = " · ".join(_trial_cell(b, arm, k, chosen) for k in sorted(ks))
            lines.append(f"| {b} | {LABELS[arm]} | {cells} | "
                         f"{'—' if chosen is None else format(_lb_rate(arm, b, chosen), 'g')} |")
    first = _lb_val_name(cv.LB_BATCHES[0], "baseline", 0)
    return (f"Seed {cv.LB_VAL_SEED}, target {cv.LB_TARGET:g} % validation accuracy; steps are those of the first "
            f"evaluation at or above it (evaluations every N steps: {_every_text()}). A grid's trials ran centre "
            "rate first, each with its step budget cut to the fewest steps to the target so far (`>N`: not "
            "reached within N steps, its best accuracy in brackets). Bold: the chosen rate.\n\n"
            + "\n".join(lines) + f"\n\nCommand (batch {cv.LB_BATCHES[0]}, baseline, one rate; the others change "
            f"`--batch-size`, `--methods`, the rates, `--max-steps`, `--eval-every-steps` and `--out`, and add "
            f"`--gains damped` for the damped arm):\n\n    {_cmd(first)}\n")


# --------------------------------------------------------------------------
# Steps to the target
# --------------------------------------------------------------------------
def measurements() -> Tuple[Dict[Tuple[int, str], Dict[int, Dict[str, float]]], Dict[int, List[int]]]:
    """(batch, arm) -> seed -> reach record, for the finished runs whose seed's baseline run at that batch finished
    too; and per batch the seeds whose baseline run finished."""
    chosen = _lb_chosen()
    data: Dict[Tuple[int, str], Dict[int, Dict[str, float]]] = {}
    seeds_at: Dict[int, List[int]] = {}
    for b in cv.LB_BATCHES:
        for s in cv.LB_SEEDS + cv.LB_MORE_SEEDS:
            base = _lb_reach(_lb_name(b, "baseline", s), "baseline")
            if base is None or s not in base or (b, "baseline") not in chosen:
                continue
            seeds_at.setdefault(b, []).append(s)
            for a in cv.LB_ARMS:
                rec = _lb_reach(_lb_name(b, a, s), a) if (b, a) in chosen else None
                if rec is not None and s in rec:
                    data.setdefault((b, a), {})[s] = rec[s]
    return data, seeds_at


def critical_batch(steps: Dict[int, float]) -> Tuple[Optional[int], str]:
    """The critical batch of a steps-per-batch curve: the smallest measured batch ``b`` from which doubling no
    longer cuts the steps to the target by SPEEDUP (``steps(b) / steps(2b) < SPEEDUP``); ``None`` (beyond the
    range) when every doubling did. With the text of the cell.

    Example:
        >>> critical_batch({32: 800.0, 64: 400.0, 128: 210.0, 256: 180.0, 512: 170.0})
        (128, '128')
        >>> critical_batch({32: 800.0, 64: 400.0})
        (None, '> 64')
    """
    bs = sorted(b for b, v in steps.items() if math.isfinite(v))
    for b, b2 in zip(bs, bs[1:]):
        if b2 == 2 * b and steps[b] / steps[b2] < SPEEDUP:
            return b, str(b)
    return None, f"> {bs[-1]}" if bs else "—"


def lb_table() -> str:
    data, seeds_at = measurements()
    chosen = _lb_chosen()
    sps = seconds_per_step()
    if not data:
        return "(not run)\n"
    head = ["batch", "arm", "rate", "seeds", "steps to target: geo. mean [min, max]", "reached", "examples to target",
            "paired ratio to baseline's steps [95 % CI]", "CPU s / step", "CPU s to target (steps x s/step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    curve: Dict[str, Dict[int, float]] = {a: {} for a in cv.LB_ARMS}
    per_seed_curve: Dict[str, Dict[int, Dict[int, float]]] = {a: {} for a in cv.LB_ARMS}
    ratios: Dict[Tuple[int, str], List[float]] = {}
    for b in cv.LB_BATCHES:
        if b not in seeds_at:
            lines.append(f"| {b} | (not run) |" + " |" * (len(head) - 2))
            continue
        base = data[b, "baseline"]
        for arm in cv.LB_ARMS:
            recs = data.get((b, arm), {})
            seeds = sorted(recs)
            if not seeds:
                lines.append(f"| {b} | {LABELS[arm]} | (not run) |" + " |" * (len(head) - 3))
                continue
            steps = [recs[s]["step"] for s in seeds]
            reached = [v for v in steps if math.isfinite(v)]
            g = _geo(steps) if len(reached) == len(steps) else float("nan")
            curve[arm][b] = g
            for s in seeds:
                per_seed_curve[arm].setdefault(s, {})[b] = recs[s]["step"]
            r = [recs[s]["step"] / base[s]["step"] for s in seeds]
            ratios[b, arm] = r
            cpu = sps.get((b, arm), (float("nan"), 0.0))[0]
            cell = (f"{g:.0f} [{min(reached):.0f}, {max(reached):.0f}]" if math.isfinite(g) else
                    (f"not reached on {len(steps) - len(reached)} (budget {_lb_budget(b)})"))
            lines.append("| " + " | ".join([
                str(b), LABELS[arm], f"{chosen[b, arm]:g}", ", ".join(map(str, seeds)), cell,
                f"{len(reached)}/{len(steps)}",
                f"{g * b:,.0f}" if math.isfinite(g) else "—",
                "—" if arm == "baseline" else _ratio_cell(r, len(seeds)),
                f"{cpu:.4g}" if math.isfinite(cpu) else "—",
                f"{g * cpu:.0f}" if math.isfinite(g * cpu) else "—"]) + " |")
    crit = ["| arm | critical batch (geometric means) | per seed |", "|---|---|---|"]
    for arm in cv.LB_ARMS:
        per = [critical_batch(per_seed_curve[arm][s])[1] for s in sorted(per_seed_curve[arm])
               if len(per_seed_curve[arm][s]) == len(cv.LB_BATCHES)]
        crit.append(f"| {LABELS[arm]} | {critical_batch(curve[arm])[1]} | {', '.join(per) or '—'} |")
    others = [a for a in cv.LB_ARMS if a != "baseline"]
    goal = ["| batch | best whitened arm (validation seed) | its paired ratio [95 % CI] | <= 0.7x, interval "
            "below 1 | " + " | ".join(LABELS[a] for a in others) + " |", "|" + "---|" * (4 + len(others))]
    met = []
    for b in cv.LB_BATCHES:
        if b not in seeds_at:
            continue
        bw = cv._lb_best_whitened(b)
        r = [x for x in ratios.get((b, bw), []) if math.isfinite(x) and x > 0] if bw else []
        ok = False
        if len(r) >= 3:
            m, lo, hi = geometric_t_interval(r)
            ok = m <= GOAL and hi < 1.0
        if ok:
            met.append(b)
        goal.append("| " + " | ".join([str(b), LABELS[bw] if bw else "—",
                                      _ratio_cell(ratios.get((b, bw), []), len(seeds_at[b])) if bw else "—",
                                      "yes" if ok else "no"]
                                     + [_ratio_cell(ratios.get((b, a), []), len(data.get((b, a), {})))
                                        for a in others]) + " |")
    verdict = (f"The best whitened arm needs <= {GOAL}x the baseline's steps, with an interval below 1, at batch "
               f"{', '.join(map(str, met))}." if met else
               f"At no batch measured ({min(seeds_at)}-{max(seeds_at)}) does the best whitened arm need <= {GOAL}x "
               "the baseline's steps with a paired interval below 1.")
    plot(curve, per_seed_curve)
    n_seeds = sorted({len(v) for v in seeds_at.values()})
    cfgs = [json.load(open(os.path.join(cv.RUNS, _lb_name(b, "baseline", s), "config.json")))
            for b in seeds_at for s in seeds_at[b]]
    first = [_lb_name(cv.LB_BATCHES[0], a, cv.LB_SEEDS[0]) for a in cv.LB_ARMS]
    more = [b for b in seeds_at if len(seeds_at[b]) > len(cv.LB_SEEDS)]
    return (f"Target: {cv.LB_TARGET:g} % validation accuracy. Seed {', '.join(map(str, cv.LB_ALL_ARMS_SEEDS))}: every "
            f"arm; seeds {', '.join(str(s) for s in cv.LB_SEEDS if s not in cv.LB_ALL_ARMS_SEEDS)}: the baseline and, "
            "at each batch, the whitened arm with the fewest steps on the validation seed (sized to a 2-core "
            "machine: the other arms' rows rest on seed 1 alone)"
            + (f"; seeds {', '.join(map(str, cv.LB_MORE_SEEDS))} added at batch {', '.join(map(str, more))}"
               if more else "")
            + f" ({'-'.join(map(str, n_seeds))} baseline seeds per batch). "
            f"Steps: the first evaluation at or above the target (every N steps: {_every_text()}); "
            "geometric means over seeds. Ratios: per seed the arm's steps over the baseline's (same "
            "initial weights and data order), geometric mean and 95 % t-interval of the logs. Examples = steps x "
            f"batch. CPU s / step: the lb-time table. Machine: {_machine(cfgs)}.\n\n"
            + "\n".join(lines) + "\n\n### Paired ratio to the baseline's steps, per batch\n\n" + "\n".join(goal)
            + f"\n\n{verdict}\n\n### Critical batch size\n\nThe smallest batch from which doubling it no longer cuts "
            f"the steps to the target by {SPEEDUP}x (`> B`: every doubling measured did, up to B).\n\n"
            + "\n".join(crit) + "\n\n![Steps and examples to the target against the batch size](lb.png)\n\n"
            f"Commands (batch {cv.LB_BATCHES[0]}, seed {cv.LB_SEEDS[0]}; the others change `--batch-size`, the rate, "
            "`--max-steps`, `--eval-every-steps`, `--seeds` and `--out`):\n\n"
            + "\n".join(f"    {_cmd(n)}" for n in first) + "\n")


def plot(curve: Dict[str, Dict[int, float]], per_seed: Dict[str, Dict[int, Dict[int, float]]],
         path: Optional[str] = None) -> Optional[str]:
    """The Shallue-style figure: steps (left) and examples (right) to the target against the batch, log-log, a
    line per arm (geometric mean over seeds), each seed a dot, the perfect-scaling line through the baseline's
    smallest batch."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the experiment extra has matplotlib
        return None
    path = path or os.path.join(cv.OUT, "lb.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, scale, ylabel in ((axes[0], False, "steps to target"), (axes[1], True, "examples to target")):
        for i, arm in enumerate(cv.LB_ARMS):
            pts = sorted((b, v) for b, v in curve[arm].items() if math.isfinite(v))
            if not pts:
                continue
            jitter = 1.0 + 0.025 * (i - len(cv.LB_ARMS) / 2)  # the dots side by side
            for by in per_seed[arm].values():
                xs = [b for b in sorted(by) if math.isfinite(by[b])]
                ax.scatter([b * jitter for b in xs], [by[b] * (b if scale else 1) for b in xs], s=8,
                           color=COLORS[arm], alpha=0.45, linewidths=0)
            ax.plot([b for b, _ in pts], [v * (b if scale else 1) for b, v in pts], "-o", ms=3.5, lw=1.6,
                    color=COLORS[arm], label=LABELS[arm])
        base = sorted((b, v) for b, v in curve["baseline"].items() if math.isfinite(v))
        if base:
            b0, s0 = base[0]
            xs = np.array([b for b in cv.LB_BATCHES if b >= b0], float)
            ax.plot(xs, s0 * b0 / xs * (xs if scale else 1), "--", color="#999999", lw=1,
                    label="perfect scaling (baseline)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.set_xticks(list(cv.LB_BATCHES))
        ax.set_xticklabels([str(b) for b in cv.LB_BATCHES])
        ax.grid(True, which="both", alpha=0.25)
    axes[0].legend(fontsize=8, frameon=False)
    fig.suptitle(f"Fashion-MNIST, ResNet-8 width 8, SGD momentum 0.9 (SOAP its own): steps to {cv.LB_TARGET:g} % "
                 "validation accuracy", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
