"""Taking the whitening out again: :func:`to_plain_model`, plain checkpoints in and out."""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import (
    Any,
    Dict,
    List,
    NamedTuple,
    Optional,
    Tuple,
    cast,
)

import torch
from torch import nn

from .. import functional as F_w
from .._rebuild import layer_like, plain_conv_class
from ..autograd import _transform_mean
from ..layers import (
    GRAD_LAYER_TYPES,
    GradWhitenLinear,
)
from ..layers.checkpoint import loading_plain_checkpoint
from ._common import _CALL_HOOKS, _STATE_HOOKS, DirectWhitenWrapper, _remove_coordinators, _share_hooks, _swap_in
from .absorb import absorbing_batchnorms
from .targets import whitening_layers


# --------------------------------------------------------------------------
# to_plain_model
# --------------------------------------------------------------------------
def _zero_padding(conv: Any) -> bool:
    """Whether the convolution ``conv`` pads nothing."""
    if conv.padding == "same":  # (as much as the dilated kernel covers beyond one position)
        return all(d * (k - 1) == 0 for d, k in zip(conv.dilation, conv.kernel_size))
    return conv.padding == "valid" or all(p == 0 for p in conv.padding)


def _fuses_into_layer(wrapper: DirectWhitenWrapper) -> bool:
    """Whether a direct layer exports as one layer with weight ``W T``: a linear layer or an unpadded conv."""
    layer = wrapper.layer
    return isinstance(layer, nn.Linear) or _zero_padding(layer)


def _direct_absorbers(model: nn.Module) -> Dict[int, nn.BatchNorm2d]:
    """``id(wrapper) -> BatchNorm`` for each bias-free direct layer that exports as one layer and whose output one
    BatchNorm alone takes (the rule of :func:`~whitenlayers.convert.absorbing_batchnorms`): its export stays
    bias-free, its offset ``sum_k (W T)_k mu`` goes into that BatchNorm's ``running_mean``."""
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, DirectWhitenWrapper) and m.layer.bias is None and _fuses_into_layer(m)]
    return {key: cast(nn.BatchNorm2d, bn) for key, (bn, _) in absorbing_batchnorms(model, candidates).items()}


