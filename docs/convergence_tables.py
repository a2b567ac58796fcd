"""Tables of docs/CONVERGENCE.md from the runs under runs/convergence (``python docs/convergence.py tables``)."""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Dict, List, Sequence

import numpy as np
from convergence import OUT, RUNS, STAGES, _chosen, _rows  # noqa: E402

from whitenlayers.experiment.config import METHOD_LABELS, RunConfig
from whitenlayers.experiment.report import (
    MIN_SEEDS,
    format_time_to_accuracy,
    load_note,
    no_estimate,
    t_interval,
    time_to_accuracy,
)


def _by(rows, method):
    out: Dict[int, List[dict]] = {}
    for r in rows:
        if r["method"] == method:
            out.setdefault(r["seed"], []).append(r)
    return {s: sorted(v, key=lambda r: r["epoch"]) for s, v in sorted(out.items())}


def _ms(vals: Sequence[float], d: int = 2) -> str:
    a = np.asarray([v for v in vals if math.isfinite(v)], float)
    if a.size == 0:
        return "—"
    return f"{a.mean():.{d}f} ± {a.std(ddof=1):.{d}f}" if a.size > 1 else f"{a[0]:.{d}f}"


def _ci(vals: Sequence[float], d: int = 2) -> str:
    """A paired difference: mean [95 % t-interval]; ``no estimate (k/n)`` over fewer than MIN_SEEDS seeds."""
    k = sum(math.isfinite(v) for v in vals)
    if k == 0:
        return "—"
    if k < MIN_SEEDS:
        return no_estimate(k, len(vals))
    m, lo, hi = t_interval(vals)
    return f"{m:+.{d}f} [{lo:+.{d}f}, {hi:+.{d}f}]"


def _lr(cfg: dict, method: str) -> float:
    """The rate ``method`` trained at: ``--method-lr``, else the method's own default (library peers), else ``--lr``."""
    return RunConfig.from_record(cfg).method_lr_for(method)


def _cmd(name: str) -> str:
    p = os.path.join(RUNS, name, "command.txt")
    return wrap_command(open(p).read().strip()) if os.path.isfile(p) else "(not run)"


def wrap_command(cmd: str, width: int = 96) -> str:
    """``cmd`` as an indented code block's lines of at most ``width`` characters (so the page does not scroll
    sideways): broken before an option (an option and its value stay together), continued with `` \\``.

    A single option longer than the line (a long ``--method-lr`` list) stays whole.

    >>> print(wrap_command("python -m whitenlayers.experiment --methods a,b --lr 0.1 --seeds 0-4", 60))
    python -m whitenlayers.experiment --methods a,b \\
            --lr 0.1 --seeds 0-4
    """
    groups: List[str] = []
    for tok in cmd.split():
        if groups and not tok.startswith("--") and (groups[-1].startswith("--") and " " not in groups[-1]
                                                    or not groups[-1].startswith("--")):
            groups[-1] += " " + tok
        else:
            groups.append(tok)
    lines = [""]
    for g in groups:
        room = width - 4 - (4 if len(lines) > 1 else 0) - 2  # the block's indent, the continuation's, " \\"
        if lines[-1] and len(lines[-1]) + 1 + len(g) > room:
            lines.append(g)
        else:
            lines[-1] = f"{lines[-1]} {g}" if lines[-1] else g
    return " \\\n        ".join(lines)  # 4 (the block) + 4


def grid_table(stage: str) -> str:
    """Validation grid: per method and learning rate, final validation accuracy (mean ± std over seeds)."""
    runs = STAGES[stage]()
    cols, table, methods = [], {}, []
    for name, _ in runs:
        rows = _rows(name)
        if rows is None:
            continue
        cfg = json.load(open(os.path.join(RUNS, name, "config.json")))
        cols.append(name)
        for m in cfg["methods"]:
            if m not in methods:
                methods.append(m)
            lr = _lr(cfg, m)
            finals = [lst[-1]["test_acc"] for lst in _by(rows, m).values()]
            epoch = float(np.mean([np.mean([r["epoch_time"] for r in lst]) for lst in _by(rows, m).values()]))
            base = float(np.mean([np.mean([r["epoch_time"] for r in lst]) for lst in _by(rows, "baseline").values()]))
            table.setdefault(m, []).append((lr, finals, epoch / base))
    if not cols:
        return f"(stage {stage}: not finished)\n"
    try:
        chosen = _chosen(stage, methods)
    except SystemExit:
        chosen = {}
    head = "| method | " + " | ".join(f"{c}: lr → val acc (%)" for c in cols) + \
           " | chosen lr | epoch time vs baseline |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    for m in methods:
        cells = []
        for lr, finals, _ in table[m]:
            txt = f"{lr:g} → {_ms(finals)}"
            if lr == chosen.get(m):
                txt = f"**{txt}**"
            if any(not math.isfinite(v) or v <= 12 for v in finals):
                txt += f" ({sum(not math.isfinite(v) or v <= 12 for v in finals)} diverged)"
            cells.append(txt)
        ratio = np.mean([t[2] for t in table[m]])
        lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(cells) +
                     f" | {chosen.get(m, float('nan')):g} | {ratio:.2f}x |")
    cmds = "\n".join(f"    {_cmd(n)}" for n in cols)  # wrapped: continuation lines carry their own indent
    return "\n".join(lines) + f"\n\nCommands:\n\n{cmds}\n"


