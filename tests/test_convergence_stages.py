"""docs/convergence.py: the paired stages (fm-schedule, fm-async, fm-damped, fm-nobn) build paired runs and
their tables read them; the large-batch stages (lb-time, lb-val, lb) run end to end at CI size."""
import csv
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convergence():
    sys.path.insert(0, os.path.join(REPO, "docs"))
    import convergence
    import convergence_tables
    return convergence, convergence_tables


def test_fm_schedule_stage_pairs_the_arms():
    c, _ = _convergence()
    runs = dict(c.STAGES["fm-schedule"]())
    assert len(runs) == 2 * len(c.FM_SCHEDULE_BUDGETS) * len(c.FM_SCHEDULE_SEEDS)
    ref, gpu = runs["fm-schedule-b2-s3-e1b10"], runs["fm-schedule-b2-s3-e5b50"]
    opt = lambda args, k: args[args.index(k) + 1]  # noqa: E731
    for k in ("--epochs", "--seeds", "--val-fraction", "--dataset", "--model", "--width", "--schedule"):
        assert opt(ref, k) == opt(gpu, k)
    assert (opt(ref, "--stats-every"), opt(ref, "--block-size")) == ("1", "10")  # the library's defaults, explicit
    assert (opt(gpu, "--stats-every"), opt(gpu, "--block-size")) == ("5", "50")
    assert opt(ref, "--methods") == "baseline,grad,recursive" and opt(gpu, "--methods") == "grad,recursive"
    assert "recursive=0.4" in opt(ref, "--method-lr") and "recursive=0.4" in opt(gpu, "--method-lr")
    cmd = c.command("fm-schedule-b2-s3-e1b10", ref)
    assert cmd.count("--seeds") == 1 and opt(cmd, "--threads") == "1"


def _runs_in(tmp_path, monkeypatch):
    """docs/convergence.py with its runs folder (both modules' RUNS) at ``tmp_path``: the module and the folder."""
    c, ct = _convergence()
    root = str(tmp_path)
    monkeypatch.setattr(c, "RUNS", root)
    monkeypatch.setattr(ct, "RUNS", root)
    return c, root


def _write(root, name, seed, curves):
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "metrics.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "epoch", "test_acc", "epoch_time", "cpu_time", "load1"])
        for method, accs, sec in curves:
            for e, acc in enumerate(accs, 1):
                w.writerow([method, seed, e, acc, sec, sec, 1.0])
    open(os.path.join(d, "summary.md"), "w").close()
    with open(os.path.join(d, "command.txt"), "w") as fh:
        fh.write(f"python -m whitenlayers.experiment --out runs/convergence/{name}\n")


def test_fm_schedule_table_on_written_runs(tmp_path, monkeypatch):
    c, root = _runs_in(tmp_path, monkeypatch)
    for seed, bump in ((0, 0.0), (1, 0.5), (2, -0.5)):
        _write(root, f"fm-schedule-b2-s{seed}-e1b10", seed,
               [("baseline", [80 + bump, 88 + bump], 10.0), ("grad", [84 + bump, 89 + bump], 11.0),
                ("recursive", [83, 89], 11.0)])
        _write(root, f"fm-schedule-b2-s{seed}-e5b50", seed,
               [("grad", [83 + bump, 88.5 + bump], 10.5), ("recursive", [83, 89], 10.5)])
    _write(root, "fm-schedule-b1-s0-e1b10", 0, [("baseline", [85], 10.0), ("grad", [86], 11.0),
                                                ("recursive", [86], 11.0)])  # its pair is missing: left out
    text = c.fm_schedule_table()
    assert "| 2 | EVD (grad) | 89.00 ± 0.50 | 88.50 ± 0.50 | -0.50 [-0.50, -0.50] | 84.00 ± 0.50 → 83.00 ± 0.50 | " \
           "-1.00 [-1.00, -1.00] | " \
           "+1.00 [+1.00, +1.00] | +0.50 [+0.50, +0.50] | 1.10x [1.10, 1.10] → 1.05x [1.05, 1.05] | 3 |" in text
    assert "| 2 | recursive | 89.00 ± 0.00 | 89.00 ± 0.00 | +0.00 [+0.00, +0.00] |" in text
    assert "| 1 | (not run) |" in text
    assert "runs/convergence/fm-schedule-b2-s0-e5b50" in text