@torch.no_grad()
def _export_direct(wrapper: DirectWhitenWrapper, bn: Optional[nn.BatchNorm2d] = None) -> nn.Module:
    """The plain form of a direct layer: the padded conv after a 1x1 whitening conv, or one layer with weight
    ``W T`` and the offset ``-sum_k (W T)_k mu`` in its bias or, given the BatchNorm ``bn`` that alone takes a
    bias-free layer's output, in that BatchNorm's ``running_mean`` (exact: it subtracts it; in training mode it
    removes any constant)."""
    layer: Any  # a conv (any dimension) or linear layer: the code reads the attributes of its kind
    whiten, layer = wrapper.whiten, wrapper.layer
    t = whiten.whitening_matrix.to(torch.float64)
    mu = whiten.running_mean.to(torch.float64)
    w = layer.weight
    if not _fuses_into_layer(wrapper):
        # conv(pad(T (x - mu))) != conv(pad(x)) with any constant bias at the border: keep a 1x1 whitening conv
        # (grouped like T: one k x k block per group).
        m, groups = whiten.num_features, whiten.groups
        pre = plain_conv_class(layer)(m, m, 1, groups=groups, bias=True, device=w.device, dtype=w.dtype)
        pre.weight.copy_(t.reshape((m, m // groups) + (1,) * len(layer.kernel_size)))
        pre.bias.copy_(-_transform_mean(t, mu))
        pre.weight.requires_grad_(w.requires_grad)
        out: Any = nn.Sequential(pre, layer)  # or (below) the plain conv or linear layer
    else:
        # layer(T (x - mu)) = layer(x; W T) - sum_k (W T)_k mu: exact for unpadded convs and linear layers.
        t_blocks = t if t.dim() == 3 else t.unsqueeze(0)  # W_g T_g per group of output channels (one group: W T)
        w64 = w.to(torch.float64).reshape((t_blocks.shape[0], w.shape[0] // t_blocks.shape[0]) + tuple(w.shape[1:]))
        wt = torch.einsum("gsi...,gij->gsj...", w64, t_blocks).reshape(w.shape)
        offset = F_w.weight_mean_product(wt, mu)
        out = layer_like(layer, bias=bn is None)
        out.weight.copy_(wt)
        out.weight.requires_grad_(w.requires_grad)
        if bn is None:
            bias = layer.bias.to(torch.float64) if layer.bias is not None else torch.zeros_like(offset)
            out.bias.copy_(bias - offset)
        elif bn.running_mean is not None:  # (without running statistics the BatchNorm removes it in eval too)
            bn.running_mean.copy_((bn.running_mean.to(torch.float64) + offset).to(bn.running_mean.dtype))
        _share_hooks(layer, out, _STATE_HOOKS)
    _share_hooks(wrapper, out, _CALL_HOOKS)
    out.train(wrapper.training)
    return out


@torch.no_grad()
def _export_absorbed(layer: Any) -> nn.Module:  # a grad layer (conv of any dimension or linear)
    """A layer whose centring its BatchNorm absorbs: the plain layer with the original keys, ``s - d`` moved into
    the BatchNorm's ``running_mean`` (exact: the BatchNorm subtracts it; in training mode it removes any offset)."""
    w = layer.weight
    has_bias = layer.bias is not None
    out: Any = layer_like(layer, bias=has_bias)
    out.weight.copy_(w)
    out.weight.requires_grad_(w.requires_grad)
    if has_bias:
        out.bias.copy_(layer.bias)
        out.bias.requires_grad_(layer.bias.requires_grad)
    bn = layer._absorbing_bn()
    if bn.running_mean is not None:
        shift = layer._skipped_offset(w.detach().to(torch.float64)) - layer.absorbed_offset.to(torch.float64)
        bn.running_mean.copy_((bn.running_mean.to(torch.float64) - shift).to(bn.running_mean.dtype))
    out.train(layer.training)
    return out


def _export_one(module: nn.Module, direct_absorbers: Dict[int, nn.BatchNorm2d]) -> Optional[nn.Module]:
    if isinstance(module, DirectWhitenWrapper):
        return _export_direct(module, direct_absorbers.get(id(module)))
    if isinstance(module, GRAD_LAYER_TYPES):
        if module._hooks_after_absorbing():
            module._centre_for_hooks()
        if module.centring == "absorbed" and module._absorbing_bn() is not None:
            out = _export_absorbed(module)
        elif isinstance(module, GradWhitenLinear):
            out = module.to_linear()
        else:
            out = module.to_conv()
        _share_hooks(module, out, _CALL_HOOKS + _STATE_HOOKS)
        return out
    return None


def to_plain_model(model: nn.Module) -> nn.Module:
    """Fold the whitening out of ``model``, in place; returns the plain model.

    * Every grad / recursive layer that centres its input becomes a plain
      ``nn.Conv2d`` / ``nn.Linear`` (:meth:`~whitenlayers.GradWhitenConv2d.to_conv`):
      same weight, the running mean folded into the bias. Outputs are
      identical; the layer always has a bias afterwards (``bias - sum_k W_k mu``,
      plus the bias compensation of a bias-free layer).
    * A grad / recursive layer whose centring a following BatchNorm absorbs
      (``layer.centring == "absorbed"``, the default of :func:`convert_model`
      where the output feeds only a BatchNorm) becomes the plain layer with
      the original's bias setting (bias-free stays bias-free), and its offset
      (``s - d``, see :meth:`~whitenlayers.GradWhitenConv2d.absorb_centring`)
      is subtracted from that BatchNorm's ``running_mean`` (computed in
      float64): exact in eval mode, and in training mode the BatchNorm
      removes any offset anyway. The export then has the state-dict keys of
      the original architecture.
    * Every ``direct`` wrapper :class:`DirectWhitenWrapper` becomes, when exact,
      one plain layer with weight ``W T`` and bias ``b - sum_k (W T)_k mu``:
      always for ``nn.Linear``, and for an ``nn.Conv2d`` without padding
      (1x1 downsample convs). A bias-free one whose output one BatchNorm
      alone takes (a ``Conv2d(..., bias=False)`` then ``BatchNorm2d``, by the
      rule of :func:`~whitenlayers.convert.absorbing_batchnorms`) stays
      bias-free: its offset ``sum_k (W T)_k mu`` is added to that
      BatchNorm's ``running_mean`` (in float64; exact, as for the grad layers
      above); other bias-free ones get the bias. A padded conv cannot
      absorb ``T`` and ``mu`` (its zero border would have to be ``-T mu``),
      so it becomes
      ``nn.Sequential(Conv2d(C, C, 1) with weight T and bias -T mu, conv)``:
      exact, plain PyTorch, but with the extra 1x1 conv the direct method
      costs anyway. State-dict keys there are ``name.0.*`` and ``name.1.*``.
    * A bare :class:`~whitenlayers.DirectWhiten` not created by
      :func:`convert_model` is left alone.

    The new modules have new Parameters (an optimizer must be rebuilt), the
    original training flag and the call hooks of the replaced module. The
    :class:`~whitenlayers.coordinator.FoldCoordinator` hooks are removed. A partial block
    and the whitening state are dropped: the export computes what the
    converted model computes in eval mode now. A whitening layer passed as
    ``model`` is returned exported.

    Args:
        model: a model converted by :func:`convert_model` (or a single whitening layer), changed in place;
            pass ``copy.deepcopy(model)`` to keep the converted one.

    Returns:
        ``model`` with only plain PyTorch modules (the exported layer when ``model`` was one).
    """
    out = _export_one(model, {})
    if out is not None:
        return out
    _swap_in(model, functools.partial(_export_one, direct_absorbers=_direct_absorbers(model)))
    for m in model.modules():
        _remove_coordinators(m)
    return model


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
class _LoadResult(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def _whitening_of(shape: torch.Size, weight: torch.Tensor, bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(T, mu)`` of the 1x1 whitening conv that :func:`to_plain_model` puts before a padded direct conv (weight
    ``T``, bias ``-T mu``): ``T`` in the whitening matrix's ``shape`` (``(G, M/G, M/G)`` when grouped) and
    ``mu = -T^-1 b``, solved in float64."""
    t = weight.to(torch.float64).reshape(shape)
    b = bias.to(torch.float64).reshape(t.shape[:-1] + (1,))
    return t, -torch.linalg.solve(t, b).reshape(-1)


#: Rounding allowance of :func:`_mean_of_bias`, in units of the checkpoint dtype's eps: the exported ``W T`` and
#: bias are each rounded once to that dtype, which moves ``sum_k W_k mu + b`` by at most ``eps / 2`` of its terms'
#: magnitudes; 16 leaves room for the float64 solve (backward stable) and the order of the sums.
_BIAS_MEAN_TOLERANCE = 16


def _mean_of_bias(weight: Optional[torch.Tensor], bias: torch.Tensor, groups: int) -> Optional[torch.Tensor]:
    """The input mean ``mu`` with ``-sum_k W_k mu = b``: what a bias-free unpadded direct layer's exported bias
    (``-sum_k (W T)_k mu`` beside the weight ``W T``) gives back with ``T = I``. ``weight`` is ``(S, M/G, *kernel)``
    or ``(S, M)``, solved per group of ``groups`` by least squares in float64 on the CPU (LAPACK's rank-revealing
    ``gelsy``: the least-norm mean where several give ``b``). ``None`` when no mean gives ``b`` to the rounding of the
    checkpoint's dtype (a bias that no input mean explains), or without a ``weight``."""
    if weight is None:
        return None
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    w = w.reshape(w.shape[0], w.shape[1], -1)
    a = w.sum(-1).reshape(groups, w.shape[0] // groups, w.shape[1])  # (G, S/G, M/G): sum_k W_k per group
    b = bias.detach().to(device="cpu", dtype=torch.float64).reshape(groups, -1, 1)
    mu = torch.linalg.lstsq(a, -b, driver="gelsy").solution
    residual = torch.linalg.vector_norm(a @ mu + b)
    scale = torch.linalg.vector_norm(w.abs().sum(-1).reshape(a.shape) @ mu.abs()) + torch.linalg.vector_norm(b)
    if residual > _BIAS_MEAN_TOLERANCE * torch.finfo(weight.dtype).eps * scale:
        return None
    return mu.reshape(-1)


def load_plain_state_dict(model: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> _LoadResult:
    """Load a checkpoint of the *unconverted* architecture into a converted ``model``.

    Keys are translated (``name.weight`` -> ``name.layer.weight`` for a
    ``direct`` wrapper; for a bias-free grad/recursive layer an incoming
    ``name.bias``, as written by :func:`plain_state_dict`, goes to its
    ``bias_correction``), every whitening layer is reset to the identity state
    of a fresh conversion (``mu = 0``, ``T = Q_s = I``, no blocks, no partial
    block), and the parameters and other buffers are loaded. The converted
    model then computes exactly what the plain model with that checkpoint
    computes. What ``plain_state_dict(model, strict=False)`` writes for the
    direct layers that the original architecture cannot hold loads too. A
    padded direct conv exported as ``Sequential(1x1 whitening conv, conv)``:
    ``name.1.*`` goes to ``name.layer.*``, and the 1x1 conv's weight ``T`` and
    bias ``-T mu`` set that layer's ``T`` and ``mu`` (solved in float64), the
    rest of its whitening state fresh. A bias-free unpadded direct layer
    exported with a bias ``b = -sum_k W_k mu``: ``b`` sets that layer's
    ``mu`` (``T = I``; least squares in float64, per group); a bias that no
    mean gives, to the checkpoint dtype's rounding, is an unexpected key.
    With ``strict`` a key of the checkpoint
    that has no place, or a key of the model that the checkpoint lacks (the
    whitening state aside), raises ``RuntimeError`` before anything is
    changed. Returns
    ``(missing_keys, unexpected_keys)`` like ``load_state_dict``.

    Args:
        model: the converted model to load into (in place).
        state_dict: a checkpoint of the unconverted architecture (``plain.state_dict()``, or
            :func:`plain_state_dict` of a converted model).
        strict: ``True`` (default) refuses keys without a place and missing keys, as ``load_state_dict``;
            ``False`` loads what fits and returns the rest.

    Example:
        >>> import torch, whitenlayers as wl
        >>> plain = wl.models.resnet20()
        >>> model = wl.convert_model(wl.models.resnet20(), method="direct")
        >>> wl.load_plain_state_dict(model, plain.state_dict())
        _LoadResult(missing_keys=[], unexpected_keys=[])
    """
    positions = {n: m for n, m in model.named_modules() if isinstance(m, GRAD_LAYER_TYPES + (DirectWhitenWrapper,))}
    layers = whitening_layers(model)
    # the whitening layers' own keys (bias_correction: zero when the checkpoint has no bias)
    whitening_state = {f"{name}.{key}" if name else key for name, layer in layers
                       for key in cast(nn.Module, layer).state_dict() if key not in ("weight", "bias")}
    model_keys = set(model.state_dict().keys())
    translated: Dict[str, Any] = {}
    unexpected = []
    whitening_convs: Dict[str, Dict[str, Any]] = {}  # a padded direct conv's 1x1 whitening conv: name -> its tensors
    for key, value in state_dict.items():
        new_key = key
        head, _, leaf = key.rpartition(".")
        pos = positions.get(head)
        owner, _, part = head.rpartition(".")
        if pos is None and part in ("0", "1") and isinstance(positions.get(owner), DirectWhitenWrapper):
            if part == "0":  # Sequential(1x1 whitening conv, conv), as to_plain_model exports a padded direct conv
                whitening_convs.setdefault(owner, {})[leaf] = value
                continue
            new_key = f"{owner}.layer.{leaf}"
        elif isinstance(pos, DirectWhitenWrapper):
            new_key = f"{head}.layer.{leaf}"
            if leaf == "bias" and pos.layer.bias is None and _fuses_into_layer(pos):  # -sum_k (W T)_k mu: gives mu
                mu = _mean_of_bias(state_dict.get(f"{head}.weight"), value, getattr(pos.layer, "groups", 1))
                new_key, value = (key, value) if mu is None else (f"{head}.whiten.running_mean", mu)  # (unexpected)
        elif pos is not None and leaf == "bias" and pos.bias is None:
            new_key = f"{head}.bias_correction"
        if new_key in model_keys:
            translated[new_key] = value
        else:
            unexpected.append(key)
    for owner, tensors in whitening_convs.items():
        if set(tensors) == {"weight", "bias"}:
            whiten = cast(DirectWhitenWrapper, positions[owner]).whiten
            t, mu = _whitening_of(whiten.whitening_matrix.shape, tensors["weight"], tensors["bias"])
            translated[f"{owner}.whiten.whitening_matrix"], translated[f"{owner}.whiten.running_mean"] = t, mu
        else:
            unexpected += [f"{owner}.0.{leaf}" for leaf in tensors]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        translated = OrderedDict(translated)
        translated._metadata = OrderedDict(  # type: ignore[attr-defined]
            (f"{k}.layer" if isinstance(positions.get(k), DirectWhitenWrapper) else k, v) for k, v in metadata.items()
        )
    missing = sorted(k for k in model_keys - set(translated) if k not in whitening_state)
    unexpected.sort()
    if strict and (missing or unexpected):
        raise RuntimeError(
            "load_plain_state_dict: checkpoint does not match the model: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    for _, layer in layers:
        # the state right after conversion (mu = 0, T = Q_s = I, no blocks, no bias compensation); also d = 0: the
        # checkpoint's BatchNorm running mean is the plain model's
        layer.reset_running_stats()
    with loading_plain_checkpoint():
        model.load_state_dict(translated, strict=False)
    return _LoadResult(missing, unexpected)


def _not_original(model: nn.Module) -> Dict[str, str]:
    """Qualified name -> why the original architecture cannot hold that converted layer's current function."""
    out = {}
    direct_absorbers = _direct_absorbers(model)
    for name, module in model.named_modules():
        if isinstance(module, DirectWhitenWrapper):
            if not _fuses_into_layer(module):
                out[name] = ("a padded direct conv: its zero border would have to be -T mu, so it exports as "
                             "Sequential(1x1 whitening conv, conv)")
            elif module.layer.bias is None and id(module) not in direct_absorbers:
                out[name] = ("a bias-free direct layer whose output is not taken by one BatchNorm alone (or that "
                             "has forward hooks, or is called in a forward that torch.fx cannot trace): its offset "
                             "-sum_k (W T)_k mu needs a bias the original lacks")
        elif isinstance(module, GRAD_LAYER_TYPES) and module.bias is None:
            hooks = module._hooks_after_absorbing()
            if hooks:
                out[name] = (f"a bias-free layer whose forward hook(s) {hooks}, registered after convert_model "
                             "absorbed its centring, see its output: it centres its input again (as convert_model "
                             "leaves a layer with forward hooks), which needs a bias the original lacks; register "
                             "the hooks before convert_model")
            elif not (module.centring == "absorbed" and module._absorbing_bn() is not None):
                out[name] = "a bias-free layer that centres its input: the centring needs a bias the original lacks"
    return out


def plain_state_dict(model: nn.Module, strict: bool = True) -> Dict[str, Any]:
    """The converted ``model``'s current function as a checkpoint of the original architecture (no whitening state).

    It is ``to_plain_model(copy.deepcopy(model)).state_dict()`` (see
    :func:`to_plain_model`). With ``strict`` (default) its keys are exactly
    those of the unconverted architecture: it loads with ``strict=True`` into
    a fresh unconverted model, which then computes what the converted model
    computes in eval mode. That holds for every grad / recursive layer whose
    centring a BatchNorm absorbs (the default of :func:`convert_model` in
    every ResNet; the offsets move into the BatchNorms' ``running_mean``),
    every layer with a bias, and every unpadded ``direct`` layer (linear, 1x1
    and other unpadded convs, strided or not) that has a bias or whose
    output one BatchNorm alone takes (a bias-free 1x1 shortcut conv before
    its ``BatchNorm2d``: the offset ``sum_k (W T)_k mu`` moves into that
    BatchNorm's ``running_mean``). The other layers have no exact form in
    the original architecture, and with ``strict`` a ``ValueError`` names
    them:

    * a padded ``direct`` conv (``conv(pad(T (x - mu)))``: the zero border
      would have to be ``-T mu``); :func:`to_plain_model` turns it into
      ``nn.Sequential(1x1 whitening conv, conv)``, keys ``name.0.*`` and
      ``name.1.*``;
    * a bias-free unpadded ``direct`` layer whose output is not taken by one
      BatchNorm alone (or that has forward hooks, or is called in a forward
      that ``torch.fx`` cannot trace): its export needs a ``bias``,
      ``-sum_k (W T)_k mu``;
    * a bias-free grad / recursive layer that centres its input (converted
      with ``absorb_centring=False``, or not followed by a BatchNorm): its
      export needs a ``bias`` (the running mean folded in).

    ``strict=False`` returns the export's state dict as it is, those extra
    keys included; :func:`load_plain_state_dict` loads it back into a
    converted model, and :func:`to_plain_model` gives the matching module.

    Args:
        model: the converted model (left unchanged).
        strict: ``True`` (default) guarantees the original architecture's keys, raising ``ValueError``
            for the layers that cannot have them; ``False`` returns the export's keys as they are.

    Returns:
        The state dict, new tensors (the model's own are not shared).
    """
    if strict:
        bad = _not_original(model)
        if bad:
            reasons: Dict[str, List[str]] = {}
            for name, why in bad.items():
                reasons.setdefault(why, []).append(repr(name))
            listing = "; ".join(f"{', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}: "
                                f"{why}" for why, names in reasons.items())
            raise ValueError(
                f"plain_state_dict: the original architecture cannot hold the function of {len(bad)} converted "
                f"layer(s): {listing}. Use wl.to_plain_model(copy.deepcopy(model)) for a plain model with that extra "
                "structure, or plain_state_dict(model, strict=False) for its checkpoint (load it back with "
                "wl.load_plain_state_dict)")
    return to_plain_model(copy.deepcopy(model)).state_dict()
