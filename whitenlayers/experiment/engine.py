"""The training engine: models, loaders, the train and test loops, one resumable :class:`Run` per (method, seed),
and :func:`run`.

Every method of a seed starts from the same weights and sees the same data
order; training draws nothing from the global random generators, so the
methods' runs can be interleaved epoch by epoch without changing any result,
and a resumed run equals an uninterrupted one (timings aside).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import random
import sys
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import models
from ..convert import whitening_layers
from ..diagnostics import collect_diagnostics
from . import checkpoint
from .config import METHOD_LABELS, METHOD_REGISTRY, RunConfig, fingerprint, method_kwargs, model_spec
from .context import Context
from .data import DataBundle, ImageLoader, TensorLoader, load_dataset
from .norms import (  # noqa: F401  (engine.remove_batchnorm etc.: where the study's pages and tests import them)
    ChannelAffine,
    ResidualGain,
    ScaledStandardization,
    group_norm_in_place_of_batchnorm,
    make_clip,
    normalizer_free,
    remove_batchnorm,
)
from .report import (
    format_epoch_line,
    format_steps_to_target,
    format_summary,
    format_time_to_accuracy,
    load_note,
    no_estimate_notes,
    plot_metrics,
    prepare_out,
    summarize,
    summary_text,
    time_to_accuracy,
    title,
    write_metrics,
    write_steps,
)

try:  # optional: in the 'experiment' extra; without it there is no progress bar
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

__all__ = ["build_model", "lr_at", "make_loaders", "diagnostic_batches", "precise_bn_batches", "precise_bn",
           "measure_diagnostics",
           "whitening_fingerprint", "Precision", "make_optimizer", "remove_batchnorm",
           "normalizer_free", "group_norm_in_place_of_batchnorm", "make_clip", "train_epoch", "evaluate", "Run", "run"]


# ==========================================================================
# Model, data, learning rate (the networks without BatchNorm: norms.py)
# ==========================================================================
def build_model(cfg: RunConfig, num_classes: int, in_channels: int) -> nn.Module:
    kind, depth = model_spec(cfg.model)
    if kind == "torchvision":
        return models.resnet50(num_classes=num_classes, in_channels=in_channels)
    model = models.cifar_resnet(depth=depth, num_classes=num_classes, in_channels=in_channels,
                                width=int(cast(int, cfg.width)))  # resolved in RunConfig.__post_init__
    if cfg.norm == "none":
        remove_batchnorm(model)
    elif cfg.norm == "gn":
        group_norm_in_place_of_batchnorm(model)
    elif cfg.norm == "nf":
        normalizer_free(model)
    return model


def make_optimizer(cfg: RunConfig, method: str, model: nn.Module) -> torch.optim.Optimizer:
    """The method's optimizer at its initial rate; every param group carries ``base_lr`` (scaled by the schedule)."""
    lr = cfg.method_lr_for(method)
    own = METHOD_REGISTRY[method].optimizer
    if own is not None:
        opt = own(model, lr, cfg)
    elif cfg.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=float(cfg.momentum), nesterov=bool(cfg.nesterov),
                              weight_decay=float(cfg.weight_decay))
    elif cfg.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=float(cfg.weight_decay))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=float(cfg.weight_decay))
    for g in opt.param_groups:
        g.setdefault("base_lr", g["lr"])
    return opt


def lr_at(cfg: RunConfig, epoch: int) -> float:
    """Learning rate for (0-based) ``epoch``: warm-up, then the schedule."""
    base = float(cfg.lr)
    warm = int(cfg.warmup_epochs)
    if epoch < warm:
        return base * (epoch + 1) / (warm + 1)
    if cfg.schedule == "step":
        return base * float(cfg.lr_gamma) ** sum(1 for m in cast(List[int], cfg.milestones) if epoch >= m)
    if cfg.schedule == "cosine":
        e = int(cfg.epochs)
        t = (epoch - warm) / max(1, e - warm)
        return base * 0.5 * (1.0 + math.cos(math.pi * t))
    return base