def test_fm_async_stage_pairs_the_arms():
    c, _ = _convergence()
    runs = dict(c.STAGES["fm-async"]())
    assert len(runs) == 4 * len(c.FM_ASYNC_SEEDS)
    opt = lambda args, k: args[args.index(k) + 1]  # noqa: E731
    for block in (10, 50):
        sync, lag = runs[f"fm-async-s3-b{block}-sync"], runs[f"fm-async-s3-b{block}-async"]
        assert "--fold-async" in lag and "--fold-async" not in sync
        assert [a for a in lag if a != "--fold-async"] == sync  # the lag is the only difference
        assert (opt(sync, "--block-size"), opt(sync, "--stats-every"), opt(sync, "--seeds")) == (str(block), "1", "3")
    assert [n for n in runs][:4] == [f"fm-async-s0-{arm}" for arm in ("b10-sync", "b10-async", "b50-sync", "b50-async")]


def test_fm_async_table_on_written_runs(tmp_path, monkeypatch):
    c, root = _runs_in(tmp_path, monkeypatch)
    for seed, bump in ((0, 0.0), (1, 0.5), (2, -0.5)):
        _write(root, f"fm-async-s{seed}-b10-sync", seed, [("grad", [84 + bump, 89 + bump], 10.0),
                                                          ("recursive", [83, 89], 10.0)])
        _write(root, f"fm-async-s{seed}-b10-async", seed, [("grad", [83 + bump, 89.5 + bump], 11.0),
                                                           ("recursive", [83, 89], 10.0)])
    _write(root, "fm-async-s0-b50-sync", 0, [("grad", [84, 89], 10.0), ("recursive", [83, 89], 10.0)])  # no pair
    text = c.fm_async_table()
    assert "| 10 | EVD (grad) | 89.00 ± 0.50 | 89.50 ± 0.50 | +0.50 [+0.50, +0.50] | 84.00 ± 0.50 → 83.00 ± 0.50 | " \
           "-1.00 [-1.00, -1.00] | 1.10x [1.10, 1.10] | 3 |" in text
    assert "| 10 | recursive | 89.00 ± 0.00 | 89.00 ± 0.00 | +0.00 [+0.00, +0.00] |" in text
    assert "| 50 | EVD (grad) | (not run) |" in text
    assert "runs/convergence/fm-async-s0-b10-async" in text and "runs/convergence/fm-async-s0-b50-sync" in text


def test_fm_damped_stage_pairs_the_arms():
    c, _ = _convergence()
    runs = dict(c.STAGES["fm-damped"]())
    assert len(runs) == 2 * len(c.FM_DAMPED_BUDGETS) * len(c.FM_DAMPED_SEEDS) == 40
    practical, damped = runs["fm-damped-b1-s7-practical"], runs["fm-damped-b1-s7-damped"]
    opt = lambda args, k: args[args.index(k) + 1]  # noqa: E731
    for k in ("--epochs", "--seeds", "--val-fraction", "--dataset", "--model", "--width", "--schedule", "--lr"):
        assert opt(practical, k) == opt(damped, k)
    assert opt(practical, "--methods") == "baseline,grad" and opt(damped, "--methods") == "grad"
    assert opt(practical, "--gains") == "practical" and opt(damped, "--gains") == "damped"
    assert "grad=0.2" in opt(practical, "--method-lr") and opt(damped, "--method-lr") == "grad=0.2"


