"""The budgeted-training pieces of issue 25: ``--schedule linear`` (per-step decay to 0 at the budget), the
``grad-patch`` method, and the Fashion-MNIST frontier analysis (docs/fashion_frontier.py) on runs written here."""
from __future__ import annotations

import csv
import math
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import whitenlayers as wl
from whitenlayers import experiment as ex
from whitenlayers.experiment import engine
from whitenlayers.experiment.engine import linear_factor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@settings(max_examples=50, deadline=None)
@given(steps=st.integers(1, 50), epochs=st.integers(1, 6), warm=st.integers(0, 2))
def test_linear_schedule_ends_its_budget_at_zero(steps, epochs, warm):
    warm = min(warm, epochs - 1)
    f = [linear_factor(e, i, steps, epochs, warm) for e in range(epochs) for i in range(steps)]
    decay = f[warm * steps:]
    assert decay[0] == 1.0  # the decay starts at the base rate
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly decreasing, step by step
    total = (epochs - warm) * steps
    assert math.isclose(decay[-1], 1 / total)  # one step before 0: the budget's end is where it reaches 0
    assert linear_factor(epochs, 0, steps, epochs, warm) == 0.0
    assert all(0 < v <= 1 for v in f)
    assert f[:warm * steps] == [(e + 1) / (warm + 1) for e in range(warm) for _ in range(steps)]


def test_runner_applies_the_linear_schedule_per_step(tmp_path, monkeypatch):
    seen = []
    real = engine.train_epoch

    def spy(model, opt, loader, ctx, precision, bar=None, pre=None, step_factor=None, method_lr=0.0, *rest):
        seen.append([step_factor(i) for i in range(len(loader))])
        return real(model, opt, loader, ctx, precision, bar, pre, step_factor, method_lr, *rest)

    monkeypatch.setattr(engine, "train_epoch", spy)
    out = str(tmp_path / "lin")
    ex.main(["--quick", "--dataset", "synthetic", "--methods", "baseline", "--epochs", "2", "--schedule", "linear",
             "--lr", "0.2", "--out", out, "--progress", "never", "--device", "cpu"])  # auto would pick CUDA
    steps = len(seen[0])
    assert steps > 1 and [len(s) for s in seen] == [steps, steps]
    flat = seen[0] + seen[1]
    assert flat[0] == 1.0 and math.isclose(flat[-1], 1 / (2 * steps))
    with open(os.path.join(out, "metrics.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.2, 0.1])  # each epoch's first step


def test_grad_patch_method_whitens_the_stem_by_patches():
    method = ex.METHOD_REGISTRY["grad-patch"]
    model = method.apply(wl.models.cifar_resnet(8, width=8, in_channels=1), {"block_size": 2})
    assert model.conv1.features == "patches" and model.conv1.num_features == 9
    assert all(m.features == "channels" for n, m in wl.whitening_layers(model) if n != "conv1")
    assert len(wl.whitening_layers(model)) == 1 + len(wl.whitening_layers(
        wl.convert_model(wl.models.cifar_resnet(8, width=8, in_channels=1))))


def _write_run(root, budget, seed, curves):
    """A finished run folder as the runner writes it: metrics.csv (the fields the analysis reads) and summary.md."""
    d = os.path.join(root, f"fm-b{budget}-s{seed}")
    os.makedirs(d)
    with open(os.path.join(d, "metrics.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "epoch", "test_acc", "epoch_time", "train_time", "load1"])
        for method, accs, sec in curves:
            for e, acc in enumerate(accs, 1):
                w.writerow([method, seed, e, acc, sec, sec * e, 1.0])
    open(os.path.join(d, "summary.md"), "w").close()


def test_frontier_analysis_on_written_runs(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "docs"))
    import fashion_frontier as ff

    root = str(tmp_path / "runs")
    for seed, bump in ((0, 0.0), (1, 0.4), (2, -0.2)):
        _write_run(root, 1, seed, [("baseline", [80 + bump], 10.0), ("grad", [84 + bump], 11.0)])
        _write_run(root, 2, seed, [("baseline", [82 + bump, 86 + bump], 10.0), ("grad", [86 + bump, 89 + bump], 11.0)])
    runs = ff.load_runs(root)
    assert sorted(runs) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    fr = ff.frontier(runs, "grad")
    assert fr[2][1] == (89.4, 22.0) and fr[1][0] == (84.0, 11.0)
    # 86 % (the baseline's final at 2 epochs, seed 0): grad reaches it after its first epoch of the 2-epoch run
    assert ff.time_to_target(runs, "grad", 86.0) == {0: 11.0, 1: 11.0, 2: 22.0}
    assert ff.time_to_target(runs, "baseline", 86.0) == {0: 20.0, 1: 20.0, 2: math.inf}
    assert ff.time_to_target(runs, "grad", 95.0) == {0: math.inf, 1: math.inf, 2: math.inf}
    # per-seed targets (each seed's baseline final at the largest budget): 86, 86.4, 85.8
    assert ff.time_to_target(runs, "baseline", {0: 86.0, 1: 86.4, 2: 85.8}) == {0: 20.0, 1: 20.0, 2: 20.0}
    assert ff.time_to_target(runs, "grad", {0: 86.0, 1: 86.4, 2: 85.8}) == {0: 11.0, 1: 11.0, 2: 11.0}
    text, summary = ff.tables(runs)
    assert math.isclose(summary["baseline_final"], 86 + (0.4 - 0.2) / 3)
    assert "| EVD (grad) | +4.00 [+4.00, +4.00] | +3.00 [+3.00, +3.00] |" in text  # paired differences
    assert "epoch time vs baseline" in text and "1.10x" in text  # 11 s against 10 s per epoch
    assert "| EVD (grad) | 3/3 | 11 | 0.55x [0.55, 0.55] |" in text  # 11 s against 20 s on every seed
    # two seeds: the count and "no estimate" instead of a mean and an interval
    text2, summary2 = ff.tables({k: v for k, v in runs.items() if k[1] < 2})
    assert "| EVD (grad) | 2/2 | no estimate | no estimate (2/2) |" in text2 and math.isnan(summary2["ratio_grad"])
    pytest.importorskip("matplotlib")  # the frontier figure: the 'experiment' extra
    out = str(tmp_path / "out")
    assert ff.main(["--runs", root, "--out", out]) == 0
    assert {"fashion.md", "fashion-frontier.png", "fashion-summary.json"} <= set(os.listdir(out))


def test_linear_decay_ends_at_a_step_budget():
    """``--max-steps``: the linear schedule reaches 0 one step after the budget's last step, whatever the epochs."""
    f = [linear_factor(e, i, 10, 99, total_steps=25) for e in range(3) for i in range(10)][:25]
    assert f[0] == 1.0 and abs(f[24] - 1 / 25) < 1e-12
    assert all(a > b for a, b in zip(f, f[1:]))
