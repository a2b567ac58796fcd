"""The whitening layer's class: construction, config, resets and casts; its other parts are mixed in from
:mod:`~whitenlayers.stats.step`, :mod:`~whitenlayers.stats.block` and :mod:`~whitenlayers.stats.state_io`.
Part of :mod:`whitenlayers.stats`.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Type, cast

import torch
from torch import Tensor

from .. import functional as F_w
from ..config import EVDConfig, RecursiveConfig, WhiteningConfig
from ..fold import FoldOutcome, PendingFold
from ..rules import TransformRule, rule_for
from ._core import _try_low_precision_products
from .block import _BlockMixin
from .rule_state import _RuleStateMixin
from .step import _PerStepMixin

if TYPE_CHECKING:  # pragma: no cover
    from ..coordinator import FoldCoordinator

__all__ = ["WhiteningLayer"]


class WhiteningLayer(_PerStepMixin, _BlockMixin, _RuleStateMixin):
    """Mixin: the block statistics, buffers and fold of one whitening layer; the rule computes the transform.

    Subclasses call ``_init_whitening`` after their ``nn.Module`` base
    ``__init__``, call ``_accumulate`` with the layer input in training
    mode and ``_end_batch`` after computing the output, and may override
    ``_on_mean_change`` (bias compensation).

    Public state besides the buffers: :attr:`config` (the frozen
    hyper-parameters; assigning a new config of the same class takes effect at
    the next fold), its fields as attributes (``layer.alpha``, ...; assigning
    one replaces the config, validated), ``rule``, ``method``,
    :attr:`batches_in_block`, :attr:`frozen`, ``process_group``, the
    counters ``eig_failures``, ``skipped_folds``, ``nonfinite_blocks`` and
    ``clamped_steps``.
    """


    def _init_whitening(
        self,
        num_features: int,
        config: WhiteningConfig,
        *,
        grad_transform: bool,
        process_group: Any = None,
        device=None,
        dtype=None,
        groups: int = 1,
        rule: Optional[Type[TransformRule]] = None,
    ) -> None:
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, but got num_features={num_features!r}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or num_features % groups:
            raise ValueError(f"groups must be a positive integer that divides num_features={num_features}, "
                             f"but got groups={groups!r}")
        self.num_features = num_features
        self.groups = groups
        self.rule = rule_for(config) if rule is None else rule(config)
        self.process_group = process_group
        self.layer_name: Optional[str] = None
        self.frozen = False
        stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        fk = {"device": device, "dtype": stats_dtype}
        m = num_features
        self.register_buffer("running_mean", torch.zeros(m, **fk))
        self.register_buffer("running_cov", torch.zeros(self._block_shape, **fk))
        self.register_buffer("whitening_matrix", F_w.block_identity(m, groups, **fk))
        if grad_transform:
            self.register_buffer("grad_transform", F_w.block_identity(m, groups, **fk))
        self.register_buffer("num_blocks", torch.tensor(0, dtype=torch.long, device=device))
        for name, value in self.rule.initial_buffers(m, fk, groups=groups).items():
            self.register_buffer(name, value)
        self._register_rule_identity()  # the rule's name and config, for checkpoints (stats/rule_state.py)
        # Counters, readable attributes (also saved in extra state).
        self.eig_failures = 0
        self.skipped_folds = 0
        self.nonfinite_blocks = 0
        self._stats_unshifted = False
        self.clamped_steps = 0
        self._warned: set = set()
        self._fold_coordinator: Optional[FoldCoordinator] = None
        self._traced_calls: List[int] = []  # the rows of each call in a compiled forward (stats/step.py)
        _try_low_precision_products(self.running_mean.device)
        self._reset_accumulators()

    # ------------------------------------------------------------ quantization
    # Eager-mode quantization (torch.ao.quantization.prepare / prepare_qat) gives every module a ``qconfig``
    # (propagate_qconfig_), then swaps the module types it knows for quantized ones and observes the rest: a
    # whitening layer would train and calibrate unquantized without a word and fail after ``convert``. Assigning it
    # a qconfig is refused (the error names the layer and what to do); ``None`` keeps it in float on purpose.
    @property
    def qconfig(self) -> Any:
        """Always ``None`` where set: a whitening layer has no quantized form (assigning a qconfig raises)."""
        try:
            return self.__dict__["_qconfig"]
        except KeyError:  # unset: getattr(layer, "qconfig", parent's) takes the parent's, which the setter refuses
            raise AttributeError("qconfig") from None

    @qconfig.setter
    def qconfig(self, value: Any) -> None:
        if value is not None:
            raise ValueError(
                f"{self._describe()}: eager-mode quantization (torch.ao.quantization.prepare_qat / prepare) has no "
                "quantized form of a whitening layer: it would train unquantized (no fake quantization) and fail "
                "after convert. Quantize the plain model after training, wl.to_plain_model(copy.deepcopy(model)), "
                "then prepare_qat and fine-tune (or prepare and calibrate) that; or keep the whitening layers in float "
                "on purpose: set layer.qconfig = None on each of wl.whitening_layers(model) before prepare, and put a "
                "DeQuantStub before each and a QuantStub after it"
            )
        self.__dict__["_qconfig"] = None

    @property
    def batches_in_block(self) -> int:
        """Training forwards accumulated in the current (partial) block, ``0 <= n < block_size``."""
        return self._acc_batches

    @property
    def nonfinite_batches(self) -> int:
        """Deprecated alias of ``nonfinite_blocks`` (a non-finite batch now drops its whole block)."""
        warnings.warn("nonfinite_batches is deprecated: a batch with non-finite values now drops its whole block, "
                      "counted in nonfinite_blocks", DeprecationWarning, stacklevel=2)
        return self.nonfinite_blocks

    def freeze(self, frozen: bool = True) -> "WhiteningLayer":
        """Stop (or, with ``False``, resume) updating the statistics; returns the layer.

        A frozen layer keeps applying the transform in force (centring, ``T`` or
        ``Q_s``) but its training forwards accumulate nothing and fold nothing,
        like a network whose whitening was fitted once and then fixed. A partial
        block is kept and continues when the layer is unfrozen.

        Args:
            frozen: ``True`` (default) to stop updating, ``False`` to resume. :func:`~whitenlayers.frozen`
                freezes every layer of a model for the duration of a ``with`` block.
        """
        self.frozen = bool(frozen)
        return self

    def make_standalone(self) -> "WhiteningLayer":
        """Fold at the end of this layer's own blocks, not through a converted model's coordinator.

        For a layer taken (e.g. deep-copied) out of a converted model. Returns the layer.
        """
        if self._fold_pending:
            self._fold_now()
        self._fold_coordinator = None
        return self

    #: Buffers of a subclass that a fresh layer holds as zeros, zeroed by :meth:`reset_running_stats`.
    _ZEROED_ON_RESET: Tuple[str, ...] = ()

    def reset_running_stats(self, keep_function: bool = False) -> None:
        """Back to the state of a freshly built layer: every buffer and the extra state.

        ``mu = 0``, ``Phi_x = 0``, ``T = Q_s = I`` (and the recursive rule's
        initial state), ``num_blocks = 0``, an empty partial block, the
        counters at zero and, for grad/recursive layers, no bias compensation
        (``bias_correction = 0``) and no absorbed offset. Like BatchNorm's, it
        reads none of the old values, so it also initialises a layer whose
        memory is garbage (``to_empty`` after building on the meta device);
        :meth:`reset_parameters` calls it. The layer then computes what a freshly
        converted layer with the same weights computes (the plain layer's
        function).

        Args:
            keep_function: ``True`` keeps what the layer computes instead: the
                old centring ``-sum_k W_k mu`` moves into ``bias_correction`` and
                the absorbed offset is kept (grad/recursive layers; reads the old
                ``mu``, so the state must be initialised). Default ``False``.
        """
        self._fold_weight = None
        self._in_force = None
        self.__dict__.pop("_snapshot", None)
        self._mean_taps = None
        self._pointwise_cache = None
        self.__dict__.pop("_shift_cache", None)
        self._wait_for_fold()
        self._pending_fold = None
        with torch.no_grad():
            if keep_function:
                self._on_mean_change(-self.running_mean.to(torch.float64))
            else:
                for name in self._ZEROED_ON_RESET:
                    buf = self._buffers.get(name)
                    if buf is not None:
                        buf.zero_()
            self.running_mean.zero_()
            self.running_cov.zero_()
            self.whitening_matrix.copy_(F_w.block_identity(self.num_features, self.groups))
            if hasattr(self, "grad_transform"):
                self.grad_transform.copy_(F_w.block_identity(self.num_features, self.groups))
            fk = {"device": self.running_mean.device, "dtype": self.running_mean.dtype}
            for name, value in self.rule.initial_buffers(self.num_features, fk, groups=self.groups).items():
                getattr(self, name).copy_(value)
            self._refresh_rule_identity(force=True)
            self.num_blocks.zero_()
        self.eig_failures = self.skipped_folds = self.nonfinite_blocks = self.clamped_steps = 0
        self._stats_unshifted = False
        self._warned = set()
        self._reset_accumulators()

    def reset_parameters(self) -> None:
        """The layer's own ``reset_parameters`` (a conv's or linear layer's weight and bias), then
        :meth:`reset_running_stats`, as BatchNorm does: what meta-device initialisation recipes call after
        ``to_empty``."""
        parent = getattr(super(), "reset_parameters", None)
        if parent is not None:
            parent()
        if "running_mean" in self.__dict__.get("_buffers", {}):  # nn.Conv2d.__init__ calls this before the state
            self.reset_running_stats()

    def _apply(self, fn, recurse: bool = True):
        """``Module._apply`` (``to``, ``cuda``, ``to_empty``, ``half``, ...), with two differences.

        The whitening state keeps its precision: a cast to a dtype other than
        float32 / float64 (``model.to(torch.bfloat16)``, ``.half()``) moves
        the layer's own floating buffers (statistics, transforms, bias
        compensation) to the new device in their own dtype (float32, or
        float64 for a float64 layer); a cast between float32 and float64 casts
        them as before. And the partial block's float64 accumulators, which are
        not buffers (DDP would broadcast them), move with the layer, staying
        float64.
        """
        self._wait_for_fold()
        own = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in own.items():
            new = self._buffers.get(name)
            if new is not None and new.dtype != old.dtype and new.dtype not in (torch.float32, torch.float64):
                self._buffers[name] = old.to(device=new.device)
        if "_acc_s1" in self.__dict__:
            self._move_accumulators(fn)
        self._acc_shift_x = None  # the shift as batches subtract it: made again from _acc_shift at the next batch
        pending = self._pending_fold
        if pending is not None:  # a pending fold (fold_async) follows to the new device, in its own dtypes
            self._pending_fold = _moved(pending, self.running_mean.device)
        _try_low_precision_products(self.running_mean.device)
        self._in_force = None
        self.__dict__.pop("_snapshot", None)
        self._mean_taps = None
        self._pointwise_cache = None
        self.__dict__.pop("_shift_cache", None)
        return result

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._keep_shift_store()

    def set_extra_state(self, state: Any) -> None:
        super().set_extra_state(state)
        self._keep_shift_store()

    def _keep_shift_store(self) -> None:
        """The tensor a compiled forward sums about (stats/step.py, ``_shift_store``) after a copy or a load: the
        block's shift where one is chosen, else a tensor of its own (its values are moved to the block's shift
        after the forward that starts the block)."""
        attrs, shift = self.__dict__, self.__dict__.get("_acc_shift")
        if shift is not None:
            attrs["_shift_store"] = shift
        elif attrs.get("_shift_store") is None and "running_mean" in attrs.get("_buffers", {}):
            attrs["_shift_store"] = torch.zeros(self.num_features, dtype=torch.float64,
                                                device=self.running_mean.device)

    def whitened_covariance(self) -> Tensor:
        """``T Phi_x T^T``: the covariance of the features the layer's weights effectively see. float64.

        For ``groups > 1`` its diagonal blocks ``(G, k, k)`` (the rest is not tracked).
        """
        t = self.whitening_matrix.to(torch.float64)
        return F_w.symmetrize(F_w.whitened_covariance(t, self.running_cov.to(torch.float64)))

    #: Config fields a layer class has no use for (``DirectWhiten``: ``beta``); not accepted, not shown.
    _unused_fields: tuple = ()

    def _whitening_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.non_defaults(exclude=self._unused_fields).items())


def _moved(fold: PendingFold, device: torch.device) -> PendingFold:
    """``fold`` with its tensors on ``device`` (their dtypes kept)."""
    outcome = cast(FoldOutcome, fold.outcome)
    return fold._replace(outcome=outcome._replace(buffers={k: v.to(device) for k, v in outcome.buffers.items()}),
                         mean=fold.mean.to(device), delta=fold.delta.to(device), shift=fold.shift.to(device))


def _config_attribute(name: str) -> property:
    def get(self: WhiteningLayer) -> Any:
        return getattr(self.config, name)  # AttributeError for a field this layer's rule does not have

    def set(self: WhiteningLayer, value: Any) -> None:
        self.config = self.config.replace(**{name: value})

    return property(get, set, doc=f"``config.{name}``; assigning replaces the config (validated).")


for _name in dict.fromkeys(EVDConfig.field_names() + RecursiveConfig.field_names()):
    setattr(WhiteningLayer, _name, _config_attribute(_name))
del _name