def test_the_damped_arm_trains_ci_sized(tmp_path):
    """The damped arm's options on the runner's synthetic data: grad trains with gains="damped" (a CI-sized run of
    what the stage runs on Fashion-MNIST)."""
    import whitenlayers.experiment as ex

    c, _ = _convergence()
    args = dict(c.STAGES["fm-damped"]())["fm-damped-b1-s0-damped"]
    gains = args[args.index("--gains") + 1]
    out = str(tmp_path / "run")
    ex.main(["--quick", "--dataset", "synthetic", "--methods", "grad", "--gains", gains, "--epochs", "1",
             "--threads", "1", "--device", "cpu", "--seeds", "0", "--out", out])
    with open(os.path.join(out, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["method"] for r in rows] == ["grad"] and float(rows[0]["test_acc"]) > 50
    import torch
    from whitenlayers.layers.checkpoint import decode_identity

    state = torch.load(os.path.join(out, "checkpoints", "grad-seed0.pt"), weights_only=False)["model"]
    rules = [decode_identity(v) for k, v in state.items() if k.endswith("whitening_rule")]
    assert rules and all('"rule":"evd"' in r and '"gains":"damped"' in r for r in rules)  # the layers' own config


def test_fm_nobn_stages_cover_the_arms_and_regimes(tmp_path, monkeypatch):
    c, _ = _convergence()
    val = dict(c.STAGES["fm-nobn-val"]())
    assert len(val) == len(c.FM_NOBN_GRID) * len(c.FM_NOBN_ARMS) * 4 + len(c.FM_NOBN_EXTEND) == 44
    opt = lambda args, k: args[args.index(k) + 1]  # noqa: E731
    small = val["fm-nobn-val-b8-none-lr1"]
    assert opt(small, "--batch-size") == "8" and opt(small, "--norm") == "none"
    assert opt(small, "--methods") == "baseline,grad,recursive" and opt(small, "--val-fraction") == "0.1"
    assert opt(small, "--method-lr") == "baseline=0.01,grad=0.01,recursive=0.01"
    nf = val["fm-nobn-val-b128-nf-agc0.1-lr0"]
    assert opt(nf, "--agc") == "0.1" and opt(nf, "--norm") == "nf"
    assert opt(val["fm-nobn-val-b128-gn-lr3"], "--norm") == "gn"
    assert opt(val["fm-nobn-val-b8-gn-lr4"], "--lr") == "0.08" and "fm-nobn-val-b8-bn-lr4" not in val
    # no validation run yet: the test stage waits for it, arm by arm
    c, root = _runs_in(tmp_path, monkeypatch)
    pending = c.STAGES["fm-nobn"]()
    assert all(args is None for _, args in pending) and len(pending) == len(c.FM_NOBN_GRID) * len(c.FM_NOBN_TEST_ARMS)

    def val_run(arm, accs, batch=8):
        for i, acc in enumerate(accs):
            name = f"fm-nobn-val-b{batch}-{arm}-lr{i}"
            _write(root, name, 0, [("baseline", [acc - 5, acc], 10.0)])
            lr = dict(c._nobn_val(batch, arm))[name][3]
            with open(os.path.join(root, name, "config.json"), "w") as fh:
                fh.write('{"lr": %s, "method_lr": {"baseline": %s}}' % (lr, lr))

    # the GroupNorm arm's validation at batch 8 done: its test runs take the best rate (index 2), seeds 0-9
    val_run("gn", (70.0, 75.0, 80.0, 60.0, 50.0))
    runs = dict(c.STAGES["fm-nobn"]())
    gn = [args for name, args in runs.items() if name.startswith("fm-nobn-b8-s") and name.endswith("-gn")]
    assert len(gn) == len(c.FM_NOBN_SEEDS) and all(opt(a, "--lr") == "0.02" for a in gn)
    assert runs["fm-nobn-b8-bn"] is None and opt(runs["fm-nobn-b8-s3-gn"], "--seeds") == "3"
    # the normalizer-free arm: one clipping ratio's grid is not enough, then the better ratio with its rate
    val_run("nf-agc0.01", (60.0, 66.0, 70.0, 71.0))
    assert dict(c.STAGES["fm-nobn"]())["fm-nobn-b8-nf"] is None
    val_run("nf-agc0.1", (72.0, 79.0, 75.0, 70.0, 60.0))
    runs = dict(c.STAGES["fm-nobn"]())
    nf = runs["fm-nobn-b8-s0-nf"]
    assert opt(nf, "--agc") == "0.1" and opt(nf, "--lr") == "0.01" and opt(nf, "--norm") == "nf"


def test_fm_damped_table_on_written_runs(tmp_path, monkeypatch):
    c, root = _runs_in(tmp_path, monkeypatch)
    for seed, bump in ((0, 0.0), (1, 0.5), (2, -0.5)):
        _write(root, f"fm-damped-b2-s{seed}-practical", seed, [("baseline", [80 + bump, 88 + bump], 10.0),
                                                                ("grad", [84 + bump, 89 + bump], 11.0)])
        _write(root, f"fm-damped-b2-s{seed}-damped", seed, [("grad", [83 + bump, 89.5 + bump], 5.5)])
    _write(root, "fm-damped-b1-s0-practical", 0, [("baseline", [85], 10.0), ("grad", [86], 11.0)])  # no pair
    text = c.fm_damped_table()
    assert "| 2 | 88.00 ± 0.50 | 89.00 ± 0.50 | 89.50 ± 0.50 | +0.50 [+0.50, +0.50] | 84.00 ± 0.50 → 83.00 ± 0.50 | " \
           "-1.00 [-1.00, -1.00] | +1.00 [+1.00, +1.00] | +1.50 [+1.50, +1.50] | 0.50x [0.50, 0.50] | 3 |" in text
    assert "| 1 | (not run) |" in text
    assert "runs/convergence/fm-damped-b2-s0-damped" in text


def test_fm_nobn_table_on_written_runs(tmp_path, monkeypatch):
    import json

    c, root = _runs_in(tmp_path, monkeypatch)

    def val(arm, best):  # the arm's grid at batch 8: rate index 1 the best, scoring `best` per method
        for i, (name, args) in enumerate(c._nobn_val(8, arm)):
            methods = c.FM_NOBN_ARMS[arm][1]
            _write(root, name, 0, [(m, [best[m] - 6, best[m] - (0 if i == 1 else 3)], 10.0) for m in methods])
            lr = args[3]
            with open(os.path.join(root, name, "config.json"), "w") as fh:
                fh.write('{"lr": %s, "method_lr": {%s}}' % (lr, ", ".join(f'"{m}": {lr}' for m in methods)))

    val("bn", {"baseline": 89.0})
    val("gn", {"baseline": 87.0})
    val("none", {"baseline": 86.0, "grad": 88.0, "recursive": 87.5})
    val("nf-agc0.01", {"baseline": 70.0})
    val("nf-agc0.1", {"baseline": 88.5})
    curves = {"bn": [("baseline", [85, 89], 10.0)], "gn": [("baseline", [84, 87], 12.0)],
              "none": [("baseline", [82, 86], 10.0), ("grad", [86, 88], 15.0), ("recursive", [85, 89.5], 15.0)],
              "nf": [("baseline", [84, 88], 11.0)]}
    for seed, bump in ((0, 0.0), (1, 0.5), (2, -0.5)):
        for arm, cs in curves.items():
            name = f"fm-nobn-b8-s{seed}-{arm}"
            _write(root, name, seed, [(m, [a + bump for a in accs], t) for m, accs, t in cs])
            with open(os.path.join(root, name, "final_diagnostics.json"), "w") as fh:
                json.dump({m: [0.5, 0.25] for m, _, _ in cs}, fh)
    text = c.fm_nobn_table()
    assert "| 128 | (validation not finished) |" in text
    # reference: bn (best validation among the non-whitened); best whitened: none/grad (validation 88.0 > 87.5)
    assert "| 8 | bn (reference) | baseline | 0.01 | 89.00 ± 0.50 | 85.00 ± 0.50 | — | — | 1.00x [1.00, 1.00] | 3/3, " \
           "1.00x [1.00, 1.00] | 0.50 ± 0.00 | 0.25 ± 0.00 | 3 (0) |" in text
    assert "| 8 | none (chosen: best whitened) | grad | 0.01 | 88.00 ± 0.50 | 86.00 ± 0.50 | -1.00 [-1.00, -1.00] | " \
           "+1.00 [+1.00, +1.00] | 1.50x [1.50, 1.50] | 0/3 |" in text
    assert "| 8 | none | recursive | 0.01 | 89.50 ± 0.50 | 85.00 ± 0.50 | +0.50 [+0.50, +0.50] |" in text
    assert "| 3/3, 1.50x [1.50, 1.50] |" in text  # recursive reaches bn's final at its epoch 2: 30 s against 20
    assert "| 8 | nf | baseline | 0.01, agc 0.1 |" in text
    assert "batch 8: bn" in text and "runs/convergence/fm-nobn-b8-s0-none" in text
    assert "| 8 | none (grad) | bn | -1.00 [-1.00, -1.00] | +1.00 [+1.00, +1.00] | 0/3 |" in text
    assert "| 8 | none (grad) | none | +2.00 [+2.00, +2.00] | +4.00 [+4.00, +4.00] | 3/3 |" in text


def _tiny_lb(c, tmp_path, monkeypatch):
    """docs/convergence.py's large-batch stages shrunk to CI size: synthetic data, batches 16 and 32, the baseline
    and grad, budgets of 10-12 steps, every run in this process (no figure per run)."""
    import contextlib

    import whitenlayers.experiment as ex
    from whitenlayers.experiment import engine

    data = ["--dataset", "synthetic", "--model", "resnet8", "--width", "8"]
    tiny = dict(LB_ARMS={"baseline": ("baseline", ()), "grad": ("grad", ())}, LB_WHITENED=("grad",),
                LB_BATCHES=(16, 32), LB_TIME_ARMS=("baseline", "grad"), LB_TARGET=50.0, LB_SEEDS=(1, 2, 3),
                LB_MORE_SEEDS=(), LB_MAX_EXTEND=1, LB_BUDGET_EXAMPLES=64, LB_BUDGET_STEPS=8, LB_DATA=data,
                LB=[*data, "--schedule", "constant", "--diag-batches", "0", "--val-fraction", "0.25",
                    "--precise-bn", "64", "--block-size", "2"], OUT=str(tmp_path / "out"))
    for k, v in tiny.items():
        monkeypatch.setattr(c, k, v)
    monkeypatch.setattr(engine, "plot_metrics", lambda *a, **k: None)

    def launch(cmd, log):
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ex.main(list(cmd[3:]))  # python -m whitenlayers.experiment ARGS
        return 0

    monkeypatch.setattr(c, "_launch", launch)


def test_the_large_batch_stage_makes_its_tables_ci_sized(tmp_path, monkeypatch):
    """The lb-time, lb-val and lb stages end to end, CI-sized (two batch sizes, two arms, a few steps, synthetic
    data): one command runs them, the grids extend until chosen, and the tables and the figure are made."""
    c, root = _runs_in(tmp_path, monkeypatch)
    _tiny_lb(c, tmp_path, monkeypatch)
    assert c.main(["run", "lb-time", "lb-val", "lb"]) == 0
    assert c.main(["tables", "lb-time", "lb-val", "lb"]) == 0
    chosen = c._lb_chosen()
    assert set(chosen) == {(b, a) for b in (16, 32) for a in ("baseline", "grad")}
    val = open(os.path.join(c.OUT, "lb-val.md")).read()
    assert val.count("**") >= 8 and "| 16 | baseline |" in val and "| 32 | grad |" in val  # a bold choice per grid
    timing = open(os.path.join(c.OUT, "lb-time.md")).read()
    assert "| 16 |" in timing and "| 32 |" in timing and "(1.00x)" in timing and "--device cuda" in timing
    text = open(os.path.join(c.OUT, "lb.md")).read()
    for b in (16, 32):
        for arm in ("baseline", "grad"):
            assert f"| {b} | {arm} | {chosen[b, arm]:g} |" in text
    assert "### Critical batch size" in text and "| grad | " in text and "paired ratio" in text
    assert ("At no batch measured" in text) != ("The best whitened arm needs" in text)  # the verdict, either way
    before = sorted(os.listdir(root))
    assert c.main(["run", "lb-time", "lb-val", "lb"]) == 0 and sorted(os.listdir(root)) == before  # all done
    pytest.importorskip("matplotlib")  # the figure: the 'experiment' extra
    png = open(os.path.join(c.OUT, "lb.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_large_batch_grid_prunes_and_extends(tmp_path, monkeypatch):
    """lb-val at one (batch, arm): the centre first; each later trial's budget is the fewest steps to the target
    so far; a best rate at the grid's edge adds the next rate beyond it; the choice is the fewest steps."""
    c, root = _runs_in(tmp_path, monkeypatch)

    def trial(k, accs):  # a finished trial evaluated every 20 steps
        name = c._lb_val_name(32, "baseline", k)
        d = os.path.join(root, name)
        os.makedirs(d)
        with open(os.path.join(d, "steps.csv"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["method", "seed", "step", "examples", "epoch", "lr", "test_loss", "test_acc", "train_time",
                        "cpu_time", "wall_clock"])
            for i, a in enumerate(accs, 1):
                w.writerow(["baseline", 0, 20 * i, 640 * i, 1, 0.1, 0.5, a, i, i, 0])
        with open(os.path.join(d, "metrics.csv"), "w") as fh:
            fh.write("method,seed,epoch,test_acc,epoch_time,cpu_time,load1\nbaseline,0,1,50,1,1,1\n")
        open(os.path.join(d, "summary.md"), "w").close()

    def due():
        runs = dict(c._lb_val())
        ks, chosen, budget = c._lb_grid(32, "baseline")
        return ks, chosen, budget, runs[c._lb_val_name(32, "baseline", ks[-1])]

    opt = lambda args, k: args[args.index(k) + 1]  # noqa: E731
    ks, chosen, budget, args = due()
    assert ks == [0] and chosen is None and budget == c._lb_budget(32)
    assert opt(args, "--max-steps") == str(c._lb_budget(32)) and opt(args, "--stop-acc") == f"{c.LB_TARGET:g}"
    trial(0, [60, 70, 75, 79, 81])  # reached at step 100
    ks, chosen, budget, args = due()
    assert ks == [0, 1] and budget == 100 and opt(args, "--max-steps") == "100"
    trial(1, [65, 78, 82])  # reached at step 60: the best, at the grid's top so far
    ks, chosen, budget, args = due()
    assert ks == [0, 1, -1] and budget == 60
    trial(-1, [50, 60, 70])  # not reached within its 60 steps
    ks, chosen, budget, args = due()
    assert ks == [0, 1, -1, 2] and budget == 60 and float(opt(args, "--lr")) == c._lb_rate("baseline", 32, 2)
    trial(2, [70, 79, 79.5])  # not reached either: rate 2^1 x centre is chosen, inside the grid
    assert c._lb_grid(32, "baseline") == ([0, 1, -1, 2], 1, None)
    assert c._lb_chosen()[32, "baseline"] == c._lb_rate("baseline", 32, 1)
    assert opt(dict(c._lb_test())["lb-b32-baseline-s2"], "--max-steps") == str(c._lb_budget(32))  # full budget
