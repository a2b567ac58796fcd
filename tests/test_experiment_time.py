"""Time to accuracy (whitenlayers.experiment.report.time_to_accuracy) on hand-made metrics tables, and the load flag."""
from __future__ import annotations

import math

import pytest

from whitenlayers.experiment import report


def _row(method, seed, epoch, acc, t, loss=1.0, cpu=None, load=1.0):
    return dict(method=method, seed=seed, epoch=epoch, lr=0.1, train_loss=loss, train_acc=acc, test_loss=loss,
                test_acc=acc, kappa_mean=0.5, kappa_sem=0.0, rho_mean=0.5, rho_sem=0.0, epoch_time=t,
                eval_time=0.1, cpu_time=t if cpu is None else cpu, load1=load, wall_clock=0.0)


def _table():
    rows = []
    # seed 0: baseline final 90 reached at epoch 3 (1 + 1 + 1 = 3 s); grad reaches 90 at epoch 2 (2 + 2 = 4 s).
    for e, (b, g) in enumerate([(50, 70), (80, 91), (90, 95)], 1):
        rows += [_row("baseline", 0, e, b, 1.0), _row("grad", 0, e, g, 2.0, cpu=1.0)]  # grad waited half its time
    # seed 1: baseline final 85 (first reached at epoch 2, 2 s; the dip at epoch 3 does not move it);
    # grad reaches 85 at epoch 1 (2 s); recursive never does.
    for e, (b, g, r) in enumerate([(60, 86, 10), (86, 88, 20), (85, 89, 30)], 1):
        rows += [_row("baseline", 1, e, b, 1.0), _row("grad", 1, e, g, 2.0), _row("recursive", 1, e, r, 1.0)]
    # seed 2: baseline final 88 reached at epoch 3 (3 s); grad reaches 88 at epoch 2 (4 s).
    for e, (b, g) in enumerate([(60, 70), (80, 89), (88, 90)], 1):
        rows += [_row("baseline", 2, e, b, 1.0), _row("grad", 2, e, g, 2.0)]
    for r in rows:  # the runner writes the cumulative training time
        r["train_time"] = sum(q["epoch_time"] for q in rows if q["method"] == r["method"] and q["seed"] == r["seed"]
                              and q["epoch"] <= r["epoch"])
    return rows


def test_time_to_baseline_final_accuracy_is_paired_per_seed():
    tta = {t["method"]: t["seeds"] for t in report.time_to_accuracy(_table(), ["baseline", "grad", "recursive"],
                                                                     levels=(88.0, 99.0))}
    assert tta["baseline"][0]["target"] == 90 and tta["baseline"][1]["target"] == 85
    assert (tta["baseline"][0]["epoch"], tta["baseline"][0]["seconds"]) == (3, 3.0)
    assert (tta["baseline"][1]["epoch"], tta["baseline"][1]["seconds"]) == (2, 2.0)
    assert (tta["grad"][0]["epoch"], tta["grad"][0]["seconds"]) == (2, 4.0)
    assert (tta["grad"][1]["epoch"], tta["grad"][1]["seconds"]) == (1, 2.0)
    assert tta["grad"][0]["ratio"] == pytest.approx(4.0 / 3.0) and tta["grad"][1]["ratio"] == pytest.approx(1.0)
    assert tta["grad"][0]["epoch_ratio"] == pytest.approx(2 / 3)
    assert tta["grad"][0]["cpu_seconds"] == 2.0 and tta["grad"][0]["cpu_ratio"] == pytest.approx(2.0 / 3.0)
    assert math.isnan(tta["recursive"][1]["seconds"]) and math.isnan(tta["recursive"][1]["epoch"])
    assert tta["grad"][0]["levels"][88.0] == (2.0, 4.0)
    assert all(math.isnan(v) for v in tta["baseline"][1]["levels"][88.0])  # seed 1's baseline peaks at 86
    assert all(math.isnan(v) for v in tta["grad"][1]["levels"][99.0])


def test_time_to_accuracy_table_text():
    rows = _table()
    text = report.format_time_to_accuracy(report.time_to_accuracy(rows, ["baseline", "grad", "recursive"], (88.0,)),
                                          (88.0,))
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()[2:]}
    head = [c.strip() for c in text.splitlines()[0].split("|")[2:-1]]
    base, grad = dict(zip(head, cells["baseline"])), dict(zip(head, cells["EVD (grad)"]))
    assert base["seconds to target"].startswith("2.7 [")  # mean of 3, 2 and 3 s
    # the paired ratios 4/3, 1, 4/3: geometric mean (16/9)^(1/3), interval [0.80, 1.83] (a factor 2.3)
    assert grad["time vs baseline (paired)"] == "1.21x [0.80, 1.83]"
    # grad's seconds 4, 2, 4: the interval [0.47, 6.20] spans more than a factor 4 -> no estimate, with the count
    assert grad["seconds to target"] == "no estimate (3/3)"
    # CPU ratios 2/3, 1, 4/3: the interval [0.40, 2.30] spans more than a factor 4
    assert grad["CPU time vs baseline (paired)"] == "no estimate (3/3)"
    assert base["s to 88%"] == "no estimate (2/3)" and grad["s to 88%"] == "4.0"  # seed 1's baseline peaks at 86
    assert "not reached (0/1)" in cells["recursive"]


