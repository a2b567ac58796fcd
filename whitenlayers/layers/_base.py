"""What every grad / recursive layer shares (:class:`_GradWhitenMixin`: centring, bias compensation, the
gradient transform, absorbed centring) and the input checks of all layers. Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from .. import functional as F_w
from .._rebuild import conv_like, share_parameters
from ..autograd import _transforms_active as _func_transforms_active
from ..autograd import grad_transformed, shared_weight_grad_apply
from ..config import EVDConfig, WhiteningConfig
from ..fold import _autocast_enabled
from ..rules import rule_and_config
from ..stats import WhiteningLayer, _is_compiling, recomputing

if TYPE_CHECKING:  # pragma: no cover
    pass

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


def _weight_once(forward: Callable[[Any, Tensor], Tensor]) -> Callable[[Any, Tensor], Tensor]:
    """Decorate a layer's ``forward``: a parametrized weight (``torch.nn.utils.parametrize``, e.g.
    ``parametrizations.weight_norm`` / ``spectral_norm``) is computed once per forward, as the plain layer computes
    it, not at each of the forward's reads of ``self.weight`` (input check, gradient transform, centring, fold)."""

    @functools.wraps(forward)
    def wrapper(self: Any, x: Tensor) -> Tensor:
        if "parametrizations" in self._modules and not _is_compiling():
            with parametrize.cached():
                return forward(self, x)
        return forward(self, x)

    return wrapper


def _onnx_exporting() -> bool:
    """``torch.onnx.is_in_onnx_export()``, asked only while tracing (its exporters trace: the TorchScript one with
    ``torch.jit``, the dynamo one through ``torch.export``): on the per-batch path it costs more than the check."""
    return (torch.jit.is_tracing() or _is_compiling()) and torch.onnx.is_in_onnx_export()


_is_func_wrapped: Callable[[Tensor], bool] = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                                                   lambda t: False)
_jit_tracing: Callable[[], bool] = torch._C._is_tracing


def _cacheable(t: Tensor) -> bool:
    """Whether a value made from ``t`` may be kept across forwards: not while ``torch.jit.trace`` records (a cache
    filled by its first run would make its check run's graph differ), not for a ``torch.func`` wrapper (it dies
    with its transform), not an inference tensor."""
    return not (torch.is_inference_mode_enabled() or _jit_tracing() or _is_func_wrapped(t))


_FUNC_WHAT_TO_DO = (
    "Call the model in eval mode (model.eval(): the transform in force, nothing updated), or in training mode "
    "inside `with wl.frozen(model):` (the layers whiten and transform the weight gradient without updating their "
    "state); a BatchNorm in training mode then needs no running statistics, "
    "torch.func.replace_all_batch_norm_modules_(model), as for any model under torch.func."
)


def _check_gathering_untransformed(layer: WhiteningLayer) -> None:
    """A training forward that gathers statistics (not :attr:`~WhiteningLayer.frozen`) refuses to run inside a
    ``torch.func`` transform, before it changes any state."""
    if not _is_compiling() and _func_transforms_active() and not layer.frozen:
        raise RuntimeError(
            f"{layer._describe()}: a training-mode forward inside a torch.func transform (vmap, grad, jacrev, ...) "
            "is not supported: the layer adds the batch to its block statistics and folds them into its buffers in "
            "place, and a transformed (batched or gradient-tracking) tensor cannot be written into the layer's "
            "state. " + _FUNC_WHAT_TO_DO
        )


def _check_not_tracing_function(layer: WhiteningLayer, what: str) -> None:
    """``torch.jit.trace`` with autograd on would record the layer's autograd Function (``what``): refused (the
    TorchScript-based ONNX exporter, which also traces with autograd on, inlines the Function: allowed)."""
    if not _is_compiling() and _jit_tracing() and not torch.onnx.is_in_onnx_export():
        raise RuntimeError(
            f"{layer._describe()}: torch.jit.trace with autograd enabled records the layer's autograd Function "
            f"({what}) as a Python op, whose graph differs between the trace and its check (\"Graphs differed "
            "across invocations!\"). Trace in eval mode under torch.no_grad(): `with torch.no_grad(): "
            "traced = torch.jit.trace(model.eval(), example_inputs)`, or trace the plain model, "
            "wl.to_plain_model(copy.deepcopy(model)).eval()"
        )