def linear_factor(epoch: int, step: int, steps: int, epochs: int, warmup_epochs: int = 0,
                  total_steps: Optional[int] = None) -> float:
    """``--schedule linear``: the factor on the base rate at ``step`` (0-based) of ``epoch`` (0-based, ``steps`` per
    epoch): after the warm-up epochs, ``1 - t`` with ``t`` the fraction of the decay's steps already taken, so the
    first step of the decay runs at the base rate and the rate would reach 0 one step after the last.
    ``total_steps`` (``--max-steps``): the run's last step is that one instead of the last of ``epochs``.
    """
    if epoch < warmup_epochs:
        return (epoch + 1) / (warmup_epochs + 1)
    end = epochs * steps if total_steps is None else total_steps
    total = max(1, end - warmup_epochs * steps)
    return max(0.0, 1.0 - ((epoch - warmup_epochs) * steps + step) / total)


def make_loaders(cfg: RunConfig, bundle: DataBundle, seed: int, ctx: Context):
    """This rank's training and test loaders (``--batch-size`` is the global batch)."""
    gbs = int(cfg.batch_size)
    if gbs % ctx.world:
        raise ValueError(f"--batch-size {gbs} (global) must be divisible by the number of processes {ctx.world}")
    bs = gbs // ctx.world
    if bundle.in_memory:
        aug = cfg.augment
        if aug == "auto":
            aug = bundle.default_augment
        if len(bundle.train) // ctx.world < bs:
            raise ValueError(f"--batch-size {gbs} is larger than the training set ({len(bundle.train)} images)")
        train = TensorLoader(bundle.train, bs, shuffle=True, drop_last=True, seed=seed, rank=ctx.rank, world=ctx.world,
                             augment=aug)
        test = TensorLoader(bundle.test, max(bs, 256), shuffle=False, drop_last=False, rank=ctx.rank, world=ctx.world)
        return train, test
    workers = cfg.workers if cfg.workers is not None else min(8, max(1, (os.cpu_count() or 2) // ctx.local_world))
    train = ImageLoader(bundle.train, bs, shuffle=True, drop_last=True, seed=seed, rank=ctx.rank, world=ctx.world,
                        workers=workers)
    test = ImageLoader(bundle.test, bs, shuffle=False, drop_last=False, seed=seed, rank=ctx.rank, world=ctx.world,
                       workers=workers)
    return train, test


def precise_bn_batches(cfg: RunConfig, bundle: DataBundle, seed: int, chunk: int = 256) -> List[torch.Tensor]:
    """``--precise-bn N``: N fixed training images (no augmentation) in batches of ``chunk``, the same on every
    rank and at every evaluation of a seed's run; none when off."""
    k = int(cfg.precise_bn)
    if k == 0:
        return []
    g = torch.Generator().manual_seed(20_011 + seed)
    source = bundle.train if bundle.in_memory else bundle.diag
    perm = torch.randperm(len(source), generator=g)[: min(len(source), k)]
    if bundle.in_memory:
        return [source.batch(perm[i:i + chunk])[0] for i in range(0, len(perm), chunk)]
    return [torch.stack([source[int(j)][0] for j in perm[i:i + chunk]]) for i in range(0, len(perm), chunk)]


@contextlib.contextmanager
def precise_bn(model: nn.Module, batches: Sequence[torch.Tensor], precision: "Precision"):
    """Inside the block every BatchNorm of ``model`` holds the statistics of ``batches`` at the current weights
    (the plain average over the batches: ``momentum=None``), every other module in eval mode (whitening layers
    gather nothing; a layer whose centring its BatchNorm absorbs follows the new statistics, as in training); on
    exit every buffer, the momenta and the modes are restored. A no-op without batches."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not batches or not bns:
        yield
        return
    saved = {k: v.clone() for k, v in model.named_buffers()}
    momenta = [(m, m.momentum) for m in bns]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        with torch.no_grad(), precision.autocast():
            for x in batches:
                model(precision.inputs(x))
        model.eval()
        yield
    finally:
        for m, momentum in momenta:
            m.momentum = momentum
        now = dict(model.named_buffers())
        with torch.no_grad():
            for k, v in saved.items():
                now[k].copy_(v)
        for m, mode in modes:
            m.training = mode


def diagnostic_batches(cfg: RunConfig, bundle: DataBundle, seed: int) -> List[torch.Tensor]:
    """Fixed, held-aside training batches (no augmentation) for kappa and rho: the same on every rank."""
    k = int(cfg.diag_batches)
    if k == 0:
        return []
    bs = int(cfg.batch_size)
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


# ==========================================================================
# Measurements
# ==========================================================================
def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def measure_diagnostics(model: nn.Module, batches: List[torch.Tensor], device) -> Dict[str, float]:
    nan = float("nan")
    if not batches:
        return dict(kappa_mean=nan, kappa_sem=nan, rho_mean=nan, rho_sem=nan)
    d = collect_diagnostics(model, batches, device=device)
    return dict(kappa_mean=_float(d.kappa_mean), kappa_sem=_float(d.kappa_sem), rho_mean=_float(d.rho_mean),
                rho_sem=_float(d.rho_sem))


def whitening_fingerprint(model: nn.Module) -> Dict[str, Any]:
    """sha256 of every whitening buffer (and of all parameters), to compare ranks."""
    h = hashlib.sha256()
    layers = whitening_layers(model)
    norm = 0.0
    for _, mod in layers:
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
    return {"whitening_layers": len(layers), "whitening_sha256": h.hexdigest(), "whitening_sq_norm": norm,
            "parameters_sha256": p.hexdigest()}


# ==========================================================================
# Train and test loops
# ==========================================================================
def _grad_scaler(device: torch.device):
    if hasattr(torch.amp, "GradScaler"):  # torch >= 2.3
        return torch.amp.GradScaler(device.type)
    if device.type == "cuda":  # pragma: no cover - old torch
        return torch.cuda.amp.GradScaler()
    raise RuntimeError("--amp fp16 off CUDA needs torch >= 2.3 (torch.amp.GradScaler)")  # pragma: no cover


class Precision:
    """``--amp`` and ``--channels-last`` for the loops: autocast, the fp16 gradient scaler, the batches' layout.

    With the defaults (``amp="none"``, no channels_last) a step is exactly the
    plain one: forward, cross-entropy, backward, ``opt.step()``.
    """

    def __init__(self, amp: str, channels_last: bool, device: torch.device) -> None:
        self.amp, self.device = amp, device
        self.dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
        self.channels_last = channels_last
        self.scaler = _grad_scaler(device) if amp == "fp16" else None

    def autocast(self) -> ContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def backward_step(self, loss: torch.Tensor, opt: torch.optim.Optimizer, pre=None,
                      clip: Optional[Callable[[], None]] = None) -> None:
        """Backward, the preconditioner's gradient rewrite (``pre.step()``, K-FAC/FOOF) if any, the gradient clipping
        (``clip()``, ``--agc``) if any, optimizer step."""
        if self.scaler is None:
            loss.backward()
            if pre is not None:
                pre.step()
            if clip is not None:
                clip()
            opt.step()
        else:  # skips the step when a gradient is not finite, and adapts the scale
            self.scaler.scale(loss).backward()
            if pre is not None or clip is not None:
                self.scaler.unscale_(opt)
            if pre is not None:
                pre.step()
            if clip is not None:
                clip()
            self.scaler.step(opt)
            self.scaler.update()


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, loader, ctx: Context, precision: Precision,
                bar=None, pre=None, step_factor: Optional[Callable[[int], float]] = None,
                method_lr: float = 0.0, clip: Optional[Callable[[], None]] = None,
                after_step: Optional[Callable[[int], bool]] = None) -> Tuple[float, float, int]:
    """One pass over ``loader``; returns this rank's summed loss, correct count and sample count.

    ``step_factor(i)``: a per-step schedule (``--schedule linear``), the factor on each param group's ``base_lr``
    (and on ``method_lr`` for a preconditioner) before step ``i``. ``after_step(i)``: called after step ``i``;
    a true result ends the pass there (a step budget, a target reached).
    """
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    correct = torch.zeros((), dtype=torch.long, device=ctx.device)
    seen = 0
    for i, (x, y) in enumerate(loader):
        if step_factor is not None:
            f = step_factor(i)
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * f
            if pre is not None:
                pre.lr = method_lr * f
        x = precision.inputs(x)
        y = y.to(ctx.device, non_blocking=True)
        with precision.autocast():
            out = model(x)
            loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        precision.backward_step(loss, opt, pre, clip)
        with torch.no_grad():
            loss_sum += loss.detach().double() * y.shape[0]
            correct += (out.argmax(1) == y).sum()
        seen += int(y.shape[0])
        if bar is not None and bar.update(1):  # True when tqdm redraws: read the loss (a device sync) only then
            bar.set_postfix_str(f"loss {float(loss_sum) / max(1, seen):.4f}")
        if after_step is not None and after_step(i):
            break
    return float(loss_sum), float(correct), seen


@torch.no_grad()
def evaluate(module: nn.Module, loader, ctx: Context, precision: Precision) -> Tuple[float, float]:
    """Test loss and accuracy (percent), summed over the ranks' shards."""
    was_training = module.training
    module.eval()
    loss_sum, correct, n = 0.0, 0.0, 0
    for x, y in loader:
        x = precision.inputs(x)
        y = y.to(ctx.device, non_blocking=True)
        with precision.autocast():
            out = module(x)
            loss = F.cross_entropy(out, y, reduction="sum")
        loss_sum += float(loss)
        correct += float((out.argmax(1) == y).sum())
        n += int(y.shape[0])
    module.train(was_training)
    loss_sum, correct, n = ctx.all_sum([loss_sum, correct, n])
    return loss_sum / max(1.0, n), 100.0 * correct / max(1.0, n)


def progress_enabled(cfg: RunConfig, ctx: Context) -> bool:
    """``--progress``: a bar on rank 0 only, when stderr is a terminal (auto) or always; needs tqdm."""
    if not ctx.is_main or cfg.progress == "never":
        return False
    show = cfg.progress == "always" or sys.stderr.isatty()
    if show and tqdm is None:
        if cfg.progress == "always":
            raise ImportError("--progress always needs tqdm: pip install 'whitenlayers[experiment]' (or tqdm)")
        ctx.log("note: no progress bar (pip install tqdm for one)")
        return False
    return show


def _load1() -> float:
    """The machine's 1-minute load average (nan where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return float("nan")


# ==========================================================================
# One (method, seed) run
# ==========================================================================
class Run:
    """One (method, seed) training run: model, optimizer, loaders; resumable epoch by epoch.

    The model is built right after ``torch.manual_seed(seed)``, so every
    method of a seed starts from the same weights; data order and
    augmentation depend on ``(seed, epoch)`` only. Training draws nothing from
    the global random generators, so runs can be interleaved epoch by epoch
    without changing any result.
    """

    def __init__(self, cfg: RunConfig, bundle: DataBundle, method: str, seed: int, ctx: Context,
                 show_progress: bool = False) -> None:
        self.cfg, self.method, self.seed, self.ctx = cfg, method, seed, ctx
        self.epochs = int(cfg.epochs)
        self.path = checkpoint.checkpoint_path(cast(str, cfg.out), method, seed)  # resolved in __post_init__
        self.fingerprint = fingerprint(cfg.to_record())
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        model = build_model(cfg, bundle.num_classes, bundle.in_channels).to(ctx.device)
        model = METHOD_REGISTRY[method].apply(model, method_kwargs(cfg, method))
        if ctx.distributed and cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it
        self.model = model
        self.precision = Precision(cfg.amp, cfg.channels_last, ctx.device)
        self.opt = make_optimizer(cfg, method, model)
        make_pre = METHOD_REGISTRY[method].preconditioner
        self.pre = make_pre(model, cfg.method_lr_for(method)) if make_pre is not None else None
        self.clip = make_clip(cfg, model)
        self.train_loader, self.test_loader = make_loaders(cfg, bundle, seed, ctx)
        if cfg.max_steps is not None:  # a step budget: the epochs it takes, the last one cut short
            self.epochs = -(-int(cfg.max_steps) // max(1, len(self.train_loader)))
        self.rows: List[Dict[str, Any]] = []
        self.epoch = 0  # epochs completed
        self.steps = 0  # optimizer steps taken
        #: "target" once --stop-acc ended the run, "budget" once --max-steps did ("" while it trains on).
        self.stopped = ""
        #: The evaluations of steps.csv (every --eval-every-steps steps and each epoch's end), with the
        #: step-based options only.
        self.step_rows: List[Dict[str, Any]] = []
        self.step_mode = bool(cfg.eval_every_steps) or cfg.stop_acc is not None or cfg.max_steps is not None
        if cfg.resume:
            self._resume()
        self.net = model  # what trains: DDP and/or compiled around the model
        if ctx.distributed:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.net = DistributedDataParallel(model, device_ids=device_ids)
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.diag = diagnostic_batches(cfg, bundle, seed)
        self.bn_batches = precise_bn_batches(cfg, bundle, seed)
        self.show = show_progress

    def _resume(self) -> None:
        state = checkpoint._load_checkpoint(self.path, self.ctx)
        if state is None:
            return
        if fingerprint(state["fingerprint"]) != self.fingerprint:
            raise RuntimeError(f"{self.path}: the checkpoint was made with a different configuration; "
                               "use another --out or drop --resume")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.precision.scaler is not None and "scaler" in state:
            self.precision.scaler.load_state_dict(state["scaler"])
        checkpoint.set_rng_state(state["rng"])
        self.epoch = int(state["epoch"])
        self.steps = int(state.get("steps", self.epoch * len(self.train_loader)))
        self.stopped = str(state.get("stopped", ""))
        self.step_rows = list(state.get("step_rows", []))
        self.rows = [r for r in state["rows"] if r["epoch"] <= self.epochs]
        what = "complete" if self.done else f"resuming after epoch {self.epoch}"
        self.ctx.log(f"{METHOD_LABELS[self.method]} seed {self.seed}: {what} (checkpoint {self.path})")

    def _save(self) -> None:
        state = {"epoch": self.epoch, "method": self.method, "seed": self.seed, "model": self.model.state_dict(),
                 "optimizer": self.opt.state_dict(), "rng": checkpoint.rng_state(), "rows": self.rows,
                 "fingerprint": self.fingerprint}
        if self.step_mode:
            state.update(steps=self.steps, stopped=self.stopped, step_rows=self.step_rows)
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler.state_dict()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        checkpoint._atomic_save(state, self.path)

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs or bool(self.stopped)

    def train_epoch(self) -> Dict[str, Any]:
        """Train the next epoch, evaluate, measure kappa/rho, checkpoint; returns the epoch's metrics row.

        With the step-based options the epoch may end early (``--max-steps`` spent, or ``--stop-acc`` reached at
        an evaluation every ``--eval-every-steps`` steps), and every evaluation is kept in :attr:`step_rows`."""
        ctx, cfg, epoch = self.ctx, self.cfg, self.epoch
        factor = lr_at(cfg, epoch) / float(cfg.lr)  # the schedule, applied to every method's own base rate
        base_lr = cfg.method_lr_for(self.method)
        lr = base_lr * factor
        for group in self.opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        if self.pre is not None:
            self.pre.lr = lr
        self.train_loader.set_epoch(epoch)
        steps = len(self.train_loader)
        bar = None
        if self.show:
            # tqdm is None only without tqdm installed, when progress_enabled() shows no bar
            bar = cast(Any, tqdm)(total=steps,
                                  desc=f"{self.method:>9s} s{self.seed} ep {epoch + 1}/{self.epochs}",
                                  file=sys.stderr, leave=False, mininterval=0.1, dynamic_ncols=True)
        ctx.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        step_factor: Optional[Callable[[int], float]] = None
        if cfg.schedule == "linear":
            step_factor = functools.partial(linear_factor, epoch, steps=steps, epochs=int(cfg.epochs),
                                            warmup_epochs=int(cfg.warmup_epochs), total_steps=cfg.max_steps)
            lr = base_lr * step_factor(0)
        before = (sum(r["epoch_time"] for r in self.rows), sum(r["cpu_time"] for r in self.rows))
        paused = [0.0, 0.0]  # wall and CPU seconds of this epoch's evaluations between steps
        last: List[Tuple[int, float, float]] = []  # (step, loss, accuracy) of the latest evaluation between steps
        every, stop, budget = int(cfg.eval_every_steps), cfg.stop_acc, cfg.max_steps
        first = self.steps  # the steps taken before this epoch

        def step_eval(i: int) -> float:
            """Evaluate after step ``i`` of the epoch, out of the training seconds; the accuracy."""
            ctx.synchronize()
            w, c = time.perf_counter(), time.process_time()
            loss, acc = self._evaluate()
            ctx.synchronize()
            self._step_row(epoch, base_lr * (step_factor(i) if step_factor is not None else factor), loss, acc,
                           before[0] + w - t0 - paused[0], before[1] + c - c0 - paused[1])
            paused[0] += time.perf_counter() - w
            paused[1] += time.process_time() - c
            last[:] = [(self.steps, loss, acc)]
            return acc

        def after_step(i: int) -> bool:
            self.steps += 1
            if budget is not None and self.steps >= int(budget):
                self.stopped = "budget"  # the final evaluation may still reach the target
                return True
            if every and self.steps % every == 0 and i + 1 < steps and step_eval(i) >= (stop or math.inf):
                self.stopped = "target"
                return True
            return False

        loss_sum, correct, seen = train_epoch(self.net, self.opt, self.train_loader, ctx, self.precision, bar,
                                              self.pre, step_factor, base_lr, self.clip, after_step)
        ctx.synchronize()
        epoch_time = time.perf_counter() - t0 - paused[0]
        cpu_time = time.process_time() - c0 - paused[1]
        if bar is not None:
            bar.close()
        loss_sum, correct, seen = ctx.all_sum([loss_sum, correct, seen])
        t1 = time.perf_counter()
        if last and last[0][0] == self.steps:  # stopped at an evaluation between steps: the same model
            test_loss, test_acc = last[0][1], last[0][2]
        else:
            test_loss, test_acc = self._evaluate()
            if self.step_mode:
                last_lr = lr if step_factor is None else base_lr * step_factor(max(0, self.steps - first - 1))
                self._step_row(epoch, last_lr, test_loss, test_acc, before[0] + epoch_time, before[1] + cpu_time)
            if stop is not None and test_acc >= stop:
                self.stopped = "target"
        diag_vals = measure_diagnostics(self.model, self.diag, ctx.device)
        ctx.synchronize()
        eval_time = time.perf_counter() - t1 + paused[0]
        row = dict(method=self.method, seed=self.seed, epoch=epoch + 1, lr=lr, train_loss=loss_sum / max(1.0, seen),
                   train_acc=100.0 * correct / max(1.0, seen), test_loss=test_loss, test_acc=test_acc,
                   **diag_vals, epoch_time=epoch_time, eval_time=eval_time,
                   train_time=before[0] + epoch_time, cpu_time=cpu_time,
                   load1=_load1(), wall_clock=time.time())
        self.rows.append(row)
        self.epoch = epoch + 1
        ctx.log(format_epoch_line(row, self.epochs))
        if self.stopped:
            examples = self.steps * int(cfg.batch_size)
            ctx.log(f"{METHOD_LABELS[self.method]} seed {self.seed}: " + (
                f"reached {test_acc:.2f}% >= {stop:g}% at step {self.steps} ({examples} examples)"
                if self.stopped == "target" else f"step budget of {self.steps} steps ({examples} examples) spent"
                + (f" without reaching {stop:g}%" if stop is not None else "")))
        if not math.isfinite(row["train_loss"]):
            ctx.log(f"warning: {self.method} seed {self.seed}: the training loss is not finite (diverged); "
                    "consider a lower --lr")
        if ctx.is_main:
            self._save()
        return row

    def _evaluate(self) -> Tuple[float, float]:
        """Test (or validation) loss and accuracy of the model now, under ``--precise-bn``'s statistics if set."""
        with precise_bn(self.model, self.bn_batches, self.precision):
            return evaluate(self.model, self.test_loader, self.ctx, self.precision)

    def _step_row(self, epoch: int, lr: float, loss: float, acc: float, train_time: float, cpu_time: float) -> None:
        """One evaluation of steps.csv, after :attr:`steps` steps (``train_time``, ``cpu_time``: the training's
        seconds so far, evaluations excluded)."""
        self.step_rows.append(dict(method=self.method, seed=self.seed, step=self.steps,
                                   examples=self.steps * int(self.cfg.batch_size), epoch=epoch + 1, lr=lr,
                                   test_loss=loss, test_acc=acc, train_time=train_time, cpu_time=cpu_time,
                                   wall_clock=time.time()))

    def finish(self) -> None:
        """Distributed: write this rank's whitening fingerprint (ranks must agree)."""
        if self.ctx.distributed:
            rank_dir = os.path.join(cast(str, self.cfg.out), "ranks")
            os.makedirs(rank_dir, exist_ok=True)
            info = dict(method=self.method, seed=self.seed, rank=self.ctx.rank, world=self.ctx.world,
                        epochs=self.epoch, **whitening_fingerprint(self.model))
            with open(os.path.join(rank_dir, f"{self.method}-seed{self.seed}-rank{self.ctx.rank}.json"), "w") as f:
                json.dump(info, f, indent=1)


# ==========================================================================
# The whole run
# ==========================================================================
def run(cfg: RunConfig, ctx: Context, argv: Sequence[str] = ()) -> Dict[str, Any]:
    """Run every (seed, method) of ``cfg`` and write the outputs; returns rows, summary and paths."""
    t_start = time.perf_counter()
    prepare_out(cfg, ctx, argv)
    show = progress_enabled(cfg, ctx)
    if cfg.download and ctx.distributed and not ctx.is_main:
        ctx.barrier()  # let rank 0 download first
    bundle = load_dataset(cfg.dataset, data_dir=cfg.data_dir, download=bool(cfg.download) and ctx.is_main,
                          test_fraction=float(cfg.test_fraction))
    if cfg.download and ctx.distributed and ctx.is_main:
        ctx.barrier()
    bundle = bundle.downsampled(int(cast(int, cfg.downsample))).limit(cfg.train_subset, cfg.test_subset)
    if float(cfg.val_fraction) > 0:
        bundle = bundle.validation(float(cfg.val_fraction))
    kind, depth = model_spec(cfg.model)
    model_name = "ResNet-50" if kind == "torchvision" else f"CIFAR ResNet-{depth} width {cfg.width}"
    switches = [s for s, on in ((f"amp {cfg.amp}", cfg.amp != "none"), ("torch.compile", cfg.compile),
                                ("channels_last", cfg.channels_last)) if on]
    ctx.log(f"whitenlayers experiment: {bundle.label} ({len(bundle.train)} train / {len(bundle.test)} test), "
            f"{model_name}, "
            f"methods {','.join(cfg.methods)}, seeds {','.join(map(str, cast(List[int], cfg.seeds)))}, "
            + (f"{cfg.max_steps} steps, " if cfg.max_steps is not None else f"{cfg.epochs} epochs, ")
            + f"batch {cfg.batch_size} on {ctx.world} process(es), device {ctx.device}, {ctx.threads} thread(s)/process"
            + "".join(f", {s}" for s in switches))
    if getattr(ctx, "note", ""):
        ctx.log(f"  {ctx.note}")
    for note in bundle.notes:
        ctx.log(f"  {note}")
    ctx.log(f"  output: {cfg.out}")
    metrics_path = os.path.join(cast(str, cfg.out), "metrics.csv")  # RunConfig.__post_init__ resolved out, seeds
    steps_path = os.path.join(cast(str, cfg.out), "steps.csv")
    by_steps = bool(cfg.eval_every_steps) or cfg.stop_acc is not None or cfg.max_steps is not None
    done: List[Dict[str, Any]] = []
    done_steps: List[Dict[str, Any]] = []

    def flush(current: List[Dict[str, Any]], current_steps: Sequence[Dict[str, Any]] = ()) -> None:
        if ctx.is_main:
            write_metrics(done + current, metrics_path)
            if by_steps:
                write_steps(done_steps + list(current_steps), steps_path)

    for seed in cast(List[int], cfg.seeds):
        if cfg.order == "interleaved":
            # Epoch e of every method, then epoch e + 1: the methods share the machine's load alike.
            runs = [Run(cfg, bundle, method, seed, ctx, show) for method in cfg.methods]
            while not all(r.done for r in runs):
                for r in runs:
                    if not r.done:
                        r.train_epoch()
                        flush([row for q in runs for row in q.rows], [row for q in runs for row in q.step_rows])
            for r in runs:
                r.finish()
                done.extend(r.rows)
                done_steps.extend(r.step_rows)
            del runs
        else:
            for method in cfg.methods:
                r = Run(cfg, bundle, method, seed, ctx, show)
                while not r.done:
                    r.train_epoch()
                    flush(r.rows, r.step_rows)
                r.finish()
                done.extend(r.rows)
                done_steps.extend(r.step_rows)
                del r
        flush([])
    result: Dict[str, Any] = {"rows": done, "metrics": metrics_path}
    if ctx.is_main:
        summary, target = summarize(done, cfg.methods, cfg.target_acc)
        table = format_summary(summary, target)
        tta = time_to_accuracy(done, cfg.methods, cfg.time_levels)
        table += "\n\n" + format_time_to_accuracy(tta, cfg.time_levels)
        notes = no_estimate_notes(summary, target, tta, cfg.time_levels)
        if notes:
            table += "\n\n" + notes
        table += "\n\n" + load_note(done, ctx.threads)
        if cfg.stop_acc is not None:
            table += "\n\n" + format_steps_to_target(done_steps, float(cfg.stop_acc))
        wall = time.perf_counter() - t_start
        fig_path: Optional[str] = os.path.join(cast(str, cfg.out), "figure.png")
        name = title(cfg, bundle.label)
        try:
            plot_metrics(done, cast(str, fig_path), name, cfg.methods)
        except ImportError as exc:
            fig_path = None
            print(f"warning: no figure ({exc})", file=sys.stderr)
        with open(os.path.join(cast(str, cfg.out), "summary.md"), "w") as f:
            f.write(summary_text(name, table, target, wall, target_given=cfg.target_acc is not None))
        print("\n" + table, flush=True)
        print(f"\ntotal wall time {wall:.1f} s; outputs in {cfg.out}: metrics.csv, "
              + ("steps.csv, " if by_steps else "") + "config.json, summary.md"
              + (", figure.png" if fig_path else "") + ", checkpoints/", flush=True)
        result.update(summary=summary, target=target, table=table, figure=fig_path, wall=wall)
    return result