def test_table(name: str) -> str:
    """A test run at the chosen settings: time to accuracy, paired accuracy differences, kappa/rho, step ratio."""
    rows = _rows(name)
    if rows is None:
        return f"(run {name}: not finished)\n"
    cfg = json.load(open(os.path.join(RUNS, name, "config.json")))
    methods = cfg["methods"]
    tta = time_to_accuracy(rows, methods, cfg["time_levels"])
    text = format_time_to_accuracy(tta, cfg["time_levels"])
    base = _by(rows, "baseline")
    head = ["method", "lr", "test acc (%) mean ± std", "paired Δ acc vs baseline [95 % CI]",
            "paired Δ acc at epoch 2 [95 % CI]", "epoch time vs baseline (paired)", "kappa (last)", "rho (last)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        runs = _by(rows, m)
        seeds = sorted(set(runs) & set(base))
        d_final = [runs[s][-1]["test_acc"] - base[s][-1]["test_acc"] for s in seeds]
        d_e2 = [runs[s][1]["test_acc"] - base[s][1]["test_acc"] for s in seeds if len(runs[s]) > 1]
        ratio = [np.mean([r["epoch_time"] for r in runs[s]]) / np.mean([r["epoch_time"] for r in base[s]])
                 for s in seeds]
        lr = _lr(cfg, m)
        lines.append("| " + " | ".join([
            METHOD_LABELS.get(m, m), f"{lr:g}", _ms([v[-1]["test_acc"] for v in runs.values()]),
            _ci(d_final) if m != "baseline" else "—", _ci(d_e2) if m != "baseline" else "—",
            f"{np.mean(ratio):.2f}x", _ms([v[-1]["kappa_mean"] for v in runs.values()], 3),
            _ms([v[-1]["rho_mean"] for v in runs.values()], 3)]) + " |")
    note = load_note(rows, 1)
    return (f"Command:\n\n    {_cmd(name)}\n\nTime to accuracy:\n\n{text}\n\nAccuracy and cost:\n\n" + "\n".join(lines)
            + f"\n\n{note}\n")


#: The paired stages: stage -> (label of the reference run, label of the variant run).
PAIRED = {"stats-val": ("full", "0.25"), "every-val": ("every forward", "stats_every=2"),
          "every10-val": ("every forward", "stats_every=5")}


def stats_table(stage: str) -> str:
    """The reference run against the variant run (:data:`PAIRED`), paired by seed across the two runs of each
    dataset: full statistics against ``stats_fraction=0.25``, or every forward against ``stats_every=2``."""
    ref, var = PAIRED[stage]
    against = "baseline" if "baseline" in STAGES[stage]()[0][1][1] else ref
    lines = [f"| dataset | method | {ref}: val acc (%) | {var}: val acc (%) | paired Δ final [95 % CI] | "
             f"paired Δ at epoch 2 [95 % CI] | CPU s / epoch vs {against}: {ref} → {var} |", "|" + "---|" * 7]
    cmds = []
    for full_name, sub_name in zip(*[iter([n for n, _ in STAGES[stage]()])] * 2):
        full, sub = _rows(full_name), _rows(sub_name)
        if full is None or sub is None:
            return f"(stage {stage}: not finished)\n"
        cmds += [_cmd(full_name), _cmd(sub_name)]
        dataset = json.load(open(os.path.join(RUNS, full_name, "config.json")))["dataset"]
        base = _by(full, "baseline")
        # without a baseline in the runs (every10-val): CPU time relative to the reference run's
        cpu_base = np.mean([r["cpu_time"] for lst in base.values() for r in lst]) if base else None
        for m in ("grad", "recursive"):
            a, b = _by(full, m), _by(sub, m)
            seeds = sorted(set(a) & set(b))
            cpu = [np.mean([r["cpu_time"] for lst in runs.values() for r in lst]) for runs in (a, b)]
            cpu = [c / (cpu_base if cpu_base is not None else cpu[0]) for c in cpu]
            lines.append("| " + " | ".join([
                dataset, METHOD_LABELS.get(m, m), _ms([a[s][-1]["test_acc"] for s in seeds]),
                _ms([b[s][-1]["test_acc"] for s in seeds]),
                _ci([b[s][-1]["test_acc"] - a[s][-1]["test_acc"] for s in seeds]),
                _ci([b[s][1]["test_acc"] - a[s][1]["test_acc"] for s in seeds]),
                f"{cpu[0]:.2f}x → {cpu[1]:.2f}x"]) + " |")
    return "\n".join(lines) + "\n\nCommands:\n\n" + "\n".join(f"    {c}" for c in cmds) + "\n"


def write_tables(stages: Sequence[str] = ()) -> None:
    """Write ``OUT/<stage>.md`` for ``stages`` (default: every stage) and ``OUT/all.md`` from every stage's file."""
    os.makedirs(OUT, exist_ok=True)
    parts = []
    for stage in STAGES:
        path = os.path.join(OUT, f"{stage}.md")
        if stages and stage not in stages:
            if os.path.isfile(path):
                parts.append(open(path).read())
            continue
        runs = STAGES[stage]()
        if stage in PAIRED:
            body = stats_table(stage)
        elif stage.endswith("-val"):
            body = grid_table(stage)
        else:
            body = "\n".join(test_table(n) for n, a in runs if a is not None) or "(not run)\n"
            for n, a in runs:
                fig = os.path.join(RUNS, n, "figure.png")
                if a is not None and os.path.isfile(fig) and _rows(n) is not None:
                    shutil.copyfile(fig, os.path.join(OUT, f"{n}.png"))
                    body += f"\n![{n}]({os.path.basename(OUT)}/{n}.png)\n"
        with open(path, "w") as f:
            f.write(f"## {stage}\n\n{body}")
        parts.append(f"## {stage}\n\n{body}")
    with open(os.path.join(OUT, "all.md"), "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {OUT}/*.md")
