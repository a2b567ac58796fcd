"""Tests of the experiment runner (whitenlayers.experiment) and its datasets (whitenlayers.data).

Covered: option resolution and presets, the quick run on the default data and
on synthetic data with every method and two seeds (CSV, config, summary, PNG,
checkpoints), resume after an interruption (metrics identical to an
uninterrupted run, timings aside, with a statistics block spanning the
interruption), the CIFAR archive reader, the stratified split, the
rank-sharded loader, and a 2-process torchrun run whose ranks must hold
bit-identical whitening statistics.
"""
from __future__ import annotations

import csv
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from whitenlayers import experiment as ex
from whitenlayers.data import TensorData, TensorLoader, augment_batch, load_dataset, stratified_split

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


def _cfg(*argv):
    return ex.resolve_config(ex.build_parser().parse_args(list(argv)))


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------
def test_defaults_and_presets():
    cfg = _cfg()
    assert cfg["dataset"] == "mnist5k" and cfg["methods"] == ["baseline", "grad", "recursive"]
    assert cfg["seeds"] == [0, 1, 2] and cfg["milestones"] == [cfg["epochs"] // 2, 3 * cfg["epochs"] // 4]
    assert (cfg["model"], cfg["width"], cfg["block_size"]) == ("resnet20", 8, 2)  # the short default run
    c10 = _cfg("--dataset", "cifar10")
    assert (c10["width"], c10["block_size"], c10["augment"], c10["seeds"]) == (16, None, "auto", [0])
    assert _cfg("--quick")["seeds"] == [0]
    cifar = _cfg("--preset", "paper-cifar")
    assert (cifar["dataset"], cifar["model"], cifar["epochs"], cifar["batch_size"]) == ("cifar100", "resnet110", 200, 128)
    assert (cifar["lr"], cifar["momentum"], cifar["weight_decay"], cifar["milestones"]) == (0.1, 0.9, 5e-4, [100, 150])
    assert cifar["augment"] == "crop-flip" and cifar["block_size"] is None  # the layers' (paper) defaults
    assert ex.layer_kwargs(cifar, "grad") == {} and ex.layer_kwargs(cifar, "recursive") == {}
    imnet = _cfg("--preset", "paper-imagenet", "--dataset", "imagefolder:/x")
    assert (imnet["model"], imnet["epochs"], imnet["milestones"], imnet["weight_decay"]) == ("resnet50", 90, [30, 60], 1e-4)
    assert _cfg("--preset", "paper-cifar", "--epochs", "3", "--quick")["epochs"] == 3  # explicit beats quick and preset
    with pytest.raises(ValueError, match="imagefolder"):
        _cfg("--preset", "paper-imagenet")


def test_whitening_options_and_errors():
    cfg = _cfg("--block-size", "3", "--beta", "0.5", "--layer-kw", "recursive.alpha=0.2", "--seeds", "0-2")
    assert cfg["seeds"] == [0, 1, 2]
    assert ex.layer_kwargs(cfg, "grad") == {"block_size": 3, "beta": 0.5}
    assert ex.layer_kwargs(cfg, "direct") == {"block_size": 3}  # DirectWhiten takes no beta
    assert ex.layer_kwargs(cfg, "recursive") == {"block_size": 3, "beta": 0.5, "alpha": 0.2}
    assert ex.layer_kwargs(cfg, "baseline") == {}
    for bad, match in ((["--alpha", "1.5"], "alpha"), (["--methods", "grad,foo"], "foo"), (["--model", "resnet21"], "6n"),
                       (["--layer-kw", "direct.beta=0.1"], "direct")):
        with pytest.raises(ValueError, match=match):
            _cfg(*bad)


def test_help_documents_options_and_torchrun():
    out = subprocess.run([sys.executable, "-m", "whitenlayers.experiment", "--help"], capture_output=True, text=True,
                         env=_env(), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("--methods", "--dataset", "--preset", "--resume", "--block-size", "--seeds", "--device",
                 "--nnodes", "--rdzv_endpoint", "--master_addr"):
        assert word in out.stdout


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------
def test_stratified_split_is_fixed_and_balanced():
    labels = np.repeat(np.arange(10), 50)
    tr, te = stratified_split(labels, 0.2)
    tr2, te2 = stratified_split(labels, 0.2)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    assert len(set(tr) & set(te)) == 0 and len(tr) + len(te) == 500
    assert np.bincount(labels[te]).tolist() == [10] * 10


def test_mnist5k_bundle():
    b = load_dataset("mnist5k")
    assert (len(b.train), len(b.test), b.in_channels, b.num_classes) == (4000, 1000, 1, 10)
    assert torch.bincount(b.test.labels).tolist() == [100] * 10
    x, y = b.train.batch(torch.arange(8))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and abs(float(b.train.batch(torch.arange(4000))[0].mean())) < 0.05


def test_loader_shards_like_one_process_with_global_batch():
    data = TensorData(torch.rand(40, 2, 4, 4), torch.arange(40) % 3, (0.5, 0.5), (0.2, 0.2))
    single = TensorLoader(data, 8, shuffle=True, drop_last=True, seed=3)
    ranks = [TensorLoader(data, 4, shuffle=True, drop_last=True, seed=3, rank=r, world=2) for r in range(2)]
    for ld in [single] + ranks:
        ld.set_epoch(5)
    one = list(single)
    two = list(zip(*ranks))
    assert len(one) == len(two) == 5
    for (x, y), parts in zip(one, two):
        xs = torch.cat([p[0] for p in parts])
        key = lambda t: sorted(map(tuple, t.reshape(t.shape[0], -1).tolist()))
        assert key(xs) == key(x)
    # evaluation shards: disjoint and complete
    ev = [torch.cat([b[1] for b in TensorLoader(data, 7, shuffle=False, drop_last=False, rank=r, world=3)]) for r in range(3)]
    assert sum(len(e) for e in ev) == 40
    # another epoch, another order; same epoch, same order
    single.set_epoch(6)
    assert not torch.equal(next(iter(single))[0], one[0][0])
    single.set_epoch(5)
    assert torch.equal(next(iter(single))[0], one[0][0])


def test_augment_crop_flip():
    x = torch.rand(6, 3, 8, 8)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = augment_batch(x, "crop-flip", g1), augment_batch(x, "crop-flip", g2)
    assert a.shape == x.shape and torch.equal(a, b)
    flipped = augment_batch(x, "flip", torch.Generator().manual_seed(0))
    assert all(torch.equal(f, s) or torch.equal(f, s.flip(-1)) for f, s in zip(flipped, x))
    cropped = augment_batch(x, "crop", torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for c, p in zip(cropped, padded):
        assert any(torch.equal(c, p[:, i:i + 8, j:j + 8]) for i in range(9) for j in range(9))
    with pytest.raises(ValueError):
        augment_batch(x, "rotate", None)


def _fake_cifar(root, name, n=20):
    """A tiny archive with the layout of the official python-pickle CIFAR tarballs."""
    rng = np.random.default_rng(0)
    ten = name == "cifar10"
    folder = "cifar-10-batches-py" if ten else "cifar-100-python"
    files = ([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]) if ten else ["train", "test"]
    key = b"labels" if ten else b"fine_labels"
    path = os.path.join(root, "cifar-10-python.tar.gz" if ten else "cifar-100-python.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            d = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: list(rng.integers(0, 10 if ten else 100, n))}
            raw = pickle.dumps(d)
            info = tarfile.TarInfo(f"{folder}/{f}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path, folder


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_archive_tarball_and_folder(tmp_path, name):
    path, folder = _fake_cifar(str(tmp_path), name)
    for source in (path, str(tmp_path)):
        b = load_dataset(name, data_dir=source)
        assert len(b.train) == (100 if name == "cifar10" else 20) and len(b.test) == 20
        assert b.train.images.dtype == torch.uint8 and b.train.images.shape[1:] == (3, 32, 32)
        assert b.default_augment == "crop-flip" and b.num_classes == (10 if name == "cifar10" else 100)
    with tarfile.open(path) as tar:
        tar.extractall(str(tmp_path / "x"), filter="data")
    b = load_dataset(name, data_dir=str(tmp_path / "x" / folder))
    assert len(b.test) == 20
    with pytest.raises(FileNotFoundError, match="--download"):
        load_dataset(name, data_dir=str(tmp_path / "empty"))


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------
def test_quick_default_dataset(tmp_path, capsys):
    out = str(tmp_path / "q")
    ex.main(["--quick", "--out", out, "--train-subset", "512", "--test-subset", "256", "--progress", "always"])
    captured = capsys.readouterr()
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert [r["method"] for r in rows] == ["baseline"] * 2 + ["grad"] * 2 + ["recursive"] * 2
    assert "epochs to" in captured.out and "time vs baseline" in captured.out and "MNIST" in captured.out
    assert "#" in captured.err  # the progress bar
    assert all(0 < float(r["kappa_mean"]) <= 1 and 0 < float(r["rho_mean"]) <= 1 for r in rows)


def test_quick_synthetic_outputs_all_methods_two_seeds(tmp_path):
    out = str(tmp_path / "s")
    ex.main(["--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive,direct", "--seeds", "0,1",
             "--block-size", "3", "--out", out])
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
    png = open(os.path.join(out, "figure.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    summary = open(os.path.join(out, "summary.md")).read()
    for label in ("baseline", "EVD (grad)", "recursive", "direct"):
        assert label in summary
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == sorted(
        f"{m}-seed{s}.pt" for m in ("baseline", "grad", "recursive", "direct") for s in (0, 1))
    # whitened runs see whiter features than the baseline after training
    last = {(r["method"], r["seed"]): float(r["rho_mean"]) for r in rows if r["epoch"] == "2"}
    assert last[("grad", "0")] > last[("baseline", "0")]
    # --replot redraws figure and summary from the CSV alone
    os.remove(os.path.join(out, "figure.png"))
    ex.main(["--replot", out, "--target-acc", "10"])
    assert os.path.getsize(os.path.join(out, "figure.png")) > 20_000
    assert "epochs to 10.0%" in open(os.path.join(out, "summary.md")).read()


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    # 512 images / batch 64 = 8 steps per epoch, block size 3: a statistics block spans each interruption.
    common = ["--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive", "--epochs", "3",
              "--block-size", "3", "--threads", "1"]
    full = str(tmp_path / "full")
    ex.main(common + ["--out", full, "--order", "sequential"])  # the order of the methods changes nothing

    part = str(tmp_path / "part")
    real_write = ex.write_metrics
    calls = {"n": 0}

    def interrupt_after_5_epochs(rows, path):
        real_write(rows, path)
        calls["n"] += 1
        if calls["n"] == 5:  # interleaved: epoch 1 of all three methods, epoch 2 of baseline and grad
            raise KeyboardInterrupt

    monkeypatch.setattr(ex, "write_metrics", interrupt_after_5_epochs)
    with pytest.raises(KeyboardInterrupt):
        ex.main(common + ["--out", part])
    monkeypatch.setattr(ex, "write_metrics", real_write)
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
    assert "| EVD (grad) | 85.00 | 85.00 | 2.0 |" in table and "1.20x" in table
    summary, _ = ex.summarize(rows, ["baseline", "grad"], target_acc=84)
    assert "not reached" in ex.format_summary(summary, 84)


def test_two_process_torchrun_ranks_agree(tmp_path):
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "whitenlayers.experiment", "--quick", "--dataset", "synthetic", "--methods", "baseline,grad,recursive",
           "--block-size", "2", "--threads", "1", "--out", out]
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
             "--batch-size", "4", "--workers", "0", "--diag-batches", "1", "--out", out])
    rows = _rows(os.path.join(out, "metrics.csv"))
    assert [r["method"] for r in rows] == ["baseline", "grad"]
