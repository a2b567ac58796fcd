"""The whitening layers.

* :class:`DirectWhiten`: ``y = T (x - mu)`` inserted before a layer (paper section 2).
* :class:`GradWhitenConv2d` / :class:`GradWhitenLinear`: drop-in ``nn.Conv2d`` /
  ``nn.Linear`` that centre their input on the running mean and right-multiply
  their weight gradient by ``Q_s`` (paper section 3, EVD transform).
* :class:`RecursiveWhitenConv2d` / :class:`RecursiveWhitenLinear`: the same
  layers with the recursive ``O(M^2)`` transform update (paper section 4).
* :class:`GradWhitenConv1d` / :class:`GradWhitenConv3d` and
  :class:`RecursiveWhitenConv1d` / :class:`RecursiveWhitenConv3d`: the same for
  ``nn.Conv1d`` / ``nn.Conv3d`` (audio, sequence and video models).

Centring convention (``docs/PAPER.md``, "Conventions"): a convolution computes
``z = conv(pad(x) - mu, W) + b``, i.e. it centres *after* padding. This equals
``conv(x, W) + (b - sum_k W_k mu)``, which is how it is computed: the plain
convolution with an adjusted bias, so no centred copy of the activation is
made or saved, and autograd produces the centred weight gradient by itself.
Any ``padding_mode`` is supported under this convention (the identity holds
for every padding mode).

Grouped convolutions (``docs/PAPER.md``, "Conventions"): a conv with ``groups=G``
whitens each group's ``k = M/G`` input channels on their own. ``T`` and
``Q_s`` are block-diagonal (one ``k x k`` block per group, kept as a
``(G, k, k)`` tensor), the statistics are the diagonal blocks of ``Phi_x``
(never the full ``M x M`` product), the EVD gains are those of the whole
block-diagonal ``Phi_x`` (normalised by the layer's mean eigenvalue), and the
weight gradient of group ``g``'s ``S/G`` output channels is right-multiplied by
``Q_g``. So the equivalence of paper section 3.1 holds per group: the layer
with weights ``W_g T_g`` trains like ``DirectWhiten(groups=G)`` followed by the
grouped conv with weights ``W_g``. **Depthwise** (``k = 1``, ``groups ==
in_channels``): ``T`` and ``Q_s`` are diagonal, i.e. a per-channel gain; with
the default practical gains channel ``c`` gets ``g_c = min(mean_c' var_c' /
var_c, gmax)`` (``T_c = sqrt(g_c)``) if it is among the ``round(M_s)``
highest-variance channels (``M_s`` the effective rank of the channel
variances) and 1 otherwise: the strong channels are standardised to the
layer's mean variance, gains capped at ``gmax``, the weakest channels left
alone; ``gains="zca"`` gives plain standardisation ``1 / max(var_c, eps)``.
The gradient transform then scales each output channel's weight gradient by
its input channel's gain, which is what training on standardised inputs
amounts to for a depthwise conv.

Centring absorbed by a following BatchNorm (docs/conventions.md): after
``layer.absorb_centring(bn)`` (which :func:`~whitenlayers.convert_model` calls
where the output feeds a BatchNorm and nothing else) the layer skips the
per-channel offset ``s = c - sum_k W_k mu`` whenever ``bn`` normalises with
batch statistics, because ``bn`` removes any per-channel constant and its
input gradient sums to zero per channel, so the offset's weight-gradient
term vanishes too; training is unchanged up to rounding. The BatchNorm's
``running_mean`` then averages ``conv(x)`` instead of ``conv(x) + s``; the
layer keeps the difference, ``d`` (buffer ``absorbed_offset``: ``s``
averaged with the BatchNorm's own momentum), and whenever ``bn`` uses its
running statistics (eval mode, or a frozen BatchNorm) it adds ``s - d``:
``bn`` then sees exactly what it sees after the centred layer.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Dict, Literal, Optional, Tuple, Type, Union, cast

import torch
from torch import Tensor, nn
from torch.nn.common_types import _size_1_t, _size_2_t, _size_3_t
from torch.nn.modules.batchnorm import _BatchNorm

from . import functional as F_w
from .autograd import direct_whiten, grad_transformed
from .config import EVDConfig, RecursiveConfig, WhiteningConfig, make_config
from .patches import FEATURES, patch_padding, unfold_patches
from .stats import WhiteningStatistics, _is_compiling

if TYPE_CHECKING:  # pragma: no cover
    from torch.nn.modules.conv import _ConvNd

__all__ = [
    "DirectWhiten",
    "GradWhitenConv1d",
    "GradWhitenConv2d",
    "GradWhitenConv3d",
    "RecursiveWhitenConv1d",
    "RecursiveWhitenConv3d",
    "GradWhitenLinear",
    "RecursiveWhitenConv2d",
    "RecursiveWhitenLinear",
    "WhiteningStatistics",
]



def _with_whitening_signature(config_class: Type[WhiteningConfig], exclude: tuple = ()):
    """Show the config's fields as keyword-only arguments in ``help()`` / ``inspect.signature`` of ``__init__``.

    The constructors take them as ``**whitening`` (one source of names and
    defaults: the config dataclass); this only documents them.
    """

    def decorate(init):
        sig = inspect.signature(init)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        for f in dataclasses.fields(config_class):
            if f.name not in exclude:
                params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                                annotation=f.type))
        init.__signature__ = sig.replace(parameters=params)
        return init

    return decorate


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _check_input(layer: WhiteningStatistics, x: Tensor, *, dim: int, ndims: tuple, what: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer._describe()}: expected a Tensor input, but got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{layer._describe()}: expected a floating-point input, but got dtype={x.dtype}")
    weight = getattr(layer, "weight", None)
    if isinstance(weight, Tensor) and x.dtype != weight.dtype and not _autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer._describe()}: expected an input of dtype {weight.dtype} (the dtype of the layer's weight), "
            f"but got dtype={x.dtype}"
        )
    if x.dim() not in ndims:
        raise ValueError(f"{layer._describe()}: expected {what}, but got input of shape {tuple(x.shape)}")
    expected = getattr(layer, "in_channels", layer.num_features)  # a patch layer has C k^2 features of C channels
    if x.shape[dim] != expected:
        unit = "channels" if hasattr(layer, "in_channels") else "features"
        raise ValueError(
            f"{layer._describe()}: expected {expected} input {unit} on dim {dim % x.dim()}, but got {x.shape[dim]} "
            f"(input shape {tuple(x.shape)})"
        )


class DirectWhiten(WhiteningStatistics, nn.Module):
    """Direct feature whitening ``y = T (x - mu)`` along dim 1 (paper section 2, EVD transform).

    Inputs ``(B, C)`` or ``(B, C, *spatial)``. In training mode each forward adds
    the batch to the block statistics (of ``x``); after ``block_size`` training
    forwards the block is folded in and ``mu``, ``T`` are updated. The backward
    is ``dx = T^T dy`` with ``T`` and ``mu`` constants; nothing activation-sized
    is saved for backward.

    ``groups=G`` whitens each of ``G`` groups of ``C/G`` consecutive features
    on its own (the input whitening of a ``groups=G`` convolution):
    ``whitening_matrix`` and ``running_cov`` are then the ``(G, C/G, C/G)``
    diagonal blocks (see the module docstring; depthwise ``C/G = 1`` is a
    per-channel gain).

    Example:
        >>> import torch, whitenlayers as wl
        >>> layer = wl.DirectWhiten(3, block_size=1)
        >>> y = layer(torch.randn(16, 3, 4, 4) * torch.tensor([1.0, 5.0, 0.2]).view(1, 3, 1, 1))
        >>> int(layer.num_blocks), tuple(layer.whitening_matrix.shape)
        (1, (3, 3))
    """

    _CONFIG_CLASS = EVDConfig
    _unused_fields = ("beta",)  # no gradient transform to smooth
    _FORWARD_BUFFERS = ("running_mean", "whitening_matrix")

    @_with_whitening_signature(EVDConfig, exclude=_unused_fields)
    def __init__(
        self,
        num_features: int,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        device=None,
        dtype=None,
        groups: int = 1,
        **whitening: Any,
    ) -> None:
        nn.Module.__init__(self)
        cfg = make_config(EVDConfig, type(self).__name__, config, whitening, exclude=self._unused_fields)
        self._init_whitening(num_features, cfg, grad_transform=False, process_group=process_group, device=device,
                             dtype=dtype, groups=groups)

    def extra_repr(self) -> str:
        rest = self._whitening_repr()
        if self.groups != 1:
            rest = f"groups={self.groups}" + (f", {rest}" if rest else "")
        return f"{self.num_features}" + (f", {rest}" if rest else "")

    def forward(self, x: Tensor) -> Tensor:
        _check_input(self, x, dim=1, ndims=tuple(range(2, 9)), what="an input of shape (B, C) or (B, C, *spatial)")
        training, state = self._forward_state()
        if training:
            self._accumulate(x)
        t = state["whitening_matrix"]
        if torch.is_grad_enabled() and x.requires_grad:
            t = t.clone()  # the backward must use the T of this forward, even if a fold follows
        out = direct_whiten(x, t, state["running_mean"])
        if training:
            self._end_batch()
        return out


class _GradWhitenMixin(WhiteningStatistics):
    """Shared by the grad/recursive conv and linear layers: centring, bias compensation, gradient transform."""

    weight: Tensor
    bias: Optional[Tensor]
    # Where the BatchNorm that absorbs the centring is (absorb_centring): (None, bn) or (parent, child name), the
    # latter looked up at every forward so that a replaced BatchNorm (convert_sync_batchnorm) is followed. A plain
    # attribute: neither the BatchNorm nor the parent is a submodule of the layer.
    _centring_ref: Optional[Tuple[Optional[nn.Module], Any]] = None

    #: The config class of the layer's rule (EVD for the grad layers, recursive for the recursive ones).
    _CONFIG: Type[WhiteningConfig] = EVDConfig
    _FORWARD_BUFFERS = ("running_mean", "grad_transform", "bias_correction")

    if TYPE_CHECKING:  # pragma: no cover
        bias_correction: Tensor  # the buffer :meth:`_init_grad_whitening` registers

    def _init_grad_whitening(self, num_features: int, out_features: int, config: Optional[WhiteningConfig],
                             whitening: Dict[str, Any], process_group: Any, device, dtype, groups: int = 1) -> None:
        cfg = make_config(self._CONFIG, type(self).__name__, config, whitening)
        self._init_whitening(num_features, cfg, grad_transform=True, process_group=process_group, device=device,
                             dtype=dtype, groups=groups)
        # The compensation ``c`` of mean updates (ERRATA 8): a buffer, never written into a parameter (a sharded
        # wrapper holds the full bias only during the forward, and autograd may hold it until the backward).
        self.register_buffer("bias_correction", torch.zeros(out_features, device=device, dtype=self.running_mean.dtype))

    def _mean_per_tap(self, mean: Tensor, dtype: torch.dtype) -> Tensor:
        """``mu`` repeated for every kernel tap, in ``dtype``: ``W.reshape(S, -1) @ mu_k = sum_k W_k mu`` in one
        product. Cached per mean tensor and version (a fold replaces the mean; an in-place write, e.g. DDP's
        buffer broadcast or ``load_state_dict``, bumps its version), so once per block on the hot path."""
        key = (mean, mean._version, dtype)
        cached = self._mean_taps
        if cached is not None and cached[0] is mean and cached[1:3] == key[1:]:
            return cached[3]
        taps = 1 if self.features == "patches" else self.weight[0, 0].numel()  # a patch mean has one entry per tap
        value = mean.to(dtype) if taps == 1 else mean.to(dtype).repeat_interleave(taps)
        if not _is_compiling():
            self._mean_taps = key + (value,)
        return value

    _mean_taps: Optional[tuple] = None

    #: ``"channels"`` (the paper: one feature per input channel) or ``"patches"`` (a 2-D conv only: the unfolded
    #: ``C k^2`` input patch; :mod:`whitenlayers.patches`).
    features: str = "channels"

    def _weight_matrix(self, weight: Tensor) -> Tensor:
        """The weight as the layer's features see it: ``(S, C k^2)`` for patch features, else unchanged."""
        return weight.flatten(1) if self.features == "patches" else weight

    def _offset(self, weight: Tensor, mean: Tensor, comp: Tensor) -> Tensor:
        """``s = c - sum_k W_k mu`` (one ``addmv`` for a dense layer), in ``weight``'s dtype."""
        if self.groups != 1:  # grouped conv: each group's outputs see its own channels of the mean
            return comp.to(weight.dtype) - F_w.weight_mean_product(weight, mean)
        w2, mean_k = weight.reshape(weight.shape[0], -1), self._mean_per_tap(mean, weight.dtype)
        if torch.onnx.is_in_onnx_export():  # the TorchScript-based exporter has no addmv
            return comp.to(weight.dtype) - w2 @ mean_k
        return torch.addmv(comp.to(weight.dtype), w2, mean_k, alpha=-1)

    def _effective_bias(self, weight: Tensor, state: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """``b + c - sum_k W_k mu``: the bias that makes the plain layer compute the centred one.

        ``state``: the buffers of this forward (:meth:`_forward_state`), by default those in force. Nothing here
        is written in place later (a fold replaces ``mu`` and ``c``), so the backward needs no copies.
        """
        state = self._buffers if state is None else state
        shift = self._offset(weight, state["running_mean"], state["bias_correction"])
        return shift if self.bias is None else self.bias + shift

    def _layer_bias(self, weight: Tensor, state: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """The bias of the equivalent plain layer: :meth:`_effective_bias`, minus ``d`` when the centring is absorbed
        (then the output is the centred layer's minus ``d``, what its BatchNorm's running mean expects)."""
        bias = self._effective_bias(weight, state)
        absorbed = self._buffers.get("absorbed_offset")
        return bias if absorbed is None else bias - absorbed.to(bias.dtype)

    # ------------------------------------------------ centring absorbed by a BatchNorm
    @property
    def centring(self) -> str:
        """``"input"`` (the layer centres its input) or ``"absorbed"`` (by :attr:`centring_batchnorm`)."""
        return "input" if self._centring_ref is None else "absorbed"

    @property
    def centring_batchnorm(self) -> Optional[nn.Module]:
        """The module that absorbs this layer's centring (see :meth:`absorb_centring`), or ``None``.

        With ``parent`` given to :meth:`absorb_centring`, whatever module is in that place now.
        """
        ref = self._centring_ref
        if ref is None:
            return None
        parent, what = ref
        return what if parent is None else parent._modules.get(what)

    def _absorbing_bn(self) -> Optional[_BatchNorm]:
        bn = self.centring_batchnorm
        return bn if isinstance(bn, _BatchNorm) else None

    @torch.no_grad()
    def absorb_centring(self, batchnorm: Optional[_BatchNorm], parent: Optional[nn.Module] = None) -> None:
        """Let ``batchnorm``, which alone consumes this layer's output, absorb the centring; ``None`` undoes it.

        docs/conventions.md, "Centring absorbed by a following BatchNorm". The layer computes
        ``z = conv(x, W) + b`` (no centring offset ``s = c - sum_k W_k mu``)
        whenever ``batchnorm`` normalises with batch statistics (training
        mode, or no running statistics): the BatchNorm subtracts the batch
        mean, which removes ``s`` exactly, and its input gradient sums to zero
        per channel, so ``s``'s weight-gradient term ``-(sum dz) mu^T`` is zero.
        Training (weights, whitening state, BatchNorm output) is the centred
        layer's up to rounding, without the pass over the output that adds
        ``s`` and the backward reduction for it.

        Running statistics stay exact: the BatchNorm's ``running_mean`` now
        averages ``conv(x, W) + b``, i.e. the centred layer's running mean
        minus ``d``, the running average of ``s`` with the BatchNorm's own
        momentum (or cumulative average), which the layer keeps in the buffer
        ``absorbed_offset`` (one ``S``-vector update per training forward).
        Whenever the BatchNorm uses its running statistics (eval mode, or a
        BatchNorm frozen in eval mode while the layer trains) the layer adds
        ``s - d`` (with the centred layer's weight gradient), so the
        BatchNorm's output is the centred layer's. :func:`export_model` moves
        ``s - d`` into the BatchNorm's ``running_mean`` instead of a bias, so
        the exported layer keeps the original's keys (a bias-free conv stays
        bias-free).

        Only call this when ``batchnorm`` is the *only* consumer of the
        layer's output, called once per call of the layer (the BatchNorm's
        ``num_features`` must equal the layer's output features; a linear
        layer needs ``(B, in_features)`` inputs). ``parent``: the module that
        holds ``batchnorm`` as a child (what :func:`convert_model` passes);
        the layer then looks the BatchNorm up there at every forward, so
        replacing it later (``nn.SyncBatchNorm.convert_sync_batchnorm``) keeps
        the pairing. If what sits there is no longer a BatchNorm, or without
        ``parent`` the BatchNorm is replaced, the layer adds ``s - d`` always:
        exact for a replacement that keeps the running statistics and uses
        them (a frozen BatchNorm), wrong for one that normalises with batch
        statistics (keep ``parent`` for that). Switching on starts with
        ``d = 0``; switching off adds ``d`` to the BatchNorm's
        ``running_mean`` (or, with no BatchNorm there, subtracts it from the
        bias or ``bias_correction``): both leave the model's function
        unchanged. The references are plain attributes (not submodules): not
        in this layer's ``state_dict``; ``copy.deepcopy`` / pickling of a whole
        model keep the pairing (of the layer alone: with a copy of ``parent``).
        """
        name = None
        if batchnorm is not None:
            if not isinstance(batchnorm, _BatchNorm):
                raise TypeError(
                    f"{self._describe()}: absorb_centring expects a BatchNorm module, but got "
                    f"{type(batchnorm).__name__}"
                )
            out_features = self.weight.shape[0]
            if batchnorm.num_features != out_features:
                raise ValueError(
                    f"{self._describe()}: absorb_centring needs a BatchNorm over the layer's {out_features} output "
                    f"features, but got num_features={batchnorm.num_features}"
                )
            if parent is not None:
                names = [n for n, m in parent._modules.items() if m is batchnorm]
                if len(names) != 1:
                    raise ValueError(
                        f"{self._describe()}: absorb_centring: parent must hold the BatchNorm as exactly one child, "
                        f"but it holds it {len(names)} times"
                    )
                name = names[0]
        if self._centring_ref is not None:
            d = self._buffers.pop("absorbed_offset")
            old = self._absorbing_bn()
            if old is not None and old.running_mean is not None:
                old.running_mean.add_(d.to(old.running_mean.dtype))
            else:  # nothing to hand d to: keep the function through the bias compensation
                self.bias_correction = self.bias_correction - d.to(self.bias_correction.dtype)
            object.__setattr__(self, "_centring_ref", None)
        if batchnorm is not None:
            self.register_buffer(
                "absorbed_offset",
                torch.zeros(self.weight.shape[0], device=self.weight.device, dtype=self.running_mean.dtype),
            )
            object.__setattr__(self, "_centring_ref", (None, batchnorm) if parent is None else (parent, name))

    def _batchnorm_absorbing_now(self) -> Optional[_BatchNorm]:
        """The absorbing BatchNorm if it normalises this forward with batch statistics (it removes the offset)."""
        if self._centring_ref is None:
            return None
        bn = self._absorbing_bn()
        if bn is not None and (bn.training or (bn.running_mean is None and bn.running_var is None)):
            return bn
        return None

    def _skipped_offset(self, weight: Tensor) -> Tensor:
        """``s = c - sum_k W_k mu``: the offset the absorbed layer leaves out (its bias stays in the output)."""
        return self._offset(weight, self.running_mean, self.bias_correction)

    def _track_absorbed_offset(self, weight: Tensor, bn: _BatchNorm, state: Dict[str, Tensor]) -> None:
        """``d <- (1 - f) d + f s`` with the BatchNorm's factor ``f``, when it updates its running mean now.

        On the per-batch path: two small ops (``addmv``, ``lerp_``) on detached tensors, no ``no_grad`` context.
        """
        if not (bn.training and bn.track_running_stats and bn.running_mean is not None):
            return
        d = self._buffers["absorbed_offset"]
        if bn.momentum is None:  # cumulative average: f = 1 / num_batches_tracked after the BatchNorm's increment
            if bn.num_batches_tracked is None:
                return
            factor: Union[float, Tensor] = (bn.num_batches_tracked.to(device=d.device, dtype=d.dtype) + 1).reciprocal()
        else:
            factor = bn.momentum
        w = weight.detach()
        if w.dtype != d.dtype:
            w = w.to(d.dtype)
        if _autocast_enabled(d.device.type):  # CUDA's autocast would run addmv in bf16/fp16: keep BatchNorm's dtype
            with torch.autocast(device_type=d.device.type, enabled=False):
                s = self._offset(w, state["running_mean"], state["bias_correction"])
        else:
            s = self._offset(w, state["running_mean"], state["bias_correction"])
        d.lerp_(s, factor)  # d <- (1 - f) d + f s, s = c - W mu

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "absorbed_offset"
        if self._centring_ref is not None and key not in state_dict:
            # A checkpoint of the centred layer: its BatchNorm's running mean is the centred one, i.e. d = 0.
            state_dict = dict(state_dict)
            state_dict[key] = torch.zeros_like(self._buffers["absorbed_offset"])
        key = prefix + "bias_correction"
        version = local_metadata.get("version", None)
        if self.bias is not None and key not in state_dict and (version is None or version < 2):
            # Version 1 added a layer's bias compensation to its bias parameter: nothing to compensate apart.
            state_dict = dict(state_dict)
            state_dict[key] = torch.zeros_like(self.bias_correction)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _weight_for_forward(self, state: Dict[str, Tensor]) -> Tensor:
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            # The backward uses the Q_s in force now, even if a fold follows: a fold replaces the buffer, it never
            # writes into it.
            if self.features == "patches":  # Q acts on the flattened C k^2 axis
                w = grad_transformed(w.flatten(1), state["grad_transform"]).view_as(w)
            else:
                w = grad_transformed(w, state["grad_transform"])
        return w

    def _capture_fold_inputs(self) -> None:
        # The fold at the end of the model's forward compensates with the weight of this forward: under a sharded
        # wrapper (FSDP) the full weight exists only now. Its taps summed, float64: all the fold needs.
        w = self._weight_matrix(self.weight.detach())
        if w.dim() == 2:
            self._fold_weight = w.to(torch.float64)
        else:  # one reduction, accumulated and returned in float64
            self._fold_weight = w.sum(tuple(range(2, w.dim())), dtype=torch.float64)

    def _full_weight(self) -> Tensor:
        w = self.weight.detach()
        return w.full_tensor() if hasattr(w, "full_tensor") else w  # a DTensor (FSDP2) outside the forward

    @torch.no_grad()
    def _on_mean_change(self, delta: Tensor) -> None:
        # ERRATA 8 (docs/PAPER.md): c(i) = c(i-) + sum W (mu(i) - mu(i-1)) keeps z unchanged. A new tensor, never
        # written in place: a forward still to be recomputed (activation checkpointing) holds the old one.
        w, self._fold_weight = self._fold_weight, None
        if w is None:
            w = self._weight_matrix(self._full_weight()).to(torch.float64)
        comp = F_w.weight_mean_product(w, delta)
        self.bias_correction = self.bias_correction + comp.to(self.bias_correction.dtype)

    def extra_repr(self) -> str:
        rest = self._whitening_repr()
        if self.features != "channels":
            rest = (rest + ", " if rest else "") + f"features={self.features!r}"
        if self._centring_ref is not None:
            rest = (rest + ", " if rest else "") + "centring=absorbed"
        return super().extra_repr() + (f", {rest}" if rest else "")


class GradWhitenConv2d(_GradWhitenMixin, nn.Conv2d):
    """Drop-in ``nn.Conv2d`` with gradient-based feature whitening (paper section 3).

    Forward: ``z = conv(pad0(x) - mu, W) + b`` (centred after zero padding;
    statistics are those of ``x`` before padding). Backward: the weight
    gradient is right-multiplied by ``Q_s`` on the input-channel axis, per
    kernel tap; the bias gradient is untouched. When a fold changes ``mu``
    the bias (or, for ``bias=False``, the non-trainable ``bias_correction``
    buffer) is compensated so the layer's function is unchanged.

    Centring: ``layer.centring`` is ``"input"`` (the default: the layer
    centres as above) or, after ``layer.absorb_centring(bn)``, ``"absorbed"``:
    the output feeds the BatchNorm ``bn`` and nothing else, and the layer
    skips the centring offset while ``bn`` normalises with batch statistics
    (see :meth:`absorb_centring`; :func:`~whitenlayers.convert_model` does
    this where it can tell). ``extra_repr`` shows ``centring=absorbed``.

    ``groups=G`` whitens per group (block-diagonal ``T`` and ``Q_s`` stored as
    ``(G, k, k)``; depthwise is a per-channel gain; see the module docstring).

    Constructor arguments are those of ``nn.Conv2d``, plus the keyword-only
    whitening arguments ``block_size``, ``alpha`` (0.9), ``beta`` (0.95),
    ``eps`` (1e-5), ``gmax`` (10), ``gains`` (``"practical"`` or ``"zca"``) and
    ``stats_fraction`` (1.0: all samples; a fraction uses that leading part of
    each batch for the statistics).

    Example:
        >>> import torch, whitenlayers as wl
        >>> conv = wl.GradWhitenConv2d(8, 16, 3, padding=1, bias=False, block_size=2)
        >>> x = torch.randn(4, 8, 10, 10) + 3
        >>> _ = conv(x); _ = conv(x)      # two training forwards: one block
        >>> int(conv.num_blocks)
        1
        >>> conv.eval()(x).shape
        torch.Size([4, 16, 10, 10])
    """

    if TYPE_CHECKING:  # pragma: no cover
        # nn.Conv2d stores pairs (its annotations are those of every dimension).
        kernel_size: Tuple[int, int]
        stride: Tuple[int, int]
        padding: Union[str, Tuple[int, int]]
        dilation: Tuple[int, int]

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_2_t,
        stride: _size_2_t = 1,
        padding: Union[str, _size_2_t] = 0,
        dilation: _size_2_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        features: str = "channels",
        **whitening: Any,
    ) -> None:
        self._init_conv(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                        device, dtype, config, process_group, whitening, features)

    def _init_conv(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                   device, dtype, config, process_group, whitening, features="channels") -> None:
        nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                           padding_mode, device, dtype)
        num_features = in_channels
        if features not in FEATURES:
            raise ValueError(f"{type(self).__name__}: features must be one of {FEATURES}, "
                             f"but got features={features!r}")
        if features == "patches":
            if groups != 1 or padding_mode != "zeros":
                raise ValueError(f"{type(self).__name__}: features='patches' needs groups=1 and padding_mode='zeros', "
                                 f"but got groups={groups}, padding_mode={padding_mode!r}")
            self._patch_padding = patch_padding(self.kernel_size, self.dilation, self.padding)
            num_features = in_channels * self.kernel_size[0] * self.kernel_size[1]
            self.features = features
        self._init_grad_whitening(num_features, out_channels, config, whitening, process_group, device, dtype,
                                  groups=groups)

    def _stats_input(self, x: Tensor) -> Tensor:
        """The batch's features on dim 1: ``x`` itself, or its unfolded patches ``(B, C k^2, L)``."""
        if self.features == "patches":
            return unfold_patches(x, self.kernel_size, self.dilation, self._patch_padding, self.stride)
        return x

    def forward(self, x: Tensor) -> Tensor:
        _check_input(self, x, dim=-3, ndims=(3, 4), what="an input of shape (B, C, H, W) or (C, H, W)")
        training, state = self._forward_state()
        if training:
            self._accumulate(self._stats_input(x if x.dim() == 4 else x.unsqueeze(0)))
        w = self._weight_for_forward(state)
        bn = self._batchnorm_absorbing_now()
        if bn is not None:
            # Centring absorbed by the following BatchNorm (absorb_centring): no offset, no pass over the output.
            self._track_absorbed_offset(w, bn, state)
            out = self._conv_forward(x, w, self.bias)
        elif self.bias is None and self.training and w.requires_grad and torch.is_grad_enabled():
            # Training a bias-free conv (the ResNet case): the centring term -W mu is added to the convolution's
            # fresh output in place instead of being passed to it as a bias: the CPU convolution backward
            # computes a bias gradient several times slower than autograd's one reduction for this add
            # (benchmarks/ablation.py, row "conv bias"). The two differ only by rounding; at conversion time
            # the term is exactly 0.
            out = self._conv_forward(x, w, None).add_(self._layer_bias(w, state).view(-1, 1, 1))
        else:  # the plain conv's own bias path: bit-identical to export_model's plain conv
            out = self._conv_forward(x, w, self._layer_bias(w, state))
        if training:
            self._end_batch()
        return out

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, **kwargs: Any) -> "GradWhitenConv2d":
        """A whitening conv computing the same function as ``conv``, sharing its Parameter objects.

        Weight and bias are the same ``nn.Parameter`` objects (an optimizer
        built on ``conv`` keeps working), so device, dtype and
        ``requires_grad`` carry over; so does the training flag.
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"{cls.__name__}.from_conv expects an nn.Conv2d, but got {type(conv).__name__}")
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
            device=conv.weight.device, dtype=conv.weight.dtype, **kwargs,
        )
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new

    def to_conv(self) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` with identical outputs (``mu`` folded into the bias); new Parameters."""
        conv = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, stride=self.stride, padding=self.padding,
            dilation=self.dilation, groups=self.groups, bias=True, padding_mode=self.padding_mode,
            device=self.weight.device, dtype=self.weight.dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            assert conv.bias is not None  # bias=True
            conv.bias.copy_(self._layer_bias(self.weight))
        conv.weight.requires_grad_(self.weight.requires_grad)
        conv.train(self.training)
        return conv


