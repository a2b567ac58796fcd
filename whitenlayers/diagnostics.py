"""Whitening diagnostics: normalised rank ``kappa`` and whiteness ``rho`` per layer.

Both are measured on the covariance of the features a layer's weights
actually see (ERRATA items 1 and 2 of ``docs/PAPER.md``):

* a plain conv sees its input ``x``: ``Phi_x``;
* a grad / recursive whitening conv computes ``conv(x - mu, W)`` and
  transforms its weight gradient by ``Q_s = T^T T``, which is SGD on
  ``W T^{-1}`` seeing ``T (x - mu)`` (paper section 3.1): ``T Phi_x T^T``;
* the layer behind a ``direct`` :class:`~whitenlayers.DirectWhiten` sees the
  whitened features themselves, so its input is measured as is.

:func:`collect_diagnostics` runs data through the model with hooks and works
for a plain model as well as a converted one, on the same convolutions, so a
baseline can be plotted beside whitened runs. :func:`layer_diagnostics`
reads the whitening layers' own running statistics and needs no data.

Layers are keyed by the qualified name of the *original* conv
(``layer1.0.conv1``, also for a ``direct`` wrapper), so plain and converted
results line up key for key.

Grouped convolutions (``groups = G > 1``): what the weights of a grouped conv
see is the block-diagonal part of the covariance (channels of different
groups never meet in one output), so ``kappa`` and ``rho`` are those of the
block-diagonal matrix: ``kappa = M_s / M`` of the union of the ``G`` blocks'
spectra, ``rho`` with only the within-group correlations
(:func:`~whitenlayers.functional.grouped_normalized_rank`,
:func:`~whitenlayers.functional.grouped_whiteness`). For a depthwise conv
``rho = 1`` always and ``kappa`` measures how evenly the channel variances
are spread. Only the diagonal blocks are accumulated, for plain grouped
convs too.
"""
from __future__ import annotations

import itertools
import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import Tensor, nn

from . import functional as F_w
from ._rebuild import modes_kept
from .convert import BlockTypes, DirectWhitenWrapper, Predicate, TargetSpec
from .layers import GRAD_LAYER_TYPES, WhiteningLayer

__all__ = ["Diagnostics", "collect_diagnostics", "layer_diagnostics", "summarize"]


@dataclass
class Diagnostics:
    """Per-layer ``kappa`` and ``rho`` and their mean and standard error across layers.

    ``kappa`` and ``rho`` map a layer's qualified name to its value; ``kind``
    says what was measured there (``"plain"``: ``Phi_x``; ``"grad"``:
    ``T Phi_x T^T`` of a grad/recursive layer; ``"direct"``: the input of the
    layer behind a ``DirectWhiten``). A layer without statistics (no samples,
    no folded block, non-finite values) has NaN values and is left out of the
    averages. ``*_sem`` is ``std / sqrt(n)`` over the ``n`` layers averaged
    (sample standard deviation), NaN when ``n < 2``.

    Args:
        kappa: layer name -> normalised rank ``kappa = M_s / M`` (in ``[1/M, 1]``; 1: all directions carry
            equal power), NaN without statistics.
        rho: layer name -> whiteness ``rho`` (in ``[1/M, 1]``; 1: uncorrelated features), NaN without
            statistics.
        kind: layer name -> ``"plain"``, ``"grad"`` or ``"direct"`` (default: empty).
        kappa_mean, rho_mean: the means over the layers with finite values (default NaN).
        kappa_sem, rho_sem: their standard errors, NaN with fewer than 2 layers (default NaN).
    """

    kappa: Dict[str, float]
    rho: Dict[str, float]
    kind: Dict[str, str] = field(default_factory=dict)
    kappa_mean: float = math.nan
    kappa_sem: float = math.nan
    rho_mean: float = math.nan
    rho_sem: float = math.nan

    @property
    def num_layers(self) -> int:
        """Number of layers in the averages."""
        return sum(1 for v in self.kappa.values() if math.isfinite(v))

    def as_dict(self) -> Dict[str, float]:
        """The four averages, e.g. for one CSV row."""
        return {"kappa": self.kappa_mean, "kappa_sem": self.kappa_sem, "rho": self.rho_mean, "rho_sem": self.rho_sem}


def _mean_sem(values: Iterable[float]) -> Tuple[float, float]:
    """The mean of the finite ``values`` and its standard error ``stdev / sqrt(n)`` (NaN for ``n < 2``)."""
    vals = [v for v in values if math.isfinite(v)]
    mean = statistics.fmean(vals) if vals else math.nan
    return mean, statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else math.nan


