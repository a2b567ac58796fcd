"""The convergence study of docs/CONVERGENCE.md: every run it reports, and the tables.

    python docs/convergence.py run STAGE [STAGE ...] [--jobs 2]   # train (skips finished runs)
    python docs/convergence.py tables [STAGE ...]                 # docs/convergence/*.md from the runs
    python docs/convergence.py list                               # the stages and their runs' commands

Each run is one ``python -m whitenlayers.experiment`` command (printed, and
saved as ``command.txt`` beside its ``metrics.csv`` under
``runs/convergence/<run>``). Protocol: 5 paired seeds (same initial weights
and data order for every method of a seed, methods interleaved epoch by
epoch); settings are chosen on a validation split carved from the training
digits (``--val-fraction 0.2``), and the test split is used once per chosen
setting. Every method gets the same number of trials (four learning rates).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = os.path.join(ROOT, "runs", "convergence")
OUT = os.path.join(HERE, "convergence")
sys.path.insert(0, ROOT)

SEEDS = "0-4"
OURS = ("grad", "recursive")
SGD_PEERS = ("kfac", "foof", "iternorm")
LIB_PEERS = ("shampoo", "soap", "muon")
ALL = ("baseline",) + OURS + SGD_PEERS + LIB_PEERS
#: Four learning rates per method (the same trial budget for each): index i of every list is run i of a grid.
LR_GRID: Dict[str, Tuple[float, ...]] = {m: (0.05, 0.1, 0.2, 0.4) for m in ("baseline",) + OURS + SGD_PEERS}
LR_GRID.update(shampoo=(0.001, 0.003, 0.01, 0.03), soap=(0.001, 0.003, 0.01, 0.03), muon=(0.005, 0.01, 0.02, 0.04))
ADAM_GRID = (0.001, 0.003, 0.01, 0.03)
COMMON = ["--threads", "1", "--progress", "never", "--seeds", SEEDS]


def _lr_args(methods: Sequence[str], i: int, grid: Dict[str, Tuple[float, ...]] = LR_GRID) -> List[str]:
    per = ",".join(f"{m}={grid[m][i]:g}" for m in methods)
    return ["--lr", f"{grid.get('baseline', (0.1,) * 4)[i]:g}", "--method-lr", per]


def _chosen(stage: str, methods: Sequence[str], runs: Optional[Sequence[Tuple[str, object]]] = None
            ) -> Dict[str, float]:
    """Per method, the learning rate of the best mean validation final accuracy in ``stage``'s runs (``runs``:
    these runs of the stage instead of all)."""
    best: Dict[str, Tuple[float, float]] = {}
    for name, _ in (STAGES[stage]() if runs is None else runs):
        rows = _rows(name)
        if rows is None:
            continue
        cfg = json.load(open(os.path.join(RUNS, name, "config.json")))
        for m in methods:
            finals = _finals(rows, m)
            if not finals:
                continue
            lr = cfg["method_lr"].get(m, cfg["lr"])
            score = float(np.mean(finals)) if all(math.isfinite(v) for v in finals) else -1.0
            if m not in best or score > best[m][1]:
                best[m] = (lr, score)
    missing = [m for m in methods if m not in best]
    if missing:
        raise SystemExit(f"stage {stage}: no validation result yet for {missing}; run it first")
    return {m: v[0] for m, v in best.items()}


def _grid(prefix: str, methods: Sequence[str], extra: Sequence[str], grid=LR_GRID) -> List[Tuple[str, List[str]]]:
    return [(f"{prefix}-lr{i}", ["--methods", ",".join(methods), *_lr_args(methods, i, grid), *extra])
            for i in range(4)]


def _test(val_stage: str, prefix: str, methods: Sequence[str], extra: Sequence[str]) -> List[Tuple[str, List[str]]]:
    try:
        lrs = _chosen(val_stage, methods)
    except SystemExit:
        return [(prefix, None)]
    return [(prefix, ["--methods", ",".join(methods), "--lr", f"{lrs.get('baseline', 0.1):g}", "--method-lr",
                      ",".join(f"{m}={v:g}" for m, v in lrs.items()), *extra])]


DIG = ["--dataset", "digits", "--epochs", "6"]
VAL = ["--val-fraction", "0.2", "--diag-batches", "0"]
STAGES = {
    # Learning rate, every method, digits (6 epochs, step schedule /10 at 3 and 4), validation then test.
    "lr-val": lambda: _grid("lr-val", ALL, DIG + VAL),
    "lr-test": lambda: _test("lr-val", "lr-test", ALL, DIG),
    # Short budget: 3 epochs (with fewer than 4 epochs the default schedule has no milestone: constant lr).
    "short-val": lambda: _grid("short-val", ("baseline",) + OURS, ["--dataset", "digits", "--epochs", "3"] + VAL),
    "short-test": lambda: _test("short-val", "short-test", ("baseline",) + OURS, ["--dataset", "digits", "--epochs", "3"]),
    # Without BatchNorm (Fixup-style ResNet): where whitening should matter most.
    "nobn-val": lambda: _grid("nobn-val", ("baseline",) + OURS + ("kfac",), DIG + VAL + ["--norm", "none"]),
    "nobn-test": lambda: _test("nobn-val", "nobn-test", ("baseline",) + OURS + ("kfac",), DIG + ["--norm", "none"]),
    # Whitening composed with Adam: baseline+Adam vs grad+Adam.
    "adam-val": lambda: _grid("adam-val", ("baseline", "grad"), DIG + VAL + ["--optimizer", "adam"],
                              {"baseline": ADAM_GRID, "grad": ADAM_GRID}),
    "adam-test": lambda: _test("adam-val", "adam-test", ("baseline", "grad"), DIG + ["--optimizer", "adam"]),
    # Block size (statistics per fold) and smoothing, at lr 0.1, validation.
    "block-val": lambda: [(f"block-val-L{L}-beta{b}", ["--methods", "baseline,grad,recursive", "--block-size", str(L),
                                                         "--layer-kw", f"grad.beta={b}", *DIG, *VAL])
                          for L, b in ((1, 0.95), (8, 0.95), (2, 0.5))],
    # Width 16 (the paper's), lr 0.1, validation.
    "width-val": lambda: [("width-val-w16", ["--methods", "baseline,grad,recursive", "--width", "16", *DIG, *VAL])],
    "width-test": lambda: [("width-test-w16", ["--methods", "baseline,grad,recursive", "--width", "16", *DIG])],
    # Sub-sampled statistics: full statistics against stats_fraction=0.25 (the leading quarter
    # of each batch), both embedded datasets at the default run's settings, validation split; paired by seed
    # across the two runs of a dataset (same initial weights and data order).
    "stats-val": lambda: [(f"stats-val-{ds}-f{f:g}", ["--methods", "baseline,grad,recursive" if f == 1 else "grad,recursive",
                                                      "--dataset", ds, "--stats-fraction", f"{f:g}", *VAL])
                          for ds in ("mnist5k", "digits") for f in (1.0, 0.25)],
    # Statistics on a schedule: every training forward against stats_every=2 (the first forward of
    # each of the default run's 2-forward blocks: half the batches), both embedded datasets, validation split;
    # paired by seed across the two runs of a dataset.
    "every-val": lambda: [(f"every-val-{ds}-e{k}", ["--methods", "baseline,grad,recursive" if k == 1 else "grad,recursive",
                                                    "--dataset", ds, "--stats-every", str(k), *VAL])
                          for ds in ("mnist5k", "digits") for k in (1, 2)],
    # The library's default block (block_size=10, as convert_model) with statistics on every forward against
    # stats_every=5 (2 of each block's 10 forwards gather), both embedded datasets, validation split; paired by
    # seed across the two runs of a dataset. Whether a schedule can become the library default.
    "every10-val": lambda: [(f"every10-val-{ds}-e{k}", ["--methods", "grad,recursive", "--dataset", ds,
                                                        "--block-size", "10", "--stats-every", str(k), *VAL])
                            for ds in ("mnist5k", "digits") for k in (1, 5)],
    # mnist5k, the default run's setting (lr 0.1), with the two fastest peers on digits at their digits-validated
    # rates; 3 seeds (the default run's), for lack of time at this machine's load.
    "mnist-peers": lambda: [("mnist-peers", ["--methods", "baseline,grad,recursive,muon,soap", "--dataset", "mnist5k",
                                             "--method-lr", "muon=0.04,soap=0.03", "--seeds", "0-2"])],
    # mnist5k, the default run's setting (lr 0.1 and the library authors' rates, untuned), every method.
    "mnist-default": lambda: [("mnist-default", ["--methods", ",".join(ALL), "--dataset", "mnist5k"])],
}


# Fashion-MNIST, budgeted: the official 60,000 / 10,000 split, CIFAR ResNet-8 width 8 (one input
# channel), batch 128, SGD momentum 0.9 (Muon and SOAP their own), the library's defaults (block_size 10,
# statistics on every forward), no augmentation, and a linear decay of the learning rate to 0 at the end of each
# budget (--schedule linear, per step). Budgets 1, 2 and 4 epochs. Learning rate per method on a validation
# split (10 % of the training images, stratified) at the 2-epoch budget, seed 0, three trials for every method;
# then every budget with the chosen rates on the test split, seeds 0-4, one run per (budget, seed), the six
# methods interleaved epoch by epoch inside each run.
FASHION = ("baseline", "grad", "recursive", "grad-patch", "muon", "soap")
FASHION_GRID: Dict[str, Tuple[float, ...]] = {m: (0.1, 0.2, 0.4) for m in ("baseline", "grad", "recursive", "grad-patch")}
FASHION_GRID.update(muon=(0.01, 0.02, 0.04), soap=(0.001, 0.003, 0.01))
FASHION_BUDGETS = (1, 2, 4)
FASHION_SEEDS = (0, 1, 2, 3, 4)
FM = ["--dataset", "fashion-mnist", "--model", "resnet8", "--width", "8", "--schedule", "linear", "--diag-batches", "0"]


def _fashion_val() -> List[Tuple[str, List[str]]]:
    out = []
    for i in range(3):
        per = ",".join(f"{m}={FASHION_GRID[m][i]:g}" for m in FASHION)
        out.append((f"fm-val-lr{i}", ["--methods", ",".join(FASHION), "--lr", f"{FASHION_GRID['baseline'][i]:g}",
                                      "--method-lr", per, "--epochs", "2", "--val-fraction", "0.1", "--seeds", "0",
                                      *FM]))
    return out


def _fashion_test() -> List[Tuple[str, Optional[List[str]]]]:
    try:
        lrs = _chosen("fm-val", FASHION)
    except SystemExit:
        return [("fm-test", None)]
    per = ",".join(f"{m}={v:g}" for m, v in lrs.items())
    return [(f"fm-b{b}-s{seed}", ["--methods", ",".join(FASHION), "--lr", f"{lrs['baseline']:g}", "--method-lr", per,
                                  "--epochs", str(b), "--seeds", str(seed), *FM])
            for seed in FASHION_SEEDS for b in sorted(FASHION_BUDGETS, reverse=True)]


STAGES["fm-val"] = _fashion_val
STAGES["fm-test"] = _fashion_test

# The GPU schedule on Fashion-MNIST: the library's defaults (block_size=10, statistics on every
# forward) against the GPU-recommended settings (stats_every=5, block_size=50: 10 of each block's 50 forwards
# gather), grad and recursive, at the FM settings and the rates fm-val chose (baseline and grad 0.2, recursive
# 0.4; the fm-val runs are not in the repository, so the rates are written here), on the validation split.
# One run per (budget, seed, arm), paired by seed across the two arms (same initial weights and data order); the
# baseline rides in the defaults' run for reference. Budgets 2 then 1 epochs, seeds 0-9 (0-4 as the other studies,
# 5-9 added for narrower intervals, decided on time alone), the two arms of a seed one after the other, so that a
# stopped stage leaves complete pairs.
FM_SCHEDULE_LR = {"baseline": 0.2, "grad": 0.2, "recursive": 0.4}
FM_SCHEDULE_ARMS = {"e1b10": ["--stats-every", "1", "--block-size", "10"],
                    "e5b50": ["--stats-every", "5", "--block-size", "50"]}
FM_SCHEDULE_BUDGETS = (2, 1)
FM_SCHEDULE_SEEDS = tuple(range(10))


def _fashion_schedule() -> List[Tuple[str, List[str]]]:
    out = []
    for b in FM_SCHEDULE_BUDGETS:
        for seed in FM_SCHEDULE_SEEDS:
            for arm, extra in FM_SCHEDULE_ARMS.items():
                methods = ("baseline",) + OURS if arm == "e1b10" else OURS
                per = ",".join(f"{m}={FM_SCHEDULE_LR[m]:g}" for m in methods)
                out.append((f"fm-schedule-b{b}-s{seed}-{arm}",
                            ["--methods", ",".join(methods), "--lr", f"{FM_SCHEDULE_LR['baseline']:g}", "--method-lr",
                             per, "--epochs", str(b), "--val-fraction", "0.1", "--seeds", str(seed), *extra, *FM]))
    return out


STAGES["fm-schedule"] = _fashion_schedule


# The asynchronous fold on Fashion-MNIST: convert_model(..., fold_async=True) installs the
# transform built from block i at block i + 2 instead of i + 1 (one block late). Against the synchronous fold, grad
# and recursive, blocks of 10 and 50 forwards (statistics on every forward, so that only the block length and the
# lag move), the fm-schedule settings and rates, the 2-epoch budget (final and halfway accuracy), validation split.
# One run per (seed, block, arm), paired by seed (same initial weights, same batches); no baseline (the question is
# the lag, and fm-schedule has the baseline). Seeds 0-9, a seed's four runs one after the other, so that a stopped
# stage leaves complete seeds.
FM_ASYNC_ARMS = {f"b{b}-{arm}": ["--block-size", str(b), *flag] for b in (10, 50)
                 for arm, flag in (("sync", []), ("async", ["--fold-async"]))}
FM_ASYNC_SEEDS = tuple(range(10))


def _fashion_async() -> List[Tuple[str, List[str]]]:
    per = ",".join(f"{m}={FM_SCHEDULE_LR[m]:g}" for m in OURS)
    return [(f"fm-async-s{seed}-{arm}",
             ["--methods", ",".join(OURS), "--lr", f"{FM_SCHEDULE_LR['grad']:g}", "--method-lr", per, "--epochs", "2",
              "--val-fraction", "0.1", "--seeds", str(seed), "--stats-every", "1", *extra, *FM])
            for seed in FM_ASYNC_SEEDS for arm, extra in FM_ASYNC_ARMS.items()]


STAGES["fm-async"] = _fashion_async


# The damped gains on Fashion-MNIST: grad with gains="damped" (Q = c (Phi + d I)^-1 from a Cholesky
# factorisation, no eigendecomposition) against grad with the default practical gains and the baseline, at the
# fm-schedule settings and rates (the library's defaults otherwise), budgets 2 then 1 epochs (final and halfway
# accuracy), seeds 0-9, validation split. One run per (budget, seed, arm), paired by seed (same initial weights and
# data order); the baseline rides in the practical arm's run. A seed's two arms one after the other, so that a
# stopped stage leaves complete pairs.
FM_DAMPED_ARMS = {"practical": ("baseline", "grad"), "damped": ("grad",)}
FM_DAMPED_BUDGETS = (2, 1)
FM_DAMPED_SEEDS = tuple(range(10))


def _fashion_damped() -> List[Tuple[str, List[str]]]:
    out = []
    for b in FM_DAMPED_BUDGETS:
        for seed in FM_DAMPED_SEEDS:
            for arm, methods in FM_DAMPED_ARMS.items():
                per = ",".join(f"{m}={FM_SCHEDULE_LR[m]:g}" for m in methods)
                out.append((f"fm-damped-b{b}-s{seed}-{arm}",
                            ["--methods", ",".join(methods), "--lr", f"{FM_SCHEDULE_LR['baseline']:g}", "--method-lr",
                             per, "--epochs", str(b), "--val-fraction", "0.1", "--seeds", str(seed), "--gains", arm,
                             *FM]))
    return out


STAGES["fm-damped"] = _fashion_damped


# Where whitening pays without BatchNorm, on Fashion-MNIST: at the FM settings, a 2-epoch budget (final accuracy,
# and halfway at epoch 1), per batch regime (the study's 128, and 8, the per-sample budget fixed), the arms
# BatchNorm; GroupNorm; no normalisation (Fixup-style, --norm none) with the baseline, grad and recursive; and
# normalizer-free (--norm nf: scaled weight standardisation, zero-initialised residual gains) with NFNets' adaptive
# gradient clipping, the non-whitening answer to the same problem. Learning rates per arm, regime and method from a
# 4-point grid on the validation split (seed 0), extended by one rate above where the grid's top rate won
# (GroupNorm and the normalizer-free arm at 0.1, at both batches); the clipping ratio (0.01, NFNets' large-batch
# value, or 0.1) is chosen there too, with its rate (the normalizer-free arm gets the more trials, which can only
# favour it). Then seeds 0-9 on the test split, one run per (regime, seed, arm), paired by seed (same initial
# weights and data order), a seed's arms one after the other and both regimes of a seed before the next seed, so
# that a stopped stage leaves complete seeds.
FM_NOBN_ARMS: Dict[str, Tuple[List[str], Tuple[str, ...]]] = {
    "bn": (["--norm", "bn"], ("baseline",)),
    "gn": (["--norm", "gn"], ("baseline",)),
    "none": (["--norm", "none"], ("baseline",) + OURS),
    "nf-agc0.01": (["--norm", "nf", "--agc", "0.01"], ("baseline",)),
    "nf-agc0.1": (["--norm", "nf", "--agc", "0.1"], ("baseline",)),
}
#: The arms the test stage runs: each, the validation arms it is chosen from (the best validation accuracy).
FM_NOBN_TEST_ARMS = {"bn": ("bn",), "gn": ("gn",), "none": ("none",), "nf": ("nf-agc0.01", "nf-agc0.1")}
#: The learning-rate grid of each batch regime (batch 8: the linear scaling rule's rates, 16x smaller, about).
FM_NOBN_GRID = {128: (0.05, 0.1, 0.2, 0.4), 8: (0.005, 0.01, 0.02, 0.04)}
#: One rate above the grid, for the arms whose top rate won on the grid (decided from the grid's results).
FM_NOBN_EXTEND = {(128, "gn"): 0.8, (8, "gn"): 0.08, (128, "nf-agc0.1"): 0.8, (8, "nf-agc0.1"): 0.08}
FM_NOBN_SEEDS = tuple(range(10))
FM_NOBN_EPOCHS = 2


def _nobn_args(batch: int, arm: str, lrs: Dict[str, float], *rest: str) -> List[str]:
    flags, methods = FM_NOBN_ARMS[arm]
    return ["--methods", ",".join(methods), "--lr", f"{lrs['baseline']:g}", "--method-lr",
            ",".join(f"{m}={lrs[m]:g}" for m in methods), "--batch-size", str(batch), "--epochs",
            str(FM_NOBN_EPOCHS), *flags, *rest, *FM]


def _nobn_val(batch: int, arm: str) -> List[Tuple[str, List[str]]]:
    methods = FM_NOBN_ARMS[arm][1]
    grid = FM_NOBN_GRID[batch] + ((FM_NOBN_EXTEND[batch, arm],) if (batch, arm) in FM_NOBN_EXTEND else ())
    return [(f"fm-nobn-val-b{batch}-{arm}-lr{i}",
             _nobn_args(batch, arm, {m: lr for m in methods}, "--val-fraction", "0.1", "--seeds", "0"))
            for i, lr in enumerate(grid)]


def _nobn_best(batch: int, candidates: Sequence[str]) -> Tuple[str, Dict[str, float]]:
    """Of the validation arms ``candidates``, the one whose best rate scored highest (baseline's final validation
    accuracy), with its chosen rates; ``SystemExit`` while any has not run."""
    best: Optional[Tuple[float, str, Dict[str, float]]] = None
    for arm in candidates:
        lrs = _chosen("fm-nobn-val", FM_NOBN_ARMS[arm][1], _nobn_val(batch, arm))
        score = _nobn_val_score(batch, arm, "baseline")
        if best is None or score > best[0]:
            best = (score, arm, lrs)
    assert best is not None
    return best[1], best[2]


def _opt_of(args: Sequence[str], flag: str) -> str:
    return args[list(args).index(flag) + 1]


def _nobn_test() -> List[Tuple[str, Optional[List[str]]]]:
    out: List[Tuple[str, Optional[List[str]]]] = []
    chosen: Dict[int, Dict[str, Tuple[str, Dict[str, float]]]] = {batch: {} for batch in FM_NOBN_GRID}
    for batch in FM_NOBN_GRID:
        for arm, candidates in FM_NOBN_TEST_ARMS.items():
            try:
                chosen[batch][arm] = _nobn_best(batch, candidates)
            except SystemExit:
                out.append((f"fm-nobn-b{batch}-{arm}", None))
    for seed in FM_NOBN_SEEDS:
        for batch in FM_NOBN_GRID:
            for arm, (val_arm, lrs) in chosen[batch].items():
                out.append((f"fm-nobn-b{batch}-s{seed}-{arm}", _nobn_args(batch, val_arm, lrs, "--seeds", str(seed))))
    return out


STAGES["fm-nobn-val"] = lambda: [run for b in FM_NOBN_GRID for a in FM_NOBN_ARMS for run in _nobn_val(b, a)]
STAGES["fm-nobn"] = _nobn_test


#: Post-hoc kappa and rho of each fm-nobn test run's final model: held-aside training batches (no augmentation) of
#: this many samples, the runner's diagnostic batches (``diagnostic_batches``) at batch 128.
FM_NOBN_DIAG_BATCHES = 4


def _final_diagnostics(name: str) -> Dict[str, Tuple[float, float]]:
    """Per method of run ``name``: ``(kappa, rho)`` of its final checkpoint's features (every block convolution's
    input; ``T Phi T^T`` for a whitening layer), measured once and kept in the run's folder
    (``final_diagnostics.json``). The runs train with ``--diag-batches 0`` (no per-epoch cost in their times)."""
    import dataclasses

    import torch

    from whitenlayers.experiment import engine
    from whitenlayers.experiment.checkpoint import checkpoint_path
    from whitenlayers.experiment.config import METHOD_REGISTRY, RunConfig, method_kwargs
    from whitenlayers.experiment.data import load_dataset
    from whitenlayers.experiment._safe_io import load_checkpoint

    cache = os.path.join(RUNS, name, "final_diagnostics.json")
    if os.path.isfile(cache):
        return {m: tuple(v) for m, v in json.load(open(cache)).items()}  # type: ignore[misc]
    cfg = RunConfig.from_record(json.load(open(os.path.join(RUNS, name, "config.json"))))
    cfg = dataclasses.replace(cfg, batch_size=128, diag_batches=FM_NOBN_DIAG_BATCHES, out=os.path.join(RUNS, name))
    bundle = load_dataset(cfg.dataset, data_dir=cfg.data_dir, test_fraction=float(cfg.test_fraction))
    out: Dict[str, Tuple[float, float]] = {}
    for method in cfg.methods:
        seed = int(cfg.seeds[0])
        torch.manual_seed(seed)
        model = engine.build_model(cfg, bundle.num_classes, bundle.in_channels)
        model = METHOD_REGISTRY[method].apply(model, method_kwargs(cfg, method))
        model.load_state_dict(load_checkpoint(checkpoint_path(cfg.out, method, seed))["model"])
        d = engine.measure_diagnostics(model, engine.diagnostic_batches(cfg, bundle, seed), torch.device("cpu"))
        out[method] = (d["kappa_mean"], d["rho_mean"])
    with open(cache, "w") as f:
        json.dump(out, f)
    return out


def _nobn_val_score(batch: int, arm: str, method: str) -> float:
    """``method``'s best final validation accuracy over ``arm``'s grid at ``batch`` (NaN before it ran)."""
    scores = [float(np.mean(_finals(rows, method))) for rows in (_rows(n) for n, _ in _nobn_val(batch, arm))
              if rows is not None and _finals(rows, method)]
    scores = [v if math.isfinite(v) else -1.0 for v in scores]  # as _chosen scores a non-finite result
    return max(scores) if scores else float("nan")


def fm_nobn_val_table() -> str:
    """The fm-nobn-val grid: per batch, arm and method, the final validation accuracy (halfway in brackets) per
    rate, and the rate chosen."""
    lines = ["| batch | arm | method | " + " | ".join(f"lr{i}" for i in range(5)) + " | chosen rate |",
             "|" + "---|" * 9]
    for batch in FM_NOBN_GRID:
        for arm, (_, methods) in FM_NOBN_ARMS.items():
            runs = _nobn_val(batch, arm)
            for m in methods:
                cells = []
                for name, args in runs:
                    rows = _rows(name)
                    by = [r for r in (rows or []) if r["method"] == m]
                    by.sort(key=lambda r: r["epoch"])
                    cells.append(f"{_opt_of(args, '--lr')} → {by[-1]['test_acc']:.2f} ({by[0]['test_acc']:.1f})"
                                 if by else "(not run)")
                cells += [""] * (5 - len(cells))
                try:
                    chosen = f"{_chosen('fm-nobn-val', (m,), runs)[m]:g}"
                except SystemExit:
                    chosen = "—"
                lines.append(f"| {batch} | {arm} | {m} | " + " | ".join(cells) + f" | {chosen} |")
    return "\n".join(lines) + "\n"


def fm_nobn_table() -> str:
    """The fm-nobn stage's table, per batch regime: each arm and method's final test accuracy, halfway (epoch 1 of
    2), its paired difference from the best non-whitened arm (the one with the best validation accuracy; the
    best whitened arm is chosen the same way), the CPU seconds per epoch against BatchNorm's, how many seeds
    reach the reference's final accuracy and in how many CPU seconds against the reference, kappa and rho of
    the final model, and seeds that diverged (final accuracy at most 12 %); then the best whitened arm against
    each non-whitened arm, paired by seed. Only seeds whose runs of every arm finished."""
    from convergence_tables import _by, _ci, _cmd, _ms

    head = ["batch", "arm", "method", "rate", "test acc (%)", "halfway (%)", "Δ vs reference, final [95 % CI]",
            "Δ vs reference, halfway [95 % CI]", "CPU s / epoch vs bn", "reached reference's final (CPU s vs "
            "reference)", "kappa", "rho", "seeds (diverged)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    versus = ["| batch | best whitened arm | against | paired Δ, final [95 % CI] | paired Δ, halfway [95 % CI] | "
              "ahead on (seeds) |", "|---|---|---|---|---|---|"]
    loads: List[float] = []
    refs: Dict[int, str] = {}
    for batch in FM_NOBN_GRID:
        try:
            chosen = {arm: _nobn_best(batch, cands) for arm, cands in FM_NOBN_TEST_ARMS.items()}
        except SystemExit:
            lines.append(f"| {batch} | (validation not finished) |" + " |" * (len(head) - 2))
            continue
        runs: Dict[Tuple[str, str], Dict[int, List[dict]]] = {}
        seeds = []
        for seed in FM_NOBN_SEEDS:
            got = {arm: _rows(f"fm-nobn-b{batch}-s{seed}-{arm}") for arm in chosen}
            if any(r is None for r in got.values()):
                continue
            seeds.append(seed)
            for arm, rows in got.items():
                for m in FM_NOBN_ARMS[chosen[arm][0]][1]:
                    runs.setdefault((arm, m), {}).update(_by(rows, m))
                loads += [r["load1"] for r in rows if math.isfinite(r.get("load1", float("nan")))]
        if not seeds:
            lines.append(f"| {batch} | (not run) |" + " |" * (len(head) - 2))
            continue
        keys = list(runs)
        val = {(arm, m): _nobn_val_score(batch, chosen[arm][0], m) for arm, m in keys}
        ref = max((k for k in keys if k[1] == "baseline"), key=lambda k: val[k])
        best_w = max((k for k in keys if k[1] != "baseline"), key=lambda k: val[k])
        refs[batch] = f"{ref[0]}" + (f" ({ref[1]})" if ref[1] != "baseline" else "")

        def acc(k, s, at=-1):
            return runs[k][s][at]["test_acc"]

        def cpu(k, s):
            return float(np.mean([r["cpu_time"] for r in runs[k][s]]))

        for k in keys:
            arm, m = k
            reach, ratio = [], []
            for s in seeds:
                target = acc(ref, s)
                t = 0.0
                for r in runs[k][s]:
                    t += r["cpu_time"]
                    if r["test_acc"] >= target:
                        reach.append(s)
                        ratio.append(t / sum(r2["cpu_time"] for r2 in runs[ref][s]))
                        break
            diag = [_final_diagnostics(f"fm-nobn-b{batch}-s{s}-{arm}")[m] for s in seeds]
            label = arm + (" (chosen: best whitened)" if k == best_w else " (reference)" if k == ref else "")
            rate = f"{chosen[arm][1][m]:g}"
            if arm == "nf":
                rate += f", agc {_opt_of(FM_NOBN_ARMS[chosen[arm][0]][0], '--agc')}"
            lines.append("| " + " | ".join([
                str(batch), label, m, rate,
                _ms([acc(k, s) for s in seeds]), _ms([acc(k, s, 0) for s in seeds]),
                "—" if k == ref else _ci([acc(k, s) - acc(ref, s) for s in seeds]),
                "—" if k == ref else _ci([acc(k, s, 0) - acc(ref, s, 0) for s in seeds]),
                _ratio([cpu(k, s) / cpu(("bn", "baseline"), s) for s in seeds]),
                f"{len(reach)}/{len(seeds)}" + (f", {_ratio(ratio)}" if reach else ""),
                _ms([d[0] for d in diag]), _ms([d[1] for d in diag]),
                f"{len(seeds)} ({sum(acc(k, s) <= 12.0 for s in seeds)})"]) + " |")
        for k in keys:  # the best whitened arm against every non-whitened one, paired by seed
            if k[1] == "baseline":
                versus.append(f"| {batch} | {best_w[0]} ({best_w[1]}) | {k[0]} | "
                              f"{_ci([acc(best_w, s) - acc(k, s) for s in seeds])} | "
                              f"{_ci([acc(best_w, s, 0) - acc(k, s, 0) for s in seeds])} | "
                              f"{sum(acc(best_w, s) > acc(k, s) for s in seeds)}/{len(seeds)} |")
    text = "\n".join(lines) + "\n\n" + "\n".join(versus)
    text += _load_line(loads)
    text += ("\n\nReference: the non-whitened arm with the best validation accuracy in its regime (" +
             ", ".join(f"batch {b}: {r}" for b, r in refs.items()) + "). kappa and rho: the final model's, on "
             f"{FM_NOBN_DIAG_BATCHES} held-aside training batches of 128 (no augmentation).")
    first = [n for n, args in _nobn_test() if args is not None and f"-s{FM_NOBN_SEEDS[0]}-" in n]
    return text + "\n\nCommands (seed 0; the other seeds change `--seeds` and `--out` only):\n\n" + \
        "\n".join(f"    {_cmd(n)}" for n in first) + "\n"


def _ratio(vals: Sequence[float]) -> str:
    """A paired-table cell for per-seed ratios: geometric mean [95 % interval] (the interval only where it says
    something), ``—`` for fewer than 3 seeds."""
    from whitenlayers.experiment.report import geometric_t_interval, informative

    if len(vals) < 3:
        return "—"
    m, lo, hi = geometric_t_interval(vals)
    return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]" if informative(lo, hi) else f"{m:.2f}x"


def _load_line(loads: Sequence[float]) -> str:
    """The paired tables' load line (empty without loads)."""
    if not loads:
        return ""
    return (f"\n\nLoad (1-minute load average at the epochs' ends): median {np.median(loads):.2f}, "
            f"range {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores, one run at a time, 1 thread.")