def _check_input(layer: WhiteningLayer, x: Tensor, *, dim: int, ndims: tuple, what: str) -> None:
    if not isinstance(x, Tensor):
        if isinstance(x, torch.fx.Proxy):
            raise TypeError(
                f"{layer._describe()}: torch.fx symbolic tracing (FX graph mode quantization such as prepare_qat_fx "
                "or prepare_fx, torch.fx passes) cannot trace a whitening layer: its forward gathers statistics and "
                "folds them in Python. Quantize or transform the plain model after training, "
                "wl.to_plain_model(copy.deepcopy(model)); to trace the converted model as it is, keep its layers as "
                "leaves (a torch.fx.Tracer whose is_leaf_module is True for wl.WhiteningLayer and "
                "wl.DirectWhitenWrapper)"
            )
        raise TypeError(f"{layer._describe()}: expected a Tensor input, but got {type(x).__name__}")
    if not x.is_floating_point():
        if x.is_quantized:
            raise TypeError(
                f"{layer._describe()}: expected a floating-point input, but got a quantized one (dtype={x.dtype}): "
                "a whitening layer has no quantized form, and eager quantization's convert leaves it in float. "
                "Quantize the plain model after training, wl.to_plain_model(copy.deepcopy(model)), or dequantize "
                "before the layer (torch.ao.quantization.DeQuantStub) and quantize after it (QuantStub)"
            )
        raise TypeError(f"{layer._describe()}: expected a floating-point input, but got dtype={x.dtype}")
    params = cast(Any, layer)._parameters
    weight = params["weight"] if "weight" in params else getattr(layer, "weight", None)
    if isinstance(weight, Tensor) and x.dtype != weight.dtype and not _autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer._describe()}: expected an input of dtype {weight.dtype} (the dtype of the layer's weight), "
            f"but got dtype={x.dtype}"
        )
    if x.dim() not in ndims:
        raise ValueError(f"{layer._describe()}: expected {what}, but got input of shape {tuple(x.shape)}")
    expected = getattr(layer, "in_channels", layer.num_features)  # a patch layer has C k^2 features of C channels
    if x.shape[dim] != expected:
        unit = "channels" if getattr(layer, "features", "channels") == "patches" else "features"
        raise ValueError(
            f"{layer._describe()}: expected {expected} input {unit} on dim {dim % x.dim()}, but got {x.shape[dim]} "
            f"(input shape {tuple(x.shape)})"
        )


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _bias_of(module: Any) -> Optional[Tensor]:
    """``module.bias`` (a Parameter or ``None``), from ``_parameters`` where it is registered there: without
    ``Module.__getattr__``'s lookups, on a planned forward."""
    params = module._parameters
    return params["bias"] if "bias" in params else module.bias


def plannable_forward(module: nn.Module) -> bool:
    """Whether the forward of ``module`` (a converted model) about to run may plan its layers' steps
    (:func:`share_weight_transforms`): a recorded backward outside the torch.func transforms, ``torch.jit`` traces
    and ``inference_mode``, not a ``DataParallel`` replica (which shares its layers' state with the module it
    copies)."""
    return not (not torch.is_grad_enabled() or _func_transforms_active() or _jit_tracing()
                or torch.is_inference_mode_enabled() or module.__dict__.get("_is_replica"))


#: Under ``torch.distributed`` the grad / recursive weights go through a shared node in runs of this many layers
#: (consecutive in the model's order), not one node for all: DDP all-reduces a bucket of gradients once every
#: gradient in it is ready, so a run holds its layers' gradients only until its last layer's backward (a few
#: layers' time, against a node per layer's Python call each way per layer). 1: a node per layer.
DISTRIBUTED_RUN = 4