def _kappa_rho(cov: Optional[Tensor]) -> Tuple[float, float]:
    if cov is None or not bool(torch.isfinite(cov).all()):
        return math.nan, math.nan
    if cov.dim() == 3:  # a grouped layer's diagonal blocks
        return float(F_w.grouped_normalized_rank(cov)), float(F_w.grouped_whiteness(cov))
    return float(F_w.normalized_rank(cov)), float(F_w.whiteness(cov))


def summarize(covariances: Dict[str, Optional[Tensor]], kinds: Optional[Dict[str, str]] = None) -> Diagnostics:
    """:class:`Diagnostics` from per-layer covariances (``None`` or non-finite: NaN, left out of the means)."""
    kappa, rho = {}, {}
    for name, cov in covariances.items():
        kappa[name], rho[name] = _kappa_rho(cov)
    return Diagnostics(kappa, rho, dict(kinds or {}), *_mean_sem(kappa.values()), *_mean_sem(rho.values()))


def _targets(model: nn.Module, spec: TargetSpec) -> List[Tuple[str, nn.Module, str]]:
    """``(name, module to hook, kind)``: every whitening position, then the plain layers convert_model would target."""
    out: List[Tuple[str, nn.Module, str]] = []
    for name, m in model.named_modules():
        if isinstance(m, DirectWhitenWrapper):
            out.append((name, m.layer, "direct"))
        elif isinstance(m, GRAD_LAYER_TYPES):
            out.append((name, m, "grad"))
    return out + [(name, m, "plain") for name, m in spec.select(model)]  # (select lists no whitening layer)