# nn.Linear's stubs declare ``bias: Parameter``, though it is None for bias=False (as _GradWhitenMixin declares).
class GradWhitenLinear(_GradWhitenMixin, nn.Linear):  # type: ignore[misc]
    """Drop-in ``nn.Linear`` with gradient-based feature whitening (paper section 3).

    ``z = (x - mu) W^T + b`` computed as ``x W^T + (b - W mu)``; the weight
    gradient is right-multiplied by ``Q_s``. Inputs ``(*, in_features)``;
    statistics over all leading dimensions. Whitening keyword arguments as for
    :class:`GradWhitenConv2d`; the centring can be absorbed by a following
    ``BatchNorm1d`` (:meth:`absorb_centring`, ``(B, in_features)`` inputs).
    """

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_linear(in_features, out_features, bias, device, dtype, config, process_group, whitening)

    def _init_linear(self, in_features, out_features, bias, device, dtype, config, process_group, whitening) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias, device, dtype)
        self._init_grad_whitening(in_features, out_features, config, whitening, process_group, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        _check_input(self, x, dim=-1, ndims=tuple(range(1, 9)), what="an input of shape (*, in_features)")
        bn = self._batchnorm_absorbing_now()  # centring absorbed by the following BatchNorm1d (absorb_centring)
        if bn is not None and x.dim() != 2:
            raise ValueError(
                f"{self._describe()}: with its centring absorbed by a BatchNorm the layer needs an input of shape "
                f"(B, in_features), but got input of shape {tuple(x.shape)}"
            )
        training, state = self._forward_state()
        if training:
            self._accumulate(x.reshape(-1, self.num_features))
        w = self._weight_for_forward(state)
        if bn is not None:
            self._track_absorbed_offset(w, bn, state)
            out = nn.functional.linear(x, w, self.bias)
        else:
            out = nn.functional.linear(x, w, self._layer_bias(w, state))
        if training:
            self._end_batch()
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> "GradWhitenLinear":
        """A whitening linear layer computing the same function, sharing ``linear``'s Parameter objects."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear expects an nn.Linear, but got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with identical outputs (``mu`` folded into the bias); new Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, bias=True, device=self.weight.device,
                        dtype=self.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
            lin.bias.copy_(self._layer_bias(self.weight))
        lin.weight.requires_grad_(self.weight.requires_grad)
        lin.train(self.training)
        return lin


class RecursiveWhitenConv2d(GradWhitenConv2d):
    """:class:`GradWhitenConv2d` with the recursive transform update (paper section 4).

    At each fold a high-power direction ``v_e`` of ``Phi_y`` (the covariance of
    the whitened features) is found by column alignment, its power is reduced
    to ``delta * mean(phi_x)`` by a rank-one step, and a leakage ``gamma``
    pulls ``T`` toward ``I``. Building ``T(i)`` and ``Q(i)`` costs ``O(M^2)``.
    Tracking ``Phi_y`` as ``alpha Phi_y + (1-alpha) T(i-1) C_block T(i-1)^T``
    costs two ``M x M`` matrix products per fold (``O(M^3)``, once per block,
    never per batch). Extra buffers: ``running_cov_whitened`` (``Phi_y``),
    ``running_power`` (``phi_x,m``, uncentred) and ``whitening_gram``
    (unsmoothed ``Q``).

    Defaults are the paper's: ``alpha=0.1, beta=0.1, gamma=0.99, delta=0.25,
    c_rel=0.025, c_abs=1e-6, eps=1e-5``. When the found direction already
    holds less power than the target (``g_e > 1``) the gain is clamped to 1
    (ERRATA 6): no amplification, only the leakage acts; counted in
    ``clamped_steps``.
    """

    _CONFIG = RecursiveConfig

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_2_t,
        stride: _size_2_t = 1,
        padding: Union[str, _size_2_t] = 0,
        dilation: _size_2_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        features: str = "channels",
        **whitening: Any,
    ) -> None:
        self._init_conv(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
                        device, dtype, config, process_group, whitening, features)


class RecursiveWhitenLinear(GradWhitenLinear):
    """:class:`GradWhitenLinear` with the recursive transform update; see :class:`RecursiveWhitenConv2d`."""

    _CONFIG = RecursiveConfig

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_linear(in_features, out_features, bias, device, dtype, config, process_group, whitening)


class _GradWhitenConvNd(_GradWhitenMixin):
    """Grad/recursive whitening for ``nn.Conv1d`` / ``nn.Conv3d``: :class:`GradWhitenConv2d`'s forward, any dimension.

    Subclasses put the plain conv class second in their bases and set ``_PLAIN``.
    """

    _PLAIN: Type[nn.Module] = nn.Conv1d

    if TYPE_CHECKING:  # pragma: no cover
        # Provided by the plain conv class (``_PLAIN``) a subclass combines this mixin with.
        in_channels: int
        out_channels: int
        kernel_size: Tuple[int, ...]
        stride: Tuple[int, ...]
        padding: Union[str, Tuple[int, ...]]
        dilation: Tuple[int, ...]
        padding_mode: Literal["zeros", "reflect", "replicate", "circular"]

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def _conv_forward(self, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor: ...

    def _init_convnd(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                     padding_mode, device, dtype, config, process_group, whitening) -> None:
        self._PLAIN.__init__(cast(nn.Module, self), in_channels, out_channels, kernel_size, stride, padding, dilation,
                             groups, bias, padding_mode, device, dtype)
        self._init_grad_whitening(in_channels, out_channels, config, whitening, process_group, device, dtype,
                                  groups=groups)

    def forward(self, x: Tensor) -> Tensor:
        nd = len(self.kernel_size)
        spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[nd]
        _check_input(self, x, dim=-(nd + 1), ndims=(nd + 1, nd + 2),
                     what=f"an input of shape (B, C, {spatial}) or (C, {spatial})")
        training, state = self._forward_state()
        if training:
            self._accumulate(x if x.dim() == nd + 2 else x.unsqueeze(0))
        w = self._weight_for_forward(state)
        bn = self._batchnorm_absorbing_now()
        if bn is not None:  # as GradWhitenConv2d: centring absorbed by the following BatchNorm
            self._track_absorbed_offset(w, bn, state)
            out = self._conv_forward(x, w, self.bias)
        elif self.bias is None and self.training and w.requires_grad and torch.is_grad_enabled():
            # As GradWhitenConv2d: the centring term added to the fresh output (faster than a conv bias on the CPU).
            out = self._conv_forward(x, w, None).add_(self._layer_bias(w, state).view((-1,) + (1,) * nd))
        else:
            out = self._conv_forward(x, w, self._layer_bias(w, state))
        if training:
            self._end_batch()
        return out

    @classmethod
    def from_conv(cls, conv: nn.Module, **kwargs: Any) -> "_GradWhitenConvNd":
        """A whitening conv computing the same function as ``conv``, sharing its Parameter objects (as
        :meth:`GradWhitenConv2d.from_conv`)."""
        if not isinstance(conv, cls._PLAIN):
            raise TypeError(f"{cls.__name__}.from_conv expects an nn.{cls._PLAIN.__name__}, "
                            f"but got {type(conv).__name__}")
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
            device=conv.weight.device, dtype=conv.weight.dtype, **kwargs,
        )
        new.weight = cast(Tensor, conv.weight)
        new.bias = cast("Optional[Tensor]", conv.bias)
        new.train(conv.training)
        return new

    def to_conv(self) -> nn.Module:
        """A plain conv of the same dimension with identical outputs (``mu`` folded into the bias); new Parameters."""
        conv = cast("_ConvNd", self._PLAIN(
            self.in_channels, self.out_channels, self.kernel_size, stride=self.stride, padding=self.padding,
            dilation=self.dilation, groups=self.groups, bias=True, padding_mode=self.padding_mode,
            device=self.weight.device, dtype=self.weight.dtype,
        ))
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            assert conv.bias is not None  # bias=True
            conv.bias.copy_(self._layer_bias(self.weight))
        conv.weight.requires_grad_(self.weight.requires_grad)
        conv.train(self.training)
        return conv


class GradWhitenConv1d(_GradWhitenConvNd, nn.Conv1d):
    """Drop-in ``nn.Conv1d`` with gradient-based feature whitening: :class:`GradWhitenConv2d` for ``(B, C, L)``.

    ``z = conv(pad0(x) - mu, W) + b``, weight gradient times ``Q_s`` per kernel
    tap, ``groups`` supported (block-diagonal whitening), same whitening
    keyword arguments, :meth:`from_conv` / :meth:`to_conv`.

    Example:
        >>> import torch, whitenlayers as wl
        >>> conv = wl.GradWhitenConv1d(4, 8, 5, padding=2, block_size=2)
        >>> _ = conv(torch.randn(3, 4, 50)); _ = conv(torch.randn(3, 4, 50))
        >>> int(conv.num_blocks), tuple(conv.grad_transform.shape)
        (1, (4, 4))
    """

    _PLAIN = nn.Conv1d

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_1_t,
        stride: _size_1_t = 1,
        padding: Union[str, _size_1_t] = 0,
        dilation: _size_1_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


class GradWhitenConv3d(_GradWhitenConvNd, nn.Conv3d):
    """Drop-in ``nn.Conv3d`` with gradient-based feature whitening: :class:`GradWhitenConv2d` for
    ``(B, C, D, H, W)``."""

    _PLAIN = nn.Conv3d

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_3_t,
        stride: _size_3_t = 1,
        padding: Union[str, _size_3_t] = 0,
        dilation: _size_3_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


class RecursiveWhitenConv1d(GradWhitenConv1d):
    """:class:`GradWhitenConv1d` with the recursive transform update; see :class:`RecursiveWhitenConv2d`."""

    _CONFIG = RecursiveConfig

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_1_t,
        stride: _size_1_t = 1,
        padding: Union[str, _size_1_t] = 0,
        dilation: _size_1_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


class RecursiveWhitenConv3d(GradWhitenConv3d):
    """:class:`GradWhitenConv3d` with the recursive transform update; see :class:`RecursiveWhitenConv2d`."""

    _CONFIG = RecursiveConfig

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_3_t,
        stride: _size_3_t = 1,
        padding: Union[str, _size_3_t] = 0,
        dilation: _size_3_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


#: Every grad / recursive whitening layer class (conv of any dimension and linear).
GRAD_LAYER_TYPES = (GradWhitenConv1d, GradWhitenConv2d, GradWhitenConv3d, GradWhitenLinear)