def share_weight_transforms(layers: Sequence[Any], module: nn.Module, checked: bool = False,
                            share: Optional[bool] = None) -> bool:
    """Before a converted model's forward (its fold coordinator's pre-hook): plan the steps of its grad / recursive
    layers (:meth:`_GradWhitenMixin._step_plan`) and, with ``share`` (default), put their weights through
    :class:`~whitenlayers.autograd.SharedWeightGradTransform` nodes instead of one ``WeightGradTransform`` per
    layer, giving each layer its weight's view for this forward (consumed by ``_weight_for_forward`` when it is the
    weight and ``Q_s`` of the layer's forward): in one process one node for all of them (one Python call per
    forward and per backward), under ``torch.distributed`` one per run of :data:`DISTRIBUTED_RUN` layers (DDP
    all-reduces a layer's gradient while the backward runs; one node would hold them all until its end). Returns
    whether it left views or plans on the layers.

    Only in a :func:`plannable_forward`, and for the layers whose weight is a plain Parameter that needs a gradient
    (not parametrized, channel features), of its full shape under ``torch.distributed`` (a weight sharded by FSDP
    when the model's forward starts is left to the full path). Not shared, planned with their own weight path:
    deferred layers (``defer_grad_transform``: their hooks), a run of one. Everything else keeps the per-layer
    path: a layer called twice (its second call), a forward recomputed by activation checkpointing, a compiled
    graph. Views and plans left unused by the forward are dropped at its end (:meth:`FoldCoordinator.__call__`).
    ``checked``: the caller found the forward :func:`plannable_forward`."""
    if not checked and not plannable_forward(module):
        return False
    distributed = _distributed()
    if share is None:
        share = True
    chosen, weights, states, alone = [], [], [], []
    for layer in layers:
        if not isinstance(layer, _GradWhitenMixin):
            continue
        w = layer._parameters.get("weight")
        if (type(w) is not nn.Parameter or not w.requires_grad or layer.features != "channels"
                or "parametrizations" in layer._modules  # (FSDP's flat weights are no Parameter)
                or (distributed and tuple(w.shape) != layer._full_weight_shape())):
            continue
        if share and "_deferred_grad" not in layer.__dict__:
            chosen.append(layer)
            weights.append(w)
            states.append(layer._forward_snapshot())
        else:
            alone.append(layer)
    run = DISTRIBUTED_RUN if distributed else max(1, len(chosen))
    if run < 2 or len(chosen) < 2:  # nothing to share: planned on their own
        alone += chosen
        chosen, weights, states = [], [], []
    if not chosen and not alone:
        return False
    coordinator = (chosen or alone)[0]._fold_coordinator
    sink = None if coordinator is None else coordinator.stats_sink()
    planned = sink is not None and not recomputing()  # (reentrant checkpointing recomputes the model: full paths)
    if chosen:
        qs = tuple(state["grad_transform"] for state in states)
        views: Tuple[Tensor, ...] = ()
        for start in range(0, len(chosen), run):  # (a run of one: its own node of one weight)
            views += tuple(shared_weight_grad_apply(qs[start:start + run], *weights[start:start + run]))
        for layer, view, w, q, state in zip(chosen, views, weights, qs, states):
            attrs = layer.__dict__
            plan = layer._step_plan(view, state, sink) if planned and layer._fold_coordinator is coordinator else None
            if plan is not None:
                attrs["_planned"] = plan  # (it holds the view: a forward that refuses the plan takes it from there)
            else:
                attrs["_shared_weight"] = (view, w, q)
    if planned:
        for layer in alone:
            if layer._fold_coordinator is coordinator:
                plan = layer._step_plan(None, layer._forward_snapshot(), sink)
                if plan is not None:
                    layer.__dict__["_planned"] = plan
    return True


