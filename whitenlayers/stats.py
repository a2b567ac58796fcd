"""Running statistics and the block fold, shared by every whitening layer.

:class:`WhiteningStatistics` is a mixin: it registers the contract buffers
(``running_mean``, ``running_cov``, ``whitening_matrix``, ``grad_transform``,
``num_blocks``), accumulates each training batch's moments, and folds a block
every ``block_size`` training forwards (SPEC "Semantics"). The transform rule
(EVD or recursive) is chosen per layer.

Per-batch accumulators are *not* buffers: DistributedDataParallel re-broadcasts
every buffer from rank 0 before each forward, which would overwrite each rank's
partial sums. They travel in checkpoints through ``get_extra_state``.

Distributed: :func:`fold_layers` sums the block statistics of any number of
layers across ranks in two coalesced ``all_reduce`` calls (first counts and
means, then the scatter about the global mean, which keeps the sum accurate
when ``|mean| >> std``), so all ranks fold identical numbers.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import functional as F_w
from .functional import BlockSummary

__all__ = ["WhiteningStatistics", "FoldCoordinator", "fold_layers", "validate_hyperparameters"]

_RULES = ("evd", "recursive")
_COMPUTE = object()  # sentinel: "compute the EVD transform here" (see _fold_all)


def validate_hyperparameters(**kw: Any) -> None:
    """Raise ``ValueError`` naming the first argument outside its valid range (SPEC "Quality bars")."""
    checks = {
        "block_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
        "alpha": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
        "beta": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
        "gamma": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
        "delta": (lambda v: v > 0.0, "> 0"),
        "eps": (lambda v: v > 0.0, "> 0"),
        "gmax": (lambda v: v >= 1.0, ">= 1"),
        "c_rel": (lambda v: v >= 0.0, ">= 0"),
        "c_abs": (lambda v: v >= 0.0, ">= 0"),
        "stats_fraction": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    }
    for name, value in kw.items():
        ok, what = checks[name]
        try:
            valid = ok(value) and (name == "block_size" or math.isfinite(value))
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"{name} must be {what}, but got {name}={value!r}")


def _no_autocast(device: torch.device):
    """Statistics and transforms are computed in their own dtype, never in autocast's lower precision."""
    return torch.autocast(device_type=device.type, enabled=False)


def _dist_group(layers: Sequence["WhiteningStatistics"]):
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = layers[0].process_group
    if not all(layer.process_group is group for layer in layers):
        raise ValueError("fold_layers: all layers folded together must share one process_group")
    if dist.get_world_size(group) == 1:
        return None, 1
    return group, dist.get_world_size(group)


def _all_reduce_summaries(summaries: List[BlockSummary], group) -> List[BlockSummary]:
    """Global block statistics across ranks: two coalesced all_reduce calls for all layers."""
    # Phase 1: counts and count-weighted means -> global count and mean.
    flat = torch.cat([torch.cat([s.count.view(1), s.count * s.mean]) for s in summaries])
    dist.all_reduce(flat, group=group)
    out_mean, pos = [], 0
    for s in summaries:
        m = s.mean.numel()
        n = flat[pos]
        out_mean.append((n, flat[pos + 1 : pos + 1 + m] / torch.clamp(n, min=1.0)))
        pos += 1 + m
    # Phase 2: each rank's scatter about the global mean, and the powers.
    parts = []
    for s, (n, mean) in zip(summaries, out_mean):
        d = s.mean - mean
        local = s.scatter + s.count * torch.outer(d, d)
        parts.append(torch.cat([local.reshape(-1), s.power]))
    flat2 = torch.cat(parts)
    dist.all_reduce(flat2, group=group)
    result, pos = [], 0
    for s, (n, mean) in zip(summaries, out_mean):
        m = s.mean.numel()
        scatter = flat2[pos : pos + m * m].view(m, m)
        power = flat2[pos + m * m : pos + m * m + m]
        pos += m * m + m
        result.append(BlockSummary(n, mean, F_w.symmetrize(scatter), power))
    return result