def fm_schedule_table() -> str:
    """The fm-schedule stage's table: per budget and method, each arm's final validation accuracy, the paired
    difference (GPU settings minus defaults) at the final epoch and at epoch 1, each arm's paired difference
    from the baseline (the defaults' run of the same seed), and the CPU seconds per epoch against that baseline's;
    only seeds whose two runs both finished."""
    from convergence_tables import _by, _ci, _ms
    from whitenlayers.experiment.config import METHOD_LABELS

    head = ["budget", "method", "defaults (e1, L10): val acc (%)", "GPU (e5, L50): val acc (%)",
            "paired Δ GPU − defaults, final [95 % CI]", "epoch 1 of 2: defaults → GPU (%)",
            "paired Δ at epoch 1 [95 % CI]",
            "defaults − baseline [95 % CI]", "GPU − baseline [95 % CI]",
            "CPU s / epoch vs baseline: defaults → GPU", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    loads: List[float] = []
    cmds: List[str] = []
    for b in FM_SCHEDULE_BUDGETS:
        ref: Dict[str, Dict[int, List[dict]]] = {}
        gpu: Dict[str, Dict[int, List[dict]]] = {}
        for seed in FM_SCHEDULE_SEEDS:
            r1, r5 = _rows(f"fm-schedule-b{b}-s{seed}-e1b10"), _rows(f"fm-schedule-b{b}-s{seed}-e5b50")
            if r1 is None or r5 is None:
                continue
            for m in ("baseline",) + OURS:
                ref.setdefault(m, {}).update(_by(r1, m))
            for m in OURS:
                gpu.setdefault(m, {}).update(_by(r5, m))
            loads += [r["load1"] for r in r1 + r5 if math.isfinite(r.get("load1", float("nan")))]
            if seed == FM_SCHEDULE_SEEDS[0]:
                cmds += [f"fm-schedule-b{b}-s{seed}-e1b10", f"fm-schedule-b{b}-s{seed}-e5b50"]
        if not ref:
            lines.append(f"| {b} | (not run) |" + " |" * (len(head) - 2))
            continue
        base = ref["baseline"]
        seeds = sorted(base)
        lines.append("| " + " | ".join([str(b), "baseline", _ms([base[s][-1]["test_acc"] for s in seeds]), "—", "—",
                                        _ms([base[s][0]["test_acc"] for s in seeds]) if b > 1 else "—", "—",
                                        "—", "—", "1", str(len(seeds))]) + " |")
        for m in OURS:
            a, g = ref[m], gpu[m]

            def cpu(runs, s):
                return np.mean([r["cpu_time"] for r in runs[s]]) / np.mean([r["cpu_time"] for r in base[s]])
            lines.append("| " + " | ".join([
                str(b), METHOD_LABELS.get(m, m), _ms([a[s][-1]["test_acc"] for s in seeds]),
                _ms([g[s][-1]["test_acc"] for s in seeds]),
                _ci([g[s][-1]["test_acc"] - a[s][-1]["test_acc"] for s in seeds]),
                f"{_ms([a[s][0]['test_acc'] for s in seeds])} → {_ms([g[s][0]['test_acc'] for s in seeds])}"
                if b > 1 else "—",
                _ci([g[s][0]["test_acc"] - a[s][0]["test_acc"] for s in seeds]) if b > 1 else "(= final)",
                _ci([a[s][-1]["test_acc"] - base[s][-1]["test_acc"] for s in seeds]),
                _ci([g[s][-1]["test_acc"] - base[s][-1]["test_acc"] for s in seeds]),
                f"{_ratio([cpu(a, s) for s in seeds])} → {_ratio([cpu(g, s) for s in seeds])}",
                str(len(seeds))]) + " |")
    from convergence_tables import _cmd
    text = "\n".join(lines)
    text += _load_line(loads)
    return text + "\n\nCommands (seed 0; the other seeds change `--seeds` only):\n\n" + \
        "\n".join(f"    {_cmd(n)}" for n in cmds) + "\n"


def fm_async_table() -> str:
    """The fm-async stage's table: per block size and method, the synchronous and the asynchronous fold's final
    validation accuracy, their paired difference (async minus sync) at the final epoch and halfway (epoch 1 of 2),
    and the CPU seconds per epoch of the asynchronous run against the synchronous one (one thread each, the
    worker's CPU time included: the fold moves, it does not vanish); only seeds whose two runs both finished."""
    from convergence_tables import _by, _ci, _ms
    from whitenlayers.experiment.config import METHOD_LABELS

    head = ["block", "method", "sync: val acc (%)", "async: val acc (%)", "paired Δ async − sync, final [95 % CI]",
            "epoch 1 of 2: sync → async (%)", "paired Δ at epoch 1 [95 % CI]", "CPU s / epoch, async vs sync",
            "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    loads: List[float] = []
    for block in (10, 50):
        runs: Dict[str, Dict[str, Dict[int, List[dict]]]] = {"sync": {}, "async": {}}
        for seed in FM_ASYNC_SEEDS:
            pair = {arm: _rows(f"fm-async-s{seed}-b{block}-{arm}") for arm in runs}
            if any(r is None for r in pair.values()):
                continue
            for arm, rows in pair.items():
                for m in OURS:
                    runs[arm].setdefault(m, {}).update(_by(rows, m))
                loads += [r["load1"] for r in rows if math.isfinite(r.get("load1", float("nan")))]
        for m in OURS:
            a, g = runs["sync"].get(m, {}), runs["async"].get(m, {})
            seeds = sorted(set(a) & set(g))
            if not seeds:
                lines.append(f"| {block} | {METHOD_LABELS.get(m, m)} | (not run) |" + " |" * (len(head) - 3))
                continue
            cpu = _ratio([np.mean([r["cpu_time"] for r in g[s]]) / np.mean([r["cpu_time"] for r in a[s]])
                          for s in seeds])
            lines.append("| " + " | ".join([
                str(block), METHOD_LABELS.get(m, m), _ms([a[s][-1]["test_acc"] for s in seeds]),
                _ms([g[s][-1]["test_acc"] for s in seeds]),
                _ci([g[s][-1]["test_acc"] - a[s][-1]["test_acc"] for s in seeds]),
                f"{_ms([a[s][0]['test_acc'] for s in seeds])} → {_ms([g[s][0]['test_acc'] for s in seeds])}",
                _ci([g[s][0]["test_acc"] - a[s][0]["test_acc"] for s in seeds]), cpu, str(len(seeds))]) + " |")
    from convergence_tables import _cmd
    text = "\n".join(lines)
    text += _load_line(loads)
    first = [n for n, _ in _fashion_async() if n.startswith(f"fm-async-s{FM_ASYNC_SEEDS[0]}-")]
    return text + "\n\nCommands (seed 0; the other seeds change `--seeds` and `--out` only):\n\n" + \
        "\n".join(f"    {_cmd(n)}" for n in first) + "\n"


def fm_damped_table() -> str:
    """The fm-damped stage's table: per budget, the baseline and grad with the practical gains (one run) and grad
    with the damped gains (another, same seed), each one's final validation accuracy, the paired difference damped
    minus practical at the final epoch and (2 epochs) at epoch 1, each arm's paired difference from the baseline, and
    the CPU seconds per epoch of the damped arm against the practical one; only seeds whose two runs both finished."""
    from convergence_tables import _by, _ci, _ms

    head = ["budget", "baseline: val acc (%)", "grad practical: val acc (%)", "grad damped: val acc (%)",
            "paired Δ damped − practical, final [95 % CI]", "epoch 1 of 2: practical → damped (%)",
            "paired Δ at epoch 1 [95 % CI]", "practical − baseline [95 % CI]", "damped − baseline [95 % CI]",
            "CPU s / epoch, damped vs practical", "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    loads: List[float] = []
    for b in FM_DAMPED_BUDGETS:
        base: Dict[int, List[dict]] = {}
        prac: Dict[int, List[dict]] = {}
        damp: Dict[int, List[dict]] = {}
        for seed in FM_DAMPED_SEEDS:
            rp, rd = _rows(f"fm-damped-b{b}-s{seed}-practical"), _rows(f"fm-damped-b{b}-s{seed}-damped")
            if rp is None or rd is None:
                continue
            base.update(_by(rp, "baseline"))
            prac.update(_by(rp, "grad"))
            damp.update(_by(rd, "grad"))
            loads += [r["load1"] for r in rp + rd if math.isfinite(r.get("load1", float("nan")))]
        seeds = sorted(set(base) & set(prac) & set(damp))
        if not seeds:
            lines.append(f"| {b} | (not run) |" + " |" * (len(head) - 2))
            continue

        def acc(runs, s, at=-1):
            return runs[s][at]["test_acc"]

        cpu = _ratio([np.mean([r["cpu_time"] for r in damp[s]]) / np.mean([r["cpu_time"] for r in prac[s]])
                      for s in seeds])
        lines.append("| " + " | ".join([
            str(b), _ms([acc(base, s) for s in seeds]), _ms([acc(prac, s) for s in seeds]),
            _ms([acc(damp, s) for s in seeds]), _ci([acc(damp, s) - acc(prac, s) for s in seeds]),
            f"{_ms([acc(prac, s, 0) for s in seeds])} → {_ms([acc(damp, s, 0) for s in seeds])}" if b > 1 else "—",
            _ci([acc(damp, s, 0) - acc(prac, s, 0) for s in seeds]) if b > 1 else "(= final)",
            _ci([acc(prac, s) - acc(base, s) for s in seeds]), _ci([acc(damp, s) - acc(base, s) for s in seeds]),
            cpu, str(len(seeds))]) + " |")
    from convergence_tables import _cmd
    text = "\n".join(lines)
    text += _load_line(loads)
    first = [n for n, _ in _fashion_damped() if f"-s{FM_DAMPED_SEEDS[0]}-" in n]
    return text + "\n\nCommands (seed 0; the other seeds change `--seeds` and `--out` only):\n\n" + \
        "\n".join(f"    {_cmd(n)}" for n in first) + "\n"


# Large batches (Shallue et al. 2018): steps to a target validation accuracy against the batch size, per arm, on
# Fashion-MNIST at the FM settings (CIFAR ResNet-8, width 8, no augmentation, SGD momentum 0.9, weight decay 5e-4;
# SOAP its own update), batch sizes 32 to 2048 (doublings). A constant learning rate (--schedule constant): with a
# stop at the target, a rate that decays to 0 at the end of a step budget would make the budget chosen per batch
# set the steps (a run reaches the target as its rate anneals), perfect scaling by construction. Validation split:
# 5 % of the training images (3,000, stratified; 57,000 left to train on), evaluated about 90 times per step budget
# with BatchNorm statistics recomputed at the current weights from 1,024 fixed training images (--precise-bn: at a
# high constant rate the running averages lag the weights by up to ~40 accuracy points, which would make the first
# evaluation above the target a matter of luck). A run stops at its first evaluation at or above LB_TARGET
# (--stop-acc), or at its step budget (not reached). Learning rate per (batch, arm) on seed 0: a 3-point grid,
# factors of 2 around a centre that grows as batch^0.75 for the SGD arms (0.2 at batch 128; the pilot's best
# rates grew so) and batch^0.5 for SOAP (0.005 at 128), extended by one rate (at most two) beyond an edge that
# scored best; the score is the fewest steps to the target (then the higher accuracy at that evaluation, then the
# lower rate; a grid where no rate reached it: the best accuracy). The trials of a grid run one after the other,
# the centre first, each with the step budget cut to the fewest steps to the target found so far (a trial that
# has not reached it by then cannot be chosen, so the choice is the full budget's). Then seeds 1-3 at the chosen
# rates with the full budget (seeds 4-5 added at a batch where a whitened arm's paired ratio interval spans more
# than a factor 1.5), one run per (seed, batch, arm), paired by seed (same initial weights and data order), a
# seed's every batch and arm before the next seed. Sized to a 2-core machine: seed 1 runs every arm; seeds 2 and 3
# (and 4-5) only the baseline and, at each batch, the whitened arm that needed the fewest steps on the validation
# seed (the one the goal asks about), so the other arms' rows rest on one seed.
LB_ARMS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "baseline": ("baseline", ()), "grad": ("grad", ()), "grad-damped": ("grad", ("--gains", "damped")),
    "recursive": ("recursive", ()), "kfac": ("kfac", ()), "soap": ("soap", ())}
LB_WHITENED = ("grad", "grad-damped", "recursive")
LB_BATCHES = (32, 64, 128, 256, 512, 1024, 2048)
#: The target validation accuracy (percent): see docs/CONVERGENCE.md for why this value.
LB_TARGET = 80.0
LB_VAL_SEED = 0
LB_SEEDS = (1, 2, 3)
#: The seeds that run every arm; the others run the baseline and the best whitened arm (_lb_seed_arms).
LB_ALL_ARMS_SEEDS = (1,)
LB_MORE_SEEDS = (4, 5)
#: A whitened arm's paired ratio interval (high / low) wider than this at a batch adds LB_MORE_SEEDS there.
LB_WIDE = 1.5
LB_GRID = (0, 1, -1)  # the rates: centre x 2^k, in the order they run
LB_MAX_EXTEND = 2
#: The step budget per batch: the steps of this many training images, plus LB_BUDGET_STEPS steps.
LB_BUDGET_EXAMPLES = 48_000
LB_BUDGET_STEPS = 150
LB_DATA = ["--dataset", "fashion-mnist", "--model", "resnet8", "--width", "8"]
LB = [*LB_DATA, "--schedule", "constant", "--diag-batches", "0", "--val-fraction", "0.05", "--precise-bn", "1024"]


def _lb_centre(arm: str, batch: int) -> float:
    return 0.005 * (batch / 128) ** 0.5 if arm == "soap" else 0.2 * (batch / 128) ** 0.75


def _lb_rate(arm: str, batch: int, k: int) -> float:
    """The grid's rate ``centre x 2^k``, to 3 significant digits."""
    return float(f"{_lb_centre(arm, batch) * 2.0 ** k:.3g}")


def _lb_budget(batch: int) -> int:
    return -(-LB_BUDGET_EXAMPLES // batch) + LB_BUDGET_STEPS


def _lb_every(batch: int) -> int:
    """Evaluate every this many steps: about 90 evaluations per step budget."""
    return max(1, _lb_budget(batch) // 90)


def _lb_args(arm: str, batch: int, lr: float, seed: int, budget: Optional[int] = None) -> List[str]:
    method, flags = LB_ARMS[arm]
    return ["--methods", method, "--lr", f"{lr:g}", "--method-lr", f"{method}={lr:g}", "--batch-size", str(batch),
            "--seeds", str(seed), "--max-steps", str(budget or _lb_budget(batch)), "--eval-every-steps",
            str(_lb_every(batch)), "--stop-acc", f"{LB_TARGET:g}", *flags, *LB]


def _lb_val_name(batch: int, arm: str, k: int) -> str:
    return f"lb-val-b{batch}-{arm}-lr{_lb_rate(arm, batch, k):g}"


def _lb_reach(name: str, arm: str) -> Optional[Dict[int, Dict[str, float]]]:
    """Per seed of run ``name``: the first evaluation at or above LB_TARGET (``step``, ``examples``, nan when not
    reached; ``at``, its accuracy), the steps run (``budget``) and the best accuracy (``best``); ``None`` before
    the run finished."""
    if _rows(name) is None:
        return None
    from whitenlayers.experiment.report import read_steps, steps_to_target

    rows = read_steps(os.path.join(RUNS, name, "steps.csv"))
    method = LB_ARMS[arm][0]
    out = steps_to_target(rows, LB_TARGET).get(method, {})
    for seed, rec in out.items():
        accs = [r["test_acc"] for r in rows if r["method"] == method and r["seed"] == seed]
        rec["best"] = max(accs) if accs and all(math.isfinite(a) for a in accs) else 0.0
        rec["at"] = next((a for a in accs if a >= LB_TARGET), float("nan"))
    return out


def _lb_score(batch: int, arm: str, k: int) -> Optional[Tuple[float, float, float]]:
    """A trial's score, lower is better: ``(steps to the target, -accuracy there, rate)``, or ``(inf, -best
    accuracy, rate)`` when it did not reach the target; ``None`` before it finished."""
    reach = _lb_reach(_lb_val_name(batch, arm, k), arm)
    if reach is None or LB_VAL_SEED not in reach:
        return None
    rec = reach[LB_VAL_SEED]
    lr = _lb_rate(arm, batch, k)
    return (rec["step"], -rec["at"], lr) if math.isfinite(rec["step"]) else (math.inf, -rec["best"], lr)


def _lb_grid(batch: int, arm: str) -> Tuple[List[int], Optional[int], Optional[int]]:
    """At (batch, arm): the exponents ``k`` run or due so far, in their order; the chosen one (``None`` while a
    trial is due); and the step budget of the trial due (the fewest steps to the target so far, else the full
    budget). LB_GRID, then one beyond an edge that scored best, at most LB_MAX_EXTEND times on a side."""
    ks: List[int] = []
    todo = list(LB_GRID)
    while True:
        while todo:
            k = todo.pop(0)
            ks.append(k)
            if _lb_score(batch, arm, k) is None:
                done = [v for v in (_lb_score(batch, arm, j) for j in ks[:-1]) if v is not None]
                reached = [v[0] for v in done if math.isfinite(v[0])]
                return ks, None, int(min(reached)) if reached else _lb_budget(batch)
        scores = {k: _lb_score(batch, arm, k) for k in ks}
        best = min(ks, key=lambda k: scores[k])  # type: ignore[arg-type, return-value]
        if best == min(ks) and min(ks) > min(LB_GRID) - LB_MAX_EXTEND:
            todo.append(min(ks) - 1)
        elif best == max(ks) and max(ks) < max(LB_GRID) + LB_MAX_EXTEND:
            todo.append(max(ks) + 1)
        else:
            return ks, best, None


def _lb_val() -> List[Tuple[str, List[str]]]:
    out = []
    for b in LB_BATCHES:
        for arm in LB_ARMS:
            ks, _, budget = _lb_grid(b, arm)
            for i, k in enumerate(ks):
                due = i == len(ks) - 1 and budget is not None  # the trial due (the others finished)
                out.append((_lb_val_name(b, arm, k), _lb_args(arm, b, _lb_rate(arm, b, k), LB_VAL_SEED,
                                                              budget if due else None)))
    return out


def _lb_chosen() -> Dict[Tuple[int, str], float]:
    """(batch, arm) -> the chosen rate, for the grids that are complete."""
    out = {}
    for b in LB_BATCHES:
        for arm in LB_ARMS:
            k = _lb_grid(b, arm)[1]
            if k is not None:
                out[b, arm] = _lb_rate(arm, b, k)
    return out


def _lb_best_whitened(batch: int) -> Optional[str]:
    """The whitened arm with the fewest steps to the target on the validation seed at its chosen rate (the
    higher accuracy there, then the order of LB_WHITENED, on a tie); ``None`` while a grid is incomplete."""
    scored = []
    for arm in LB_WHITENED:
        k = _lb_grid(batch, arm)[1]
        if k is None:
            return None
        scored.append((_lb_score(batch, arm, k), LB_WHITENED.index(arm), arm))
    return min(scored)[2]  # type: ignore[type-var]


def _lb_seed_arms(batch: int, seed: int) -> List[str]:
    """The arms seed ``seed`` runs at ``batch``: every arm for LB_ALL_ARMS_SEEDS, else the baseline and the best
    whitened arm."""
    if seed in LB_ALL_ARMS_SEEDS:
        return list(LB_ARMS)
    best = _lb_best_whitened(batch)
    return ["baseline"] + ([best] if best else [])


def _lb_name(batch: int, arm: str, seed: int) -> str:
    return f"lb-b{batch}-{arm}-s{seed}"


def _lb_wide() -> List[int]:
    """The batches where every LB_SEEDS run finished and a whitened arm run on every seed there has a paired ratio
    to the baseline (steps to the target, both reached) whose 95 % interval is wider than a factor LB_WIDE (or
    fewer than 3 pairs)."""
    from whitenlayers.experiment.report import geometric_t_interval

    wide = []
    for b in LB_BATCHES:
        got = {(arm, s): _lb_reach(_lb_name(b, arm, s), arm) for s in LB_SEEDS for arm in _lb_seed_arms(b, s)}
        if any(v is None for v in got.values()):
            continue
        for arm in sorted({a for a, _ in got if a in LB_WHITENED and all((a, s) in got for s in LB_SEEDS)}):
            ratios = [got[arm, s][s]["step"] / got["baseline", s][s]["step"]  # type: ignore[index]
                      for s in LB_SEEDS if (arm, s) in got and s in got[arm, s]  # type: ignore[operator]
                      and s in got["baseline", s]]  # type: ignore[operator]
            ratios = [r for r in ratios if math.isfinite(r)]
            _, lo, hi = geometric_t_interval(ratios) if len(ratios) >= 2 else (0.0, math.nan, math.nan)
            if len(ratios) < 3 or not hi <= LB_WIDE * lo:
                wide.append(b)
                break
    return wide


def _lb_test() -> List[Tuple[str, Optional[List[str]]]]:
    chosen = _lb_chosen()
    out: List[Tuple[str, Optional[List[str]]]] = [(f"lb-b{b}-{arm}", None) for b in LB_BATCHES for arm in LB_ARMS
                                                  if (b, arm) not in chosen]
    core = {b: ["baseline", _lb_best_whitened(b)] for b in LB_BATCHES}
    for seed in LB_SEEDS:  # the baseline and the best whitened arm first (the goal's pairs), seed by seed
        out += [(_lb_name(b, arm, seed), _lb_args(arm, b, chosen[b, arm], seed))
                for b in LB_BATCHES for arm in _lb_seed_arms(b, seed) if arm in core[b] and (b, arm) in chosen]
    for seed in LB_SEEDS:  # then the other arms
        out += [(_lb_name(b, arm, seed), _lb_args(arm, b, chosen[b, arm], seed))
                for b in LB_BATCHES for arm in _lb_seed_arms(b, seed) if arm not in core[b] and (b, arm) in chosen]
    wide = _lb_wide()
    for seed in LB_MORE_SEEDS:
        out += [(_lb_name(b, arm, seed), _lb_args(arm, b, chosen[b, arm], seed))
                for b in wide for arm in _lb_seed_arms(b, seed) if (b, arm) in chosen]
    return out


#: Seconds per step: one run per batch (and one for the damped gains, which take a run-wide flag): the arms
#: interleaved every 10 steps (a training subset of 10 batches: one epoch), 30 steps, timed over steps 11-30
#: (two whitening folds, one K-FAC inverse), at the grid's centre rates; seed 0, the test split's first 256
#: images for the (untimed) evaluations.
LB_TIME_ARMS = ("baseline", "grad", "recursive", "kfac", "soap")


def _lb_time(device: Sequence[str] = ()) -> List[Tuple[str, List[str]]]:
    out = []
    for b in LB_BATCHES:
        rest = ["--batch-size", str(b), "--train-subset", str(10 * b), "--test-subset", "256", "--max-steps", "30",
                "--eval-every-steps", "10", "--schedule", "constant", "--seeds", "0", "--diag-batches", "0",
                *LB_DATA, *device]
        per = ",".join(f"{LB_ARMS[a][0]}={_lb_centre(a, b):.3g}" for a in LB_TIME_ARMS)
        suffix = "-gpu" if device else ""
        out.append((f"lb-time{suffix}-b{b}", ["--methods", ",".join(LB_ARMS[a][0] for a in LB_TIME_ARMS), "--lr",
                                              f"{_lb_centre('grad', b):.3g}", "--method-lr", per, *rest]))
        out.append((f"lb-time{suffix}-b{b}-damped", ["--methods", "grad", "--lr", f"{_lb_centre('grad', b):.3g}",
                                                     "--gains", "damped", *rest]))
    return out


STAGES["lb-time"] = _lb_time
STAGES["lb-time-gpu"] = lambda: _lb_time(["--device", "cuda"])  # for a machine with a GPU; not run here
STAGES["lb-val"] = _lb_val
STAGES["lb"] = _lb_test


def _rows(name: str):
    path = os.path.join(RUNS, name, "metrics.csv")
    if not os.path.isfile(os.path.join(RUNS, name, "summary.md")):
        return None
    from whitenlayers.experiment.report import read_metrics
    return read_metrics(path)


def _finals(rows, method: str) -> List[float]:
    by: Dict[int, List] = {}
    for r in rows:
        if r["method"] == method:
            by.setdefault(r["seed"], []).append(r)
    return [sorted(v, key=lambda r: r["epoch"])[-1]["test_acc"] for _, v in sorted(by.items())]


def command(name: str, args: Sequence[str]) -> List[str]:
    common = list(COMMON)
    if "--seeds" in args:  # the stage's own seeds
        i = common.index("--seeds")
        del common[i:i + 2]
    if "--downsample" not in args:  # the study's 28x28 digits (the default run's are pooled to 14x14)
        common += ["--downsample", "1"]
    return [sys.executable, "-m", "whitenlayers.experiment", *args, *common, "--out", os.path.join(RUNS, name)]


def _launch(cmd: Sequence[str], log) -> int:
    """Run one command (``python -m whitenlayers.experiment ...``) in the repository root, its output to ``log``;
    the exit status."""
    return subprocess.call(list(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _run_one(name: str, args: Sequence[str]) -> str:
    if _rows(name) is not None:
        return f"{name}: done already"
    cmd = command(name, args)
    os.makedirs(os.path.join(RUNS, name), exist_ok=True)
    with open(os.path.join(RUNS, name + ".log"), "w") as log:
        rc = _launch(cmd, log)
    with open(os.path.join(RUNS, name, "command.txt"), "w") as f:
        f.write(" ".join(["python"] + cmd[1:]).replace(ROOT + "/", "") + "\n")
    return f"{name}: exit {rc}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("run", "tables", "list"))
    p.add_argument("stages", nargs="*")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args(argv)
    if a.what == "list":
        for s in a.stages or STAGES:
            for name, args in STAGES[s]():
                print(name, ":", "(needs its validation stage)" if args is None else " ".join(command(name, args)[1:]))
        return 0
    if a.what == "tables":
        from convergence_tables import write_tables  # noqa: E402
        stages = a.stages or list(STAGES)
        import convergence_large_batch as lb  # noqa: E402

        paired = {"fm-schedule": fm_schedule_table, "fm-async": fm_async_table,  # a table each, not one per run
                  "fm-damped": fm_damped_table, "fm-nobn-val": fm_nobn_val_table, "fm-nobn": fm_nobn_table,
                  "lb-time": lb.lb_time_table, "lb-val": lb.lb_val_table, "lb": lb.lb_table}
        for name, table in paired.items():
            if name in stages:
                os.makedirs(OUT, exist_ok=True)
                with open(os.path.join(OUT, f"{name}.md"), "w") as f:
                    f.write(f"## {name}\n\n{table()}")
        rest = [s for s in stages if s not in paired and s != "lb-time-gpu"]  # lb-time-gpu: not run here
        if rest:
            write_tables(rest)
        return 0
    for s in a.stages:  # stage by stage: a test stage reads the validation runs finished before it
        tried: set = set()
        while True:  # until the stage lists no run not tried yet (a grid extended after its results, more seeds)
            todo = []
            for name, args in STAGES[s]():
                if args is None:
                    if name not in tried:
                        print(f"{name}: skipped, its validation stage has not finished")
                        tried.add(name)
                elif name not in tried:
                    todo.append((name, args))
            if not todo:
                break
            tried.update(name for name, _ in todo)
            with cf.ThreadPoolExecutor(max(1, a.jobs)) as ex:
                for msg in ex.map(lambda t: _run_one(*t), todo):
                    print(msg, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