class _GradWhitenMixin(WhiteningLayer):
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
    _ZEROED_ON_RESET = ("bias_correction", "absorbed_offset")

    if TYPE_CHECKING:  # pragma: no cover
        bias_correction: Tensor  # the buffer :meth:`_init_grad_whitening` registers
        # the convolution of the conv subclasses (nn.Conv1d / 2d / 3d's), for the planned conv forward
        _conv_forward: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]

    def _init_grad_whitening(self, num_features: int, out_features: int, config: Optional[WhiteningConfig],
                             whitening: Dict[str, Any], process_group: Any, device, dtype, groups: int = 1) -> None:
        rule, cfg = rule_and_config(self._CONFIG, type(self).__name__, config, whitening)
        self._init_whitening(num_features, cfg, grad_transform=True, process_group=process_group, device=device,
                             dtype=dtype, groups=groups, rule=rule)
        # The compensation ``c`` of mean updates (ERRATA 8): a buffer, never written into a parameter (a sharded
        # wrapper holds the full bias only during the forward, and autograd may hold it until the backward).
        self.register_buffer("bias_correction", torch.zeros(out_features, device=device, dtype=self.running_mean.dtype))

    def _mean_per_tap(self, mean: Tensor, dtype: torch.dtype, taps_last: bool = False) -> Tensor:
        """``mu`` repeated for every kernel tap, in ``dtype``: ``rows @ mu_k = sum_k W_k mu`` in one product for the
        weight's rows of :meth:`_weight_rows` (``taps_last``: their tap-major order, each tap's ``C`` channels
        together). Cached per mean tensor and version (a fold replaces the mean; an in-place write, e.g. DDP's
        buffer broadcast or ``load_state_dict``, bumps its version), so once per block on the hot path."""
        if _is_compiling():  # traced: computed in the graph (fused there), no cache to guard on
            return self._taps_of(mean, dtype, taps_last)
        cached = self._mean_taps
        if (cached is not None and cached[0] is mean and cached[1] == mean._version and cached[2] == dtype
                and cached[3] == taps_last):
            return cached[4]
        value = self._taps_of(mean, dtype, taps_last)
        if _cacheable(mean):
            self._mean_taps = (mean, mean._version, dtype, taps_last, value)
        return value

    def _taps_of(self, mean: Tensor, dtype: torch.dtype, taps_last: bool = False) -> Tensor:
        taps = 1 if self.features == "patches" else self.weight[0, 0].numel()  # a patch mean has one entry per tap
        if taps == 1:
            return mean.to(dtype)
        return mean.to(dtype).repeat(taps) if taps_last else mean.to(dtype).repeat_interleave(taps)

    @staticmethod
    def _weight_rows(weight: Tensor) -> Tuple[Tensor, bool]:
        """The weight as an ``(S, M k)`` matrix of rows without a copy where its layout allows: channel-major
        (``reshape``, a view of a contiguous weight) or, for a channels_last weight, tap-major (a view of its
        memory), with whether it is tap-major (:meth:`_mean_per_tap`'s ``taps_last``)."""
        if weight.dim() > 3 and not weight.is_contiguous():
            moved = weight.movedim(1, -1)  # (S, *kernel, C): contiguous for a channels_last weight
            if moved.is_contiguous():
                return moved.reshape(weight.shape[0], -1), True
        return weight.reshape(weight.shape[0], -1), False

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
        w2, taps_last = self._weight_rows(weight)
        mean_k = self._mean_per_tap(mean, weight.dtype, taps_last)
        if _onnx_exporting():  # the TorchScript-based exporter has no addmv
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
        BatchNorm's output is the centred layer's. :func:`to_plain_model` moves
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

        Args:
            batchnorm: the BatchNorm (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``) that alone consumes
                the layer's output, with ``num_features`` equal to its output features; ``None`` switches the
                absorption off (the layer centres its input again).
            parent: the module holding ``batchnorm`` as a child (default ``None``: keep a reference to
                ``batchnorm`` itself). Pass it whenever the BatchNorm may be replaced later.
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
            self._fold_compensation_into_offset()

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

        On the per-batch path: one in-place product-accumulate (``addmv_``) on the weight's rows as they lie in
        memory (:meth:`_weight_rows`: no copy of a channels_last weight), no ``no_grad`` and no autocast context
        (in-place ops are never autocast: BatchNorm's dtype is kept on every device).
        """
        if not (bn.training and bn.track_running_stats and bn.running_mean is not None):
            return
        if not _is_compiling() and _func_transforms_active():
            raise RuntimeError(
                f"{self._describe()}: its centring is absorbed by a BatchNorm in training mode, whose running mean "
                "it follows in place; a torch.func transform (vmap, grad, jacrev, ...) cannot update state in place "
                "(the BatchNorm itself fails there too). " + _FUNC_WHAT_TO_DO
            )
        d = self._buffers["absorbed_offset"]
        if bn.momentum is None:  # cumulative average: f = 1 / num_batches_tracked after the BatchNorm's increment
            if bn.num_batches_tracked is None:
                return
            factor: Union[float, Tensor] = (bn.num_batches_tracked.to(device=d.device, dtype=d.dtype) + 1).reciprocal()
        else:
            factor = bn.momentum
        if isinstance(factor, float) and self.groups == 1 and not _onnx_exporting():
            # c = 0 for an absorbed layer (it lives in d, _fold_compensation_into_offset): the update
            # d <- (1 - f) d + f (c - W mu) is one product-accumulate, on the weight's rows as sliced once
            w2, taps_last = self._absorbed_rows(weight, d.dtype)
            d.addmv_(w2, self._mean_per_tap(state["running_mean"], w2.dtype, taps_last), beta=1.0 - factor,
                     alpha=-factor)
            return
        w = weight.detach()
        if w.dtype != d.dtype:
            w = w.to(d.dtype)
        # CUDA's autocast would run the out-of-place addmv of the offset in bf16/fp16: keep BatchNorm's dtype.
        off = torch.autocast(device_type=d.device.type, enabled=False) if _autocast_enabled(d.device.type) else None
        with off or contextlib.nullcontext():
            d.lerp_(self._offset(w, state["running_mean"], state["bias_correction"]), factor)  # s = c - W mu

    _rows_cache: Optional[Tuple[Tensor, Tensor, bool]] = None

    def _absorbed_rows(self, weight: Tensor, dtype: torch.dtype) -> Tuple[Tensor, bool]:
        """:meth:`_weight_rows` of the detached weight in ``dtype``: for the weight Parameter itself, a view of it
        made once and kept while it is the layer's weight and still views its memory (the optimizer writes the
        weight in place; ``param.data = ...`` moves it), else made anew (a parametrized weight, another dtype)."""
        param = cast(Any, self)._parameters.get("weight")
        if param is not None and weight.dtype == dtype and not _is_compiling():
            cached = self._rows_cache
            if cached is not None and cached[0] is param and cached[1].data_ptr() == param.data_ptr():
                return cached[1], cached[2]
            rows, taps_last = self._weight_rows(param.detach())
            if not torch.is_inference_mode_enabled():  # never keep an inference tensor
                self.__dict__["_rows_cache"] = (param, rows, taps_last)
            return rows, taps_last
        w = weight.detach()
        return self._weight_rows(w if w.dtype == dtype else w.to(dtype))

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
        if self._centring_ref is not None:  # a checkpoint that kept c apart (earlier versions, a centred layer)
            self._fold_compensation_into_offset()

    def _weight_for_forward(self, state: Dict[str, Tensor]) -> Tensor:
        w = self.weight
        # Under a torch.func transform a weight with a forward-mode tangent (jvp, jacfwd) requires no grad: it takes
        # the Function too, whose jvp is its backward's adjoint (jacfwd equals jacrev).
        if torch.is_grad_enabled() and (w.requires_grad or _func_transforms_active()):
            shared = None if _is_compiling() else self.__dict__.pop("_shared_weight", None)
            if shared is not None and shared[1] is w and shared[2] is state["grad_transform"]:
                return shared[0]  # this weight's view from the model's shared transform (share_weight_transforms)
            deferred = self.__dict__.get("_deferred_grad")
            if deferred is not None and _is_compiling():  # the graph takes the Function below; the hook must go
                deferred.leave()
            # (torch.func's gradients never reach the weight's hook: the transform stays in their backward.)
            elif deferred is not None and not _func_transforms_active():
                # whitenlayers.defer_grad_transform: the weight itself (or a view of it), whose hook transforms the
                # gradient with this forward's Q_s (a recomputed forward reads its original forward's); None: not
                # the hooked weight, the Function below
                deferred_w = deferred(w, state["grad_transform"])
                if deferred_w is not None:
                    return deferred_w
            # The backward uses this forward's Q_s (its snapshot, _forward_state), even if a fold follows. In eval
            # mode too: the layer's gradient is the transformed one in either mode.
            _check_not_tracing_function(self, "the weight-gradient transform")
            if self.features == "patches":  # Q acts on the flattened C k^2 axis
                w = grad_transformed(w.flatten(1), state["grad_transform"]).view_as(w)
            else:
                w = grad_transformed(w, state["grad_transform"])
        return w

    # ------------------------------------------------------------ planned steps
    # A plan: what the layer's next training forward inside its converted model does, decided by the fold
    # coordinator's pre-hook for all layers at once (share_weight_transforms), so that the forward itself runs its
    # operations with few checks: (view, state, gather, end, sink, absorbed, payload, features, dtype): the weight's
    # view of the shared transform, the forward's buffers (_forward_state), the statistics and the count
    # (stats.step._step_counts), the coordinator's list for the batch, the centring (0 absorbed, the offset's update
    # one addmv_, payload: d, rows, mu per tap, beta, alpha; 1 absorbed, _track_absorbed_offset, payload: the
    # BatchNorm; 2 absorbed, no update: a BatchNorm that keeps no running mean; 3 centred by the layer), and what
    # the input check expects (_check_input: the input features, the weight's dtype). The same operations, in the
    # same order, as the full path; a forward that is not the one planned (grad mode off, eval mode, an unbatched
    # input, an input the check refuses, a second call) takes the full path.
    def _step_plan(self, view: Optional[Tensor], state: Dict[str, Tensor], sink: Optional[list]) -> Optional[tuple]:
        """This layer's plan for its next training forward (see above), or ``None``: the full path. ``view``: the
        weight's view of the shared transform, or ``None``: the layer's own weight path (``_weight_for_forward``)."""
        if not self.training or "_is_replica" in self.__dict__:  # (a DataParallel replica: stats._stats_sink)
            return None
        param = self._parameters["weight"]
        counts = self._step_counts(param.dim(), param.device)
        if counts is None:
            return None
        gather, end = counts
        features = getattr(self, "in_channels", self.num_features)
        ref = self._centring_ref
        if ref is None:
            return (view, state, gather, end, sink, 3, None, features, param.dtype)  # (one tuple made per plan)
        # The offset's update as the last forward planned it, while it is the same update: the same BatchNorm
        # (looked up again: it may have been replaced), still updating its running mean with the same momentum, the
        # same buffers of the forward, offset buffer and weight memory (_absorbed_rows' view).
        parent, bn = ref
        if parent is not None:
            bn = parent._modules.get(bn)
        cached = self.__dict__.get("_absorb_plan")
        if (cached is not None and cached[0] is bn and cached[1] is state and bn.training
                and bn._buffers.get("running_mean") is not None and bn.momentum == cached[2]
                and bn.track_running_stats and cached[3] is self._buffers.get("absorbed_offset")
                and cached[4] == param.data_ptr()):
            return (view, state, gather, end, sink, 0, cached[5], features, param.dtype)
        absorbed, payload = 3, None
        bn = self._batchnorm_absorbing_now()
        if bn is None:
            pass
        elif not (bn.training and bn.track_running_stats and bn.running_mean is not None):
            absorbed = 2
        else:
            d = self._buffers["absorbed_offset"]
            factor = bn.momentum
            if isinstance(factor, float) and self.groups == 1 and param.dtype == d.dtype:
                rows, taps_last = self._absorbed_rows(param, d.dtype)
                absorbed = 0
                payload = (d, rows, self._mean_per_tap(state["running_mean"], rows.dtype, taps_last),
                           1.0 - factor, -factor)
                self.__dict__["_absorb_plan"] = (bn, state, factor, d, param.data_ptr(), payload)
            else:
                absorbed, payload = 1, bn
        return (view, state, gather, end, sink, absorbed, payload, features, param.dtype)

    def _take_plan(self, x: Tensor, rank: int) -> Optional[tuple]:
        """This forward's plan (:meth:`_step_plan`) if it is the forward planned for: grad mode and training mode
        on, ``x`` of ``rank`` dimensions that :func:`_check_input` accepts (its checks in the order of their
        likelihood); the plan is dropped either way (a second call takes the full path, which checks the input)."""
        attrs = self.__dict__
        plan = attrs.pop("_planned", None)
        if plan is None:
            return None
        if (isinstance(x, Tensor) and x.dim() == rank and x.shape[1] == plan[7] and self.training
                and torch.is_grad_enabled()
                and (x.dtype == plan[8] or (x.is_floating_point() and _autocast_enabled(x.device.type)))):
            return plan
        if plan[0] is not None:  # the full path takes the weight's view of the shared transform, as unplanned
            attrs["_shared_weight"] = (plan[0], self._parameters["weight"], plan[1]["grad_transform"])
        return None

    def _run_plan(self, plan: tuple, x_stats: Tensor) -> Tensor:
        """A planned forward before the layer's operation: the buffers in force, the statistics, the weight (the
        shared transform's view, or the layer's own path), the offset's update. Returns the weight."""
        view, state, gather, _, sink, absorbed, payload = plan[:7]
        self.__dict__["_in_force"] = state
        if gather:
            self._planned_stats(x_stats, gather, sink)
        w = view if view is not None else self._weight_for_forward(state)
        if absorbed == 0:
            d, rows, mean_k, beta, alpha = payload
            d.addmv_(rows, mean_k, beta=beta, alpha=alpha)
        elif absorbed == 1:
            self._track_absorbed_offset(w, payload, state)
        return w

    def _full_weight_shape(self) -> Tuple[int, ...]:
        """The weight's shape as the layer's sizes give it (a sharded weight has another)."""
        if hasattr(self, "kernel_size"):
            conv = cast(Any, self)
            return (conv.out_channels, conv.in_channels // conv.groups) + tuple(conv.kernel_size)
        return (cast(Any, self).out_features, cast(Any, self).in_features)

    def _planned_conv_forward(self, x: Tensor, plan: tuple, nd: int) -> Tensor:
        """:meth:`_whitened_conv_forward` as planned (channel features: the statistics' input is ``x``)."""
        w = self._run_plan(plan, x)
        conv_forward = self._conv_forward
        bias = _bias_of(self)
        if plan[5] != 3:  # absorbed centring
            out = conv_forward(x, w, bias)
        elif bias is None:  # the training path of _whitened_conv_forward: the centring term added in place
            out = conv_forward(x, w, None).add_(self._layer_bias(w, plan[1]).view((-1,) + (1,) * nd))
        else:
            out = conv_forward(x, w, self._layer_bias(w, plan[1]))
        self._planned_end(plan[3])
        return out

    def _input_saved(self, x: Tensor) -> bool:
        # the convolution (or linear map) saves its input for the weight's gradient
        return self.weight.requires_grad

    def _capture_fold_inputs(self) -> None:
        # The fold at the end of the model's forward compensates with the weight of this forward: under a sharded
        # wrapper (FSDP) the full weight exists only now. Its taps summed, float64: all the fold needs.
        w = self._weight_matrix(self.weight.detach())
        if w.dim() == 2:
            self._fold_weight = w.to(torch.float64)
        else:  # one reduction, accumulated and returned in float64
            self._fold_weight = w.sum(tuple(range(2, w.dim())), dtype=torch.float64)

    # ------------------------------------------------------------ convolutions
    # The forward and the plain-conv round trip of every grad / recursive conv (1-D, 2-D, 3-D).
    def _stats_input(self, x: Tensor) -> Tensor:
        """The batch's features on dim 1 (the 2-D conv's patch features override this)."""
        return x

    def _whitened_conv_forward(self, x: Tensor, nd: int) -> Tensor:
        """Statistics, the weight with its gradient transform, and the centring, around the plain convolution."""
        conv_forward = cast(Any, self)._conv_forward
        training, state = self._forward_state()
        if training:
            _check_gathering_untransformed(self)
            self._accumulate(self._stats_input(x if x.dim() == nd + 2 else x.unsqueeze(0)))
        w = self._weight_for_forward(state)
        bn = self._batchnorm_absorbing_now()
        if bn is not None:
            # Centring absorbed by the following BatchNorm (absorb_centring): no offset, no pass over the output.
            self._track_absorbed_offset(w, bn, state)
            out = conv_forward(x, w, self.bias)
        elif self.bias is None and self.training and w.requires_grad and torch.is_grad_enabled():
            # Training a bias-free conv (the ResNet case): the centring term -W mu is added to the convolution's
            # fresh output in place instead of being passed to it as a bias: the CPU convolution backward
            # computes a bias gradient several times slower than autograd's one reduction for this add
            # (measured on ResNet-20 at batch 128). The two differ only by rounding; at conversion time
            # the term is exactly 0.
            out = conv_forward(x, w, None).add_(self._layer_bias(w, state).view((-1,) + (1,) * nd))
        else:  # the plain conv's own bias path: bit-identical to to_plain_model's plain conv
            out = conv_forward(x, w, self._layer_bias(w, state))
        if training:
            self._end_batch()
        return out

    @classmethod
    def _from_plain_conv(cls, conv: nn.Module, plain: type, **kwargs: Any) -> Any:
        if not isinstance(conv, plain):
            raise TypeError(f"{cls.__name__}.from_conv expects an nn.{plain.__name__}, but got {type(conv).__name__}")
        new = conv_like(conv, cls, bias=conv.bias is not None, **kwargs)
        share_parameters(conv, new)
        new.train(conv.training)
        return new

    def _to_plain_conv(self, plain: type) -> Any:
        conv = conv_like(self, plain, bias=True)
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            conv.bias.copy_(self._layer_bias(self.weight))
        conv.weight.requires_grad_(self.weight.requires_grad)
        conv.train(self.training)
        return conv

    def _full_weight(self) -> Tensor:
        w = self.weight.detach()
        return w.full_tensor() if hasattr(w, "full_tensor") else w  # a DTensor (FSDP2) outside the forward

    @torch.no_grad()
    def _on_mean_change(self, delta: Tensor) -> None:
        # ERRATA 8 (docs/PAPER.md): c(i) = c(i-) + sum W (mu(i) - mu(i-1)) keeps z unchanged. Written in place: a
        # forward still to be recomputed (activation checkpointing) holds its own snapshot (_forward_state).
        w = self._fold_weight
        self.__dict__["_fold_weight"] = None  # a plain attribute: no Module.__setattr__ lookups, per layer per fold
        if w is None:
            w = self._weight_matrix(self._full_weight()).to(torch.float64)
        comp = F_w.weight_mean_product(w, delta)
        absorbed = self._buffers.get("absorbed_offset")
        if absorbed is not None:  # c lives in d for an absorbed layer (c - d is what the function uses)
            absorbed.sub_(comp)  # float64 comp: computed in float64, rounded once into d's dtype (one op, no copy)
            return
        c = self.bias_correction
        if c.is_inference():
            self._set_fold_buffer("bias_correction", c + comp.to(c.dtype))
        else:  # in place, as every fold write (stats/block.py, _set_fold_buffer)
            c.add_(comp.to(c.dtype))

    @torch.no_grad()
    def _fold_compensation_into_offset(self) -> None:
        """An absorbed layer keeps its bias compensation inside ``absorbed_offset``: ``d <- d - c``, ``c <- 0``.

        The layer's output, its BatchNorm's and the export use ``c - d`` only, so this changes nothing they
        compute; with ``c = 0`` the per-step update of ``d`` is one product-accumulate
        (:meth:`_track_absorbed_offset`) instead of two operations.
        """
        d = self._buffers.get("absorbed_offset")
        c = self.bias_correction
        if d is not None and not c.is_meta and c.any():
            d.sub_(c.to(d.dtype))
            self.bias_correction = torch.zeros_like(c)

    def extra_repr(self) -> str:
        rest = self._whitening_repr()
        if self.features != "channels":
            rest = (rest + ", " if rest else "") + f"features={self.features!r}"
        if self._centring_ref is not None:
            rest = (rest + ", " if rest else "") + "centring=absorbed"
        return super().extra_repr() + (f", {rest}" if rest else "")