@torch.compiler.disable  # the fold (once per block, host logic, EVD) stays out of compiled graphs
def fold_layers(layers: Iterable["WhiteningStatistics"]) -> None:
    """Fold the current block of each layer, statistics summed across ranks when distributed.

    All ranks must call this with the same layers in the same order (they do
    when they run the same number of training forwards, as DDP requires).
    """
    layers = list(layers)
    if not layers:
        return
    with _no_autocast(layers[0].running_mean.device):
        summaries = [layer._block_summary() for layer in layers]
        group, world = _dist_group(layers)
        if world > 1:
            summaries = _all_reduce_summaries(summaries, group)
        _fold_all(layers, summaries)


@torch.no_grad()
def _fold_all(layers: Sequence["WhiteningStatistics"], summaries: Sequence[BlockSummary]) -> None:
    """Fold each layer; the EVD layers' eigendecompositions batched by width.

    Layers whose transform is computed alike (same ``M``, working dtype,
    device, ``eps``, ``gmax``, ``gains``) share one batched ``eigh`` call
    (:func:`functional.evd_transform_batched`, same results as one call per
    layer, with the same per-layer fallbacks and failure counts). The rest of
    each fold (moments, bias compensation, recursive layers) runs per layer.
    """
    groups: Dict[tuple, list] = {}
    for layer, summary in zip(layers, summaries):
        if layer.method != "evd" or len(layers) == 1:
            layer._fold(summary)
            continue
        start = layer._fold_start(summary)
        if start is None:
            continue
        work = layer._evd_work_dtype()
        key = (layer.num_features, work, start[1].device, layer.eps, layer.gmax, layer.gains)
        groups.setdefault(key, []).append((layer, summary, start))
    for (_, work, _, eps, gmax, gains), items in groups.items():
        if len(items) == 1:
            layer, summary, start = items[0]
            layer._fold_finish(summary, *start)
            continue
        covs = torch.stack([start[1].to(work) for _, _, start in items])
        results = F_w.evd_transform_batched(covs, eps=eps, gmax=gmax, gains=gains)
        for (layer, summary, start), res in zip(items, results):
            layer._fold_finish(summary, *start, evd=res)


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward.

    Installed as a forward hook on the root module by
    :func:`whitenlayers.convert_model`: layers whose block ends during a
    forward ask to be folded, and the hook folds them in one
    :func:`fold_layers` call (one pair of collectives per block for the whole
    model instead of one per layer). Folding after the model's forward instead
    of right after each layer's forward changes nothing: a block's statistics
    and the transform in force for that batch's backward are the same.
    """

    def __init__(self) -> None:
        self.pending: List["WhiteningStatistics"] = []
        self.handle = None

    def request(self, layer: "WhiteningStatistics") -> None:
        if not any(p is layer for p in self.pending):
            self.pending.append(layer)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        fold_layers([p for p in pending if p._fold_pending])

    def __call__(self, module, inputs, output) -> None:
        if self.pending:
            self.flush()

    def __getstate__(self) -> Dict[str, Any]:
        return {"pending": list(self.pending), "handle": None}


class WhiteningStatistics:
    """Mixin: block statistics, fold and transform of one whitening layer.

    Subclasses call :meth:`_init_whitening` after their ``nn.Module`` base
    ``__init__``, call :meth:`_accumulate` with the layer input in training
    mode and :meth:`_end_batch` after computing the output, and may override
    :meth:`_on_mean_change` (bias compensation).
    """

    _version = 1
    # set by the layers
    num_features: int
    method: str

    def _init_whitening(
        self,
        num_features: int,
        *,
        method: str,
        grad_transform: bool,
        block_size: int,
        alpha: float,
        eps: float,
        beta: float = 0.0,
        gmax: float = 10.0,
        gains: str = "practical",
        gamma: float = 0.99,
        delta: float = 0.25,
        c_rel: float = 0.025,
        c_abs: float = 1e-6,
        stats_fraction: float = 1.0,
        device=None,
        dtype=None,
    ) -> None:
        if method not in _RULES:
            raise ValueError(f"method must be one of {_RULES}, but got method={method!r}")
        if gains not in ("practical", "zca"):
            raise ValueError(f"gains must be 'practical' or 'zca', but got gains={gains!r}")
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, but got num_features={num_features!r}")
        hp = dict(block_size=block_size, alpha=alpha, beta=beta, eps=eps, stats_fraction=stats_fraction)
        if method == "evd":
            hp["gmax"] = gmax
        else:
            hp.update(gamma=gamma, delta=delta, c_rel=c_rel, c_abs=c_abs)
        validate_hyperparameters(**hp)
        self.num_features = num_features
        self.method = method
        self.block_size = block_size
        self.alpha, self.beta, self.eps, self.gmax, self.gains = alpha, beta, eps, gmax, gains
        self.gamma, self.delta, self.c_rel, self.c_abs = gamma, delta, c_rel, c_abs
        self.stats_fraction = stats_fraction
        self.process_group = None
        self.layer_name: Optional[str] = None
        stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        fk = {"device": device, "dtype": stats_dtype}
        m = num_features
        self.register_buffer("running_mean", torch.zeros(m, **fk))
        self.register_buffer("running_cov", torch.zeros(m, m, **fk))
        self.register_buffer("whitening_matrix", torch.eye(m, **fk))
        if grad_transform:
            self.register_buffer("grad_transform", torch.eye(m, **fk))
        self.register_buffer("num_blocks", torch.tensor(0, dtype=torch.long, device=device))
        if method == "recursive":
            self.register_buffer("running_cov_whitened", torch.zeros(m, m, **fk))  # Phi_y
            self.register_buffer("running_power", torch.zeros(m, **fk))  # phi_x,m (uncentred)
            self.register_buffer("whitening_gram", torch.eye(m, **fk))  # unsmoothed Q = T^T T
        # Counters, readable attributes (also saved in extra state).
        self.eig_failures = 0
        self.skipped_folds = 0
        self.nonfinite_batches = 0
        self.clamped_steps = 0
        self._warned: set = set()
        self._fold_coordinator: Optional[FoldCoordinator] = None
        self._reset_accumulators()

    # ------------------------------------------------------------------ naming
    def _describe(self) -> str:
        name = f" '{self.layer_name}'" if self.layer_name else ""
        return f"{type(self).__name__}{name} (num_features={self.num_features})"

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{self._describe()}: {message}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ accumulators
    def _reset_accumulators(self) -> None:
        dev = self.running_mean.device
        m = self.num_features
        self._acc_batches = 0
        self._acc_count = torch.zeros((), dtype=torch.float64, device=dev)
        self._acc_shift: Optional[Tensor] = None
        self._acc_s1 = torch.zeros(m, dtype=torch.float64, device=dev)
        self._acc_s2 = torch.zeros(m, m, dtype=torch.float64, device=dev)
        self._acc_nonfinite = torch.zeros((), dtype=torch.long, device=dev)
        self._fold_pending = False

    def _accumulate(self, x: Tensor) -> None:
        """Add one batch (``x`` with features on dim 1) to the block's shifted sums.

        No host synchronisation: a batch with non-finite values is masked out
        on the device and counted; it is reported at the fold.
        """
        if self._fold_pending:  # a requested fold whose coordinator never ran
            fold_layers([self])
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        if self.stats_fraction < 1.0 and x.shape[0] > 1:
            x = x[: max(1, math.ceil(self.stats_fraction * x.shape[0]))]
        if self._acc_s1.device != x.device:
            self._reset_accumulators_to(x.device)
        with _no_autocast(x.device):  # under autocast, products would run (and overflow) in fp16/bf16
            if self._acc_shift is None:
                # The mean in force; for the very first block, this batch's mean (0 where it is not finite,
                # so that one bad batch cannot poison the block's other batches). Chosen on the device:
                # no host synchronisation, no graph break under torch.compile.
                if x.numel() > 0:
                    dims = [0] + list(range(2, x.dim()))
                    first = torch.nan_to_num(x.mean(dims).to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
                else:
                    first = torch.zeros_like(self._acc_s1)
                in_force = self.running_mean.detach().to(device=x.device, dtype=torch.float64)
                self._acc_shift = torch.where(self.num_blocks.to(x.device) > 0, in_force, first)
            n = x.numel() // self.num_features
            s1, s2 = F_w.batch_moments(x, self._acc_shift)
            finite = torch.isfinite(s2).all() & torch.isfinite(s1).all()
            zero = torch.zeros((), dtype=torch.float64, device=x.device)
            self._acc_s1 += torch.where(finite, s1.to(torch.float64), zero)
            self._acc_s2 += torch.where(finite, s2.to(torch.float64), zero)
            self._acc_count += torch.where(finite, torch.full_like(zero, float(n)), zero)
            self._acc_nonfinite += (~finite).long()

    def _reset_accumulators_to(self, device) -> None:
        for name in ("_acc_count", "_acc_s1", "_acc_s2", "_acc_nonfinite"):
            setattr(self, name, getattr(self, name).to(device))
        if self._acc_shift is not None:
            self._acc_shift = self._acc_shift.to(device)

    def _end_batch(self) -> None:
        """Count one training forward; fold (or ask the coordinator to) at the block's end."""
        self._acc_batches += 1
        if self._acc_batches >= self.block_size:
            self._fold_pending = True
            if self._fold_coordinator is not None:
                self._fold_coordinator.request(self)
            else:
                fold_layers([self])

    def _block_summary(self) -> BlockSummary:
        shift = self._acc_shift if self._acc_shift is not None else torch.zeros_like(self._acc_s1)
        return F_w.summarize_block(self._acc_count, shift, self._acc_s1, self._acc_s2)

    # -------------------------------------------------------------------- fold
    @torch.no_grad()
    def _fold(self, block: BlockSummary) -> None:
        """Fold one block (already summed over ranks): moments, then transform, then bias compensation."""
        start = self._fold_start(block)
        if start is not None:
            self._fold_finish(block, *start)

    def _fold_start(self, block: BlockSummary) -> Optional[Tuple[Tensor, Tensor, bool, Tensor]]:
        """First part of a fold: counters, accumulator reset, moments ``(mu, cov, first, block_cov)``; ``None`` if
        skipped. ``block_cov`` is the block's covariance about the new ``mu`` (eq. ``vPhixi``'s new term)."""
        bad = int(self._acc_nonfinite)
        if bad:
            self.nonfinite_batches += bad
            self._warn_once("nonfinite", f"{bad} batch(es) with non-finite activations (or second moments that overflow "
                                          "the input's precision) were left out of the statistics")
        self._reset_accumulators()
        first = int(self.num_blocks) == 0
        finite = F_w.all_finite(*block)
        if float(block.count) <= 0 or not finite:
            self.skipped_folds += 1
            self._warn_once("skip", "a block had no finite samples; the fold was skipped and the transform kept")
            return
        mu, cov, block_cov = F_w.fold_moments(self.running_mean, self.running_cov, block, self.alpha, first,
                                              return_block_cov=True)
        if not F_w.all_finite(mu, cov):
            self.skipped_folds += 1
            self._warn_once("skip", "non-finite moments; the fold was skipped and the transform kept")
            return None
        return mu, cov, first, block_cov

    def _fold_finish(self, block: BlockSummary, mu: Tensor, cov: Tensor, first: bool, block_cov: Tensor,
                     evd: Any = _COMPUTE) -> None:
        """Second part of a fold: transform (``evd``: an :func:`evd_transform` result computed by the caller), buffers."""
        if self.method == "evd":
            self._update_evd(cov, evd)
        else:
            self._update_recursive(block, block_cov, first)
        self._on_mean_change(self.running_mean.to(torch.float64), mu)
        self._replace_buffer("running_mean", mu)
        self._replace_buffer("running_cov", cov)
        self.num_blocks += 1

    def _replace_buffer(self, name: str, value: Tensor) -> None:
        """Set a buffer to a new tensor instead of writing into the old one.

        A backward still to come may hold the old tensor: ``torch.compile``
        saves the buffer itself for the backward rather than the forward's
        clone of it, and an in-place update would make that backward fail (or
        use the new transform). DDP re-reads reassigned buffers before each sync.
        """
        old = getattr(self, name)
        new = value.detach().to(device=old.device, dtype=old.dtype)
        setattr(self, name, new.clone() if new.data_ptr() == value.data_ptr() else new)  # never alias the input

    def _smooth_grad_transform(self, q: Tensor) -> None:
        if hasattr(self, "grad_transform"):
            # Symmetric to the last bit, like Q_s(i-1) and Q: entries (i, j) and (j, i) are computed alike.
            qs = (self.grad_transform.to(q.dtype) * self.beta).add_(q, alpha=1.0 - self.beta)
            self._replace_buffer("grad_transform", qs)

    def _evd_work_dtype(self) -> torch.dtype:
        return self.whitening_matrix.dtype if self.whitening_matrix.dtype == torch.float64 else torch.float32

    def _update_evd(self, cov: Tensor, res: Any = _COMPUTE) -> None:
        if res is _COMPUTE:
            res = F_w.evd_transform(cov.to(self._evd_work_dtype()), eps=self.eps, gmax=self.gmax, gains=self.gains)
        if res is None:
            self.eig_failures += 1
            self._warn_once("eigh", "eigendecomposition failed (also in float64); the previous transform is kept")
            return
        t, q = res
        self._replace_buffer("whitening_matrix", t)
        self._smooth_grad_transform(q.to(torch.float64))

    def _update_recursive(self, block: BlockSummary, block_cov: Tensor, first: bool) -> None:
        # Work in float32 (float64 for float64 layers), like the EVD rule: the step's recursion is contractive
        # (gamma < 1), so its round-off stays at the working precision instead of accumulating.
        wd = self._evd_work_dtype()
        t_prev = self.whitening_matrix.to(wd)
        # Phi_y: eq. vPhixi on the whitened features y = T(i-1) x of this block, as T(i-1) C_block T(i-1)^T:
        # two M x M x M products per fold (the fold's largest cost; nothing is added to the per-batch path).
        block_cov_y = t_prev @ block_cov.to(wd) @ t_prev.t()
        if first:
            phi_y = block_cov_y
        else:
            phi_y = block_cov_y.mul_(1.0 - self.alpha).add_(self.running_cov_whitened.to(wd), alpha=self.alpha)
        phi_y = F_w.symmetrize(phi_y)
        n = torch.clamp(block.count, min=1.0)
        power = F_w.recursive_average(self.running_power, block.power / n, self.alpha, first)
        step = F_w.recursive_step(
            t_prev,
            self.whitening_gram.to(wd),
            phi_y,
            power.mean().to(wd),
            gamma=self.gamma,
            delta=self.delta,
            eps=self.eps,
            c_rel=self.c_rel,
            c_abs=self.c_abs,
        )
        if not F_w.all_finite(step.transform, step.gram):
            self.eig_failures += 1
            self._warn_once("recursive", "non-finite recursive step; the previous transform is kept")
            return
        self.clamped_steps += int(step.clamped)
        self._replace_buffer("running_cov_whitened", phi_y)
        self._replace_buffer("running_power", power)
        self._replace_buffer("whitening_matrix", step.transform)
        self._replace_buffer("whitening_gram", step.gram)
        self._smooth_grad_transform(step.gram)

    def _on_mean_change(self, old: Tensor, new: Tensor) -> None:
        """Hook for layers that must keep their function when the mean in force changes."""

    # ------------------------------------------------------------- public API
    def fold(self) -> None:
        """Fold the current (possibly partial) block now, as if the block had ended."""
        fold_layers([self])

    def reset_running_stats(self) -> None:
        """Back to the initial state (``mu = 0``, ``T = Q_s = I``, no blocks); the layer's function is kept."""
        with torch.no_grad():
            self._on_mean_change(self.running_mean.to(torch.float64), torch.zeros_like(self.running_mean, dtype=torch.float64))
            self.running_mean.zero_()
            self.running_cov.zero_()
            self.whitening_matrix.copy_(torch.eye(self.num_features))
            if hasattr(self, "grad_transform"):
                self.grad_transform.copy_(torch.eye(self.num_features))
            if self.method == "recursive":
                self.running_cov_whitened.zero_()
                self.running_power.zero_()
                self.whitening_gram.copy_(torch.eye(self.num_features))
            self.num_blocks.zero_()
        self.eig_failures = self.skipped_folds = self.nonfinite_batches = self.clamped_steps = 0
        self._reset_accumulators()

    def whitened_covariance(self) -> Tensor:
        """``T Phi_x T^T``: the covariance of the features the layer's weights effectively see."""
        t = self.whitening_matrix.to(torch.float64)
        return F_w.symmetrize(t @ self.running_cov.to(torch.float64) @ t.t())

    def _whitening_repr(self) -> str:
        defaults = self._whitening_defaults()
        parts = []
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                parts.append(f"{name}={value}")
        return ", ".join(parts)

    def _whitening_defaults(self) -> Dict[str, Any]:
        return {}

    # ---------------------------------------------------------- checkpointing
    def get_extra_state(self) -> Dict[str, Any]:
        """The partial block and the counters, so that a mid-block checkpoint resumes bit-for-bit."""
        return {
            "version": self._version,
            "acc_batches": self._acc_batches,
            "acc_count": self._acc_count.clone(),
            "acc_shift": None if self._acc_shift is None else self._acc_shift.clone(),
            "acc_s1": self._acc_s1.clone(),
            "acc_s2": self._acc_s2.clone(),
            "acc_nonfinite": self._acc_nonfinite.clone(),
            "eig_failures": self.eig_failures,
            "skipped_folds": self.skipped_folds,
            "nonfinite_batches": self.nonfinite_batches,
            "clamped_steps": self.clamped_steps,
        }

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        dev = self.running_mean.device
        m = self.num_features
        if tuple(state["acc_s2"].shape) != (m, m):
            raise RuntimeError(
                f"{self._describe()}: checkpoint block statistics are for {state['acc_s2'].shape[0]} "
                f"features, but this layer has {m}"
            )
        self._acc_batches = int(state["acc_batches"])
        self._acc_count = state["acc_count"].to(dev, torch.float64).clone()
        shift = state["acc_shift"]
        self._acc_shift = None if shift is None else shift.to(dev, torch.float64).clone()
        self._acc_s1 = state["acc_s1"].to(dev, torch.float64).clone()
        self._acc_s2 = state["acc_s2"].to(dev, torch.float64).clone()
        self._acc_nonfinite = state["acc_nonfinite"].to(dev).clone()
        self.eig_failures = int(state.get("eig_failures", 0))
        self.skipped_folds = int(state.get("skipped_folds", 0))
        self.nonfinite_batches = int(state.get("nonfinite_batches", 0))
        self.clamped_steps = int(state.get("clamped_steps", 0))
        self._fold_pending = False

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        version = local_metadata.get("version", None)
        key = prefix + "_extra_state"
        if (version is None or version < 1) and key not in state_dict:
            # Checkpoints without the partial block: start a fresh block.
            self._reset_accumulators()
            state_dict = dict(state_dict)
            state_dict[key] = self.get_extra_state()
        m = self.num_features
        mkey = prefix + "running_mean"
        if mkey in state_dict and state_dict[mkey].shape != (m,):
            error_msgs.append(
                f"{self._describe()}: checkpoint has {state_dict[mkey].shape[0]} features in "
                f"'{mkey}', but this layer has {m}"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