class _Moments:
    """Shifted float64 sums of one layer's inputs over all batches (the layers' estimator)."""

    def __init__(self, layer: nn.Module) -> None:
        self.groups = getattr(layer, "groups", 1)  # (a linear layer: 1)
        self.spatial_dims = len(getattr(layer, "kernel_size", ()))  # (a linear layer: 0)
        self.count = 0
        self.shift: Optional[Tensor] = None
        self.s1: Optional[Tensor] = None
        self.s2: Optional[Tensor] = None

    def __call__(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        x = args[0].detach()
        if not self.spatial_dims:  # a linear layer's (*, in_features)
            x = x.reshape(-1, x.shape[-1])
        elif x.dim() == self.spatial_dims + 1:  # an unbatched input
            x = x.unsqueeze(0)
        if x.numel() == 0:
            return
        with torch.autocast(device_type=x.device.type, enabled=False):  # float64 even inside autocast
            x = x.to(torch.float64)
            if self.shift is None:
                self.shift = x.mean([0] + list(range(2, x.dim())))
            s1, s2 = F_w.batch_moments(x, self.shift, groups=self.groups)
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2
        self.count += x.numel() // x.shape[1]

    def covariance(self) -> Optional[Tensor]:
        if self.count == 0 or self.s1 is None:
            return None
        count = torch.tensor(float(self.count), dtype=torch.float64, device=self.s1.device)
        assert self.shift is not None and self.s2 is not None  # set with s1 (__call__)
        block = F_w.summarize_block(count, self.shift, self.s1, self.s2)
        return block.scatter / block.count


@torch.no_grad()
def collect_diagnostics(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    predicate: Optional[Predicate] = None,
    block_types: Optional[BlockTypes] = None,
    include_linear: Optional[bool] = None,
    device: Optional[torch.device] = None,
    max_batches: Optional[int] = None,
    targets: str = "blocks",
    include_stem: bool = False,
    include_classifier: bool = False,
    max_features: Optional[int] = None,
) -> Diagnostics:
    """``kappa`` / ``rho`` of the features each target layer's weights see, measured on ``batches``.

    ``batches`` is an iterable of input tensors or of ``(input, target, ...)``
    tuples (a ``DataLoader``); the first ``max_batches`` are used, moved to
    ``device`` (default: the model's). The model runs in eval mode under
    ``no_grad``; forward pre-hooks on the targets sum each target's input
    moments over all samples and positions in float64
    (:func:`~whitenlayers.functional.batch_moments` with a shift, then
    :func:`~whitenlayers.functional.summarize_block`), giving ``Phi_x`` about
    the data mean.

    Targets: every grad/recursive layer (``kappa``/``rho`` of
    ``T Phi_x T^T``, ``T`` its ``whitening_matrix``), the layer behind every
    ``direct`` ``DirectWhiten`` (its input, already whitened), and every plain
    layer that :func:`~whitenlayers.convert_model` would target with the same
    ``targets`` / ``predicate`` / ``block_types`` / ``include_linear`` /
    ``include_stem`` / ``include_classifier`` / ``max_features`` (``Phi_x``). So a plain model and
    its converted copy are measured on the same convolutions. Grouped
    convolutions are measured on their diagonal blocks (module docstring).

    Nothing about the model changes: each module's training flag is restored,
    the hooks are removed, and eval mode leaves parameters, buffers and the
    whitening layers' partial blocks untouched. Under ``torch.distributed``
    each rank measures its own batches.

    For a plain model pass the target keywords the conversion used, so that
    it and its converted copy are measured on the same layers.

    Args:
        model: a plain or converted model (left unchanged).
        batches: an iterable of input tensors or of ``(input, target, ...)`` tuples, e.g. a few batches of
            a ``DataLoader``; a few thousand samples give stable values.
        predicate, block_types, include_linear, targets, include_stem, include_classifier, max_features:
            which plain layers are measured: :func:`~whitenlayers.convert_model`'s keyword of that name.
        device: where the inputs go (default ``None``: the device of the model's first parameter or buffer).
        max_batches: use at most this many batches, an integer >= 0 (default ``None``: all of ``batches``).

    Returns:
        A :class:`Diagnostics`: per-layer values and their means.

    Example:
        >>> import torch, whitenlayers as wl
        >>> d = wl.collect_diagnostics(wl.models.resnet20(), [torch.randn(8, 3, 32, 32)])
        >>> len(d.kappa), 0 < d.kappa_mean <= 1, 0 < d.rho_mean <= 1
        (18, True, True)
    """
    spec = TargetSpec(targets, predicate, block_types, include_linear, include_stem, include_classifier, max_features)
    positions = _targets(model, spec)
    if device is None:  # the device of the model's first parameter or buffer
        device = next((t.device for t in itertools.chain(model.parameters(), model.buffers())), None)
    moments: Dict[str, _Moments] = {}
    handles = []
    try:
        for name, module, _ in positions:
            acc = moments[name] = _Moments(module)
            handles.append(module.register_forward_pre_hook(acc))
        with modes_kept(model.modules()):
            model.eval()
            for i, batch in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                if device is not None:
                    x = x.to(device)
                model(x)
    finally:
        for h in handles:
            h.remove()
    covs: Dict[str, Optional[Tensor]] = {}
    for name, module, kind in positions:
        cov = moments[name].covariance()
        if cov is not None and kind == "grad":
            t = cast(WhiteningLayer, module).whitening_matrix.to(device=cov.device, dtype=torch.float64)
            cov = F_w.symmetrize(F_w.whitened_covariance(t, cov))
        covs[name] = cov
    result = summarize(covs, {name: kind for name, _, kind in positions})
    missing = [n for n, v in result.kappa.items() if not math.isfinite(v)]
    if missing:
        warnings.warn(f"collect_diagnostics: no finite statistics for {len(missing)} layer(s), e.g. {missing[0]!r}; "
                      "they are left out of the averages", RuntimeWarning, stacklevel=2)
    return result


@torch.no_grad()
def layer_diagnostics(model: nn.Module) -> Diagnostics:
    """``kappa`` / ``rho`` of each whitening layer's ``T Phi_x T^T`` from its running buffers; no data needed.

    ``Phi_x`` is the layer's ``running_cov`` (centred on the running mean,
    recursively averaged over blocks) and ``T`` its ``whitening_matrix``
    (:meth:`~whitenlayers.WhiteningLayer.whitened_covariance`). For a
    ``direct`` layer that is the covariance of the ``DirectWhiten`` output,
    which the following layer sees. Keys are those of
    :func:`collect_diagnostics` (a ``direct`` layer under its wrapper's name).
    A layer that has folded no block yet has no statistics: NaN, left out of
    the averages. A plain model has no whitening layers: empty, NaN averages.

    Args:
        model: a converted model (or any module; only its whitening layers are read, nothing changes).

    Returns:
        A :class:`Diagnostics` from the running statistics, as of the last fold.
    """
    covs: Dict[str, Optional[Tensor]] = {}
    kinds: Dict[str, str] = {}
    wrapped = {id(m.whiten) for m in model.modules() if isinstance(m, DirectWhitenWrapper)}
    for name, m in model.named_modules():
        if isinstance(m, DirectWhitenWrapper):
            layer, kind = m.whiten, "direct"
        elif isinstance(m, GRAD_LAYER_TYPES):
            layer, kind = m, "grad"
        elif isinstance(m, WhiteningLayer) and id(m) not in wrapped:
            layer, kind = m, "direct"  # a DirectWhiten placed by hand: its output's covariance
        else:
            continue
        covs[name] = layer.whitened_covariance() if int(layer.num_blocks) > 0 else None
        kinds[name] = kind
    return summarize(covs, kinds)