def test_fewer_than_three_seeds_give_no_estimate():
    """Two seeds reach the target: the count and "no estimate" instead of a mean and a meaningless interval."""
    rows = [r for r in _table() if r["seed"] < 2]
    text = report.format_time_to_accuracy(report.time_to_accuracy(rows, ["baseline", "grad"], (88.0,)), (88.0,))
    grad = next(line for line in text.splitlines() if line.startswith("| EVD (grad)"))
    cells = [c.strip() for c in grad.split("|")[2:-1]]
    assert cells[2:6] == ["no estimate (2/2)"] * 4  # epochs, seconds, time ratio, CPU ratio
    assert "[" not in grad
    summary, target = report.summarize(rows, ["baseline", "grad"], target_acc=88.0)
    assert "no estimate (2/2)" in report.format_summary(summary, target)


def test_no_estimate_rule():
    assert report.informative(0.9, 1.3) and not report.informative(0.03, 49.94)  # "1.28x [0.03, 49.94]"
    assert not report.informative(-29.8, 211.6) and not report.informative(0.0, 1.0)
    assert report.informative(1.0, 4.0) and not report.informative(1.0, 4.01)
    assert report._mean_ci([1.0, 1.1, float("nan")], 2, "x", geometric=True, max_span=4.0) == "no estimate (2/3)"
    assert report._mean_ci([0.5, 1.0, 8.0], 2, "x", geometric=True, max_span=4.0) == "no estimate (3/3)"
    assert report._mean_ci([1.0, 1.1, 1.2, float("nan")], 2, "x", geometric=True, max_span=4.0).endswith("(3/4)")
    assert report._mean_ci([float("nan")] * 3, 1) == "—"


def test_t_interval():
    mean, lo, hi = report._t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-4) and lo < mean


def test_older_csv_gets_cumulative_time(tmp_path):
    rows = _table()
    path = str(tmp_path / "m.csv")
    for r in rows:
        r.pop("train_time")
    report.write_metrics(rows, path)
    back = report.read_metrics(path)
    grad0 = [r["train_time"] for r in back if r["method"] == "grad" and r["seed"] == 0]
    assert grad0 == [2.0, 4.0, 6.0]


def test_load_flag():
    steady = [_row("baseline", 0, e, 50, 2.0, load=1.0) for e in (1, 2, 3)]
    assert "Flag" not in report.load_note(steady, 1, cores=2)
    moved = [_row("baseline", 0, e, 50, 2.0, load=l) for e, l in ((1, 0.5), (2, 4.0), (3, 0.6))]
    assert "Flag" in report.load_note(moved, 1, cores=2) and "0.50-4.00" in report.load_note(moved, 1, cores=2)
    starved = [_row("baseline", 0, e, 50, 2.0, cpu=c) for e, c in ((1, 2.0), (2, 2.0), (3, 0.8))]
    assert "CPU/wall" in report.load_note(starved, 1, cores=2)


def test_ratio_intervals_are_geometric_and_stay_positive():
    """A paired time ratio's interval is the t-interval of the logs: positive, symmetric in a/b vs b/a."""
    text = report._mean_ci([0.6, 1.5, 1.1], 2, "x", geometric=True)
    mean, lo, hi = report.geometric_t_interval([0.6, 1.5, 1.1])
    assert text == f"{mean:.2f}x [{lo:.2f}, {hi:.2f}]" and lo > 0
    inv = report.geometric_t_interval([1 / 0.6, 1 / 1.5, 1 / 1.1])
    assert abs(inv[0] * mean - 1) < 1e-12 and abs(inv[1] * hi - 1) < 1e-12
    assert report.t_interval([0.6, 1.5, 1.1])[1] < lo  # the arithmetic interval reaches lower


def test_intervals_leaving_the_possible_range_are_clipped_and_marked():
    text = report._mean_ci([2.0, 6.0, 6.0], 1, lower=1.0, upper=6.0)  # epochs to target in a 6-epoch run
    mean, lo, hi = report.t_interval([2.0, 6.0, 6.0])
    assert lo < 1.0 and hi > 6.0
    assert text == f"{mean:.1f} [1.0, 6.0]{report.CLIPPED}"
    assert report.CLIPPED not in report._mean_ci([4.0, 5.0, 4.5], 1, lower=1.0, upper=6.0)
