"""Tests of the runner's reports (whitenlayers.experiment.report): the summary table and its target."""
from __future__ import annotations

import json
import os

import pytest

from whitenlayers import experiment as ex


def test_summary_and_target():
    rows = []
    for m, accs, t in (("baseline", [50, 70, 80], 1.0), ("grad", [60, 80, 85], 1.2)):
        for e, a in enumerate(accs, 1):
            rows.append(dict(method=m, seed=0, epoch=e, test_acc=a, kappa_mean=0.5, rho_mean=0.4, epoch_time=t))
    summary, target = ex.summarize(rows, ["baseline", "grad"])
    assert target == pytest.approx(79.2)
    s = {d["method"]: d for d in summary}
    assert s["baseline"]["epochs_to_target"][0] == 3 and s["grad"]["epochs_to_target"][0] == 2
    assert s["grad"]["time_ratio"] == pytest.approx(1.2) and s["grad"]["best_acc"][0] == 85
    table = ex.format_summary(summary, target)
    # one seed: no estimate of the epochs to target (fewer than 3 seeds reach it), the count instead
    assert "| EVD (grad) | 85.00 | 85.00 | no estimate (1/1) |" in table and "1.20x" in table
    three = [dict(r, seed=s) for s in (0, 1, 2) for r in rows]
    table = ex.format_summary(ex.summarize(three, ["baseline", "grad"])[0], target)
    assert "| EVD (grad) | 85.00 ± 0.00 | 85.00 ± 0.00 | 2.0 ± 0.0 |" in table
    summary, _ = ex.summarize(rows, ["baseline", "grad"], target_acc=84)
    assert "not reached" in ex.format_summary(summary, 84)


def _row(method, seed, epoch, acc):
    return dict(method=method, seed=seed, epoch=epoch, lr=0.1, train_loss=1.0 / epoch, train_acc=acc, test_loss=0.5,
                test_acc=acc, kappa_mean=0.5, kappa_sem=0.01, rho_mean=0.4, rho_sem=0.01, epoch_time=1.0,
                eval_time=0.1)


def test_metrics_round_trip_and_replot_of_an_older_run(tmp_path):
    rows = [_row(m, s, e, 50 + 10 * e + s) for m in ("baseline", "grad") for s in (0, 1, 2) for e in (1, 2, 3)]
    ex.write_metrics(rows, str(tmp_path / "metrics.csv"))
    back = ex.read_metrics(str(tmp_path / "metrics.csv"))
    assert [{k: r[k] for k in rows[0]} for r in back] == rows  # the older columns round-trip
    # the newer ones: cumulative training time recomputed, CPU time and load unknown
    assert [r["train_time"] for r in back[:3]] == [1.0, 2.0, 3.0]
    assert all(r["cpu_time"] != r["cpu_time"] for r in back)  # nan
    # config.json as written before the runner became a package (no amp/compile/channels_last/stats_fraction)
    old = dict(dataset="synthetic", data_dir="data", download=False, test_fraction=0.2, train_subset=512,
               test_subset=256, augment="auto", model="resnet8", width=8, methods=["baseline", "grad"], seeds=[0, 1, 2],
               epochs=3, batch_size=64, lr=0.1, momentum=0.9, nesterov=False, weight_decay=5e-4, schedule="step",
               milestones=[], lr_gamma=0.1, warmup_epochs=0, block_size=2, alpha=None, beta=None, eps=None, gmax=None,
               gains=None, gamma=None, delta=None, c_rel=None, c_abs=None, layer_kw={}, diag_batches=2,
               order="interleaved", target_acc=None, sync_bn=False, workers=None, preset=None, quick=True,
               out=str(tmp_path), resume=False, device="cpu", threads=1, progress="auto", git=None, world_size=1)
    (tmp_path / "config.json").write_text(json.dumps(old))
    pytest.importorskip("matplotlib")  # replot draws the figure: the 'experiment' extra
    fig, table = ex.replot(str(tmp_path), target_acc=70)
    assert os.path.getsize(fig) > 10_000 and "| EVD (grad) |" in table
    assert "seconds to target" in table
    assert "| baseline | 81.00 ± 1.00 | 81.00 ± 1.00 | 3.0 [3.0, 3.0] | 3.0 [3.0, 3.0] |" in table
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("# synthetic, CIFAR ResNet-8 (width 8): 3 epochs, batch 64") and "epochs to 70.0%" in text
