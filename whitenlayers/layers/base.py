"""The base of every whitening layer: :class:`WhiteningLayer`, its buffers, its block and its side of a fold.

A whitening layer registers the contract buffers (``running_mean``, ``running_cov``, ``whitening_matrix``,
``grad_transform``, ``num_blocks``) and its rule's own, adds each training batch to its block
(:mod:`~whitenlayers.layers.step`, :class:`~whitenlayers.layers.block.Block`), and folds a block every
``block_size * accumulation_steps`` training forwards: :mod:`whitenlayers.fold` computes the new moments and hands
them to the layer's transform rule (:mod:`whitenlayers.rules`), and the layer says what the outcome writes
(:meth:`WhiteningLayer.fold_writes`), written by :meth:`WhiteningLayer.write_buffers`, the one writer of the buffers
(the fold's interface is the class's "fold" section).
Hyper-parameters live in a frozen config (:mod:`whitenlayers.config`); checkpoints are
:mod:`~whitenlayers.layers.checkpoint`'s.

Grouped layers (``groups = G > 1``, grouped convolutions and ``DirectWhiten(groups=G)``) keep every ``M x M`` matrix
as its ``G`` diagonal blocks, a ``(G, M/G, M/G)`` tensor; vectors stay ``(M,)``. ``groups=1`` layers keep the
``(M, M)`` shapes of the contract.

The block's sums are *not* buffers: DistributedDataParallel re-broadcasts every buffer from rank 0 before each
forward, which would overwrite each rank's partial sums. They travel in checkpoints through ``get_extra_state``.
Part of :mod:`whitenlayers.layers`.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple, Type, cast

import torch
from torch import Tensor

from .. import functional as F_w
from .._torch_compat import copy_all_, prepare_graph_breaks
from ..config import EVDConfig, RecursiveConfig, WhiteningConfig
from ..fold import FAILED, SKIP_MESSAGES, FoldOutcome, PendingFold, fold_summary, note_nonfinite
from ..functional import BlockSummary
from ..rules import RecursiveRule, TransformRule, rule_and_config
from .block import Block
from .checkpoint import _CheckpointMixin
from .step import InForce, Reads, _StepMixin

__all__ = ["WhiteningLayer"]

def _fields(config: WhiteningConfig) -> FrozenSet[str]:
    return _FIELDS.get(type(config)) or _FIELDS.setdefault(type(config), frozenset(config.field_names()))


_FIELDS: Dict[type, FrozenSet[str]] = {}


def _field_property(name: str) -> property:
    """The config field ``name`` as a property of the layers (:class:`WhiteningLayer`'s docstring): read from the
    layer's config; assigned, a new config with that field replaced (validated), as assigning :attr:`config`. A
    layer whose config has no such field has no such attribute."""

    def get(layer: "WhiteningLayer") -> Any:
        rule = layer.__dict__.get("rule")
        if rule is None or name not in _fields(rule.config):
            raise AttributeError(name)  # (then nn.Module's lookup: a parameter, buffer or submodule of that name)
        return getattr(rule.config, name)

    def set_(layer: "WhiteningLayer", value: Any) -> None:
        rule = layer.__dict__.get("rule")
        if rule is None or name not in _fields(rule.config):
            raise AttributeError(f"{type(layer).__name__}: its config has no field {name!r} (its fields: "
                                 f"{', '.join(_fields(rule.config)) if rule is not None else 'none yet'})")
        layer.config = rule.config.replace(**{name: value})

    return property(get, set_, doc=f"The config's ``{name}`` (``layer.config.{name}``); assigning it replaces the "
                                   "config, validated.")


def _add_field_properties(config_class: type) -> None:
    """Give :class:`WhiteningLayer` a property for each field of ``config_class`` it lacks (once per class; a rule
    of one's own's config at its first layer). A field whose name the layer already has (an attribute of
    ``nn.Module`` or of the layer) is read through ``layer.config`` only."""
    if config_class in _WITH_PROPERTIES:
        return
    _WITH_PROPERTIES.add(config_class)
    for name in cast(Type[WhiteningConfig], config_class).field_names():
        if not hasattr(WhiteningLayer, name):
            setattr(WhiteningLayer, name, _field_property(name))
            _FIELD_PROPERTIES.add(name)


_WITH_PROPERTIES: set = set()
#: The names of the field properties (a layer lists those of its own config's fields in ``dir``).
_FIELD_PROPERTIES: set = set()


def _renamed(old: str, new: str) -> property:
    """A renamed attribute's old name ``old``, for one release: reads and writes ``new``, with a ``FutureWarning``."""

    def warn(layer: Any) -> None:
        warnings.warn(f"{type(layer).__name__}.{old} is renamed {new}; the old name will be removed in the next "
                      "release", FutureWarning, stacklevel=3)

    def get(layer: Any) -> Any:
        warn(layer)
        return getattr(layer, new)

    def set_(layer: Any, value: Any) -> None:
        warn(layer)
        setattr(layer, new, value)

    return property(get, set_, doc=f"Renamed ``{new}`` (a ``FutureWarning``).")


#: The keyword-only arguments every whitening layer takes besides its config's fields, with their defaults: the one
#: list of them, which the layers' constructors and signatures (:func:`whitening_signature`) and ``convert_model``'s
#: keyword checks read. A new option is added here, read in :meth:`WhiteningLayer._init_whitening` and documented.
LAYER_OPTIONS: Dict[str, Any] = {"config": None, "process_group": None, "rule": None}


def whitening_signature(parameters: Sequence[inspect.Parameter], config_class: Type[WhiteningConfig],
                        exclude: Tuple[str, ...] = (), extra: Optional[Dict[str, Any]] = None) -> inspect.Signature:
    """A whitening layer's constructor signature (``help()``, ``inspect.signature``): ``parameters`` (the plain
    layer's, without ``self``), then keyword-only: ``extra`` options of the layer class (name: default),
    :data:`LAYER_OPTIONS` and ``config_class``'s fields less ``exclude``, each with its default."""
    keyword = [*({**(extra or {}), **LAYER_OPTIONS}).items(),
               *((f.name, f.default) for f in dataclasses.fields(config_class) if f.name not in exclude)]
    return inspect.Signature([*parameters, *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                                             for name, default in keyword)])


def split_options(kwargs: Dict[str, Any], extra: Tuple[str, ...] = ()) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``kwargs`` (a constructor's keywords) as the layer options (:data:`LAYER_OPTIONS`, every one: the given values,
    else the defaults; and the names in ``extra`` that are given) and the rest (its config's fields)."""
    options = {name: kwargs.get(name, default) for name, default in LAYER_OPTIONS.items()}
    options.update((name, kwargs[name]) for name in extra if name in kwargs)
    return options, {k: v for k, v in kwargs.items() if k not in options}


class WhiteningLayer(_StepMixin, _CheckpointMixin):
    """Mixin: the block statistics, buffers and fold of one whitening layer; the rule computes the transform.

    Subclasses call ``_init_whitening`` after their ``nn.Module`` base ``__init__``; their forward starts with
    ``_begin`` and, for a training batch, ends with ``_end`` (``whitenlayers.layers.step``); they may override
    ``_mean_change_writes`` (bias compensation).

    Public state besides the buffers: :attr:`config` (the frozen hyper-parameters), ``rule``, :attr:`method`,
    :attr:`batches_in_block`, :attr:`frozen`, ``process_group``, the counters ``transform_failures``,
    ``skipped_folds``, ``nonfinite_blocks`` and ``clamped_steps``.

    The config's fields are properties of the layer, generated once from the config dataclass's fields (a rule
    of one's own adds its config's at its first layer): ``layer.alpha`` reads ``layer.config.alpha``, and
    ``layer.alpha = 0.8`` is ``layer.config = layer.config.replace(alpha=0.8)``: a new config, validated (a
    ``ValueError`` naming the field), whose effect is that of assigning :attr:`config`: the rule is rebuilt with
    it at once and the block takes its sampling fields (``stats_every``, ``stats_fraction``); the moments and
    transform use it from the next fold on, and ``block_size`` counts the current block with the new value. A
    layer whose config has no such field (``gamma`` on an EVD layer) has no such attribute. The fold reads
    ``layer.config`` only.
    """

    num_features: int
    groups: int
    rule: TransformRule
    # The contract buffers (registered by _init_whitening; grad_transform: grad / recursive layers only) and the
    # grad layers' deferral (layers/step.py), declared for the type checker.
    running_mean: Tensor
    running_cov: Tensor
    whitening_matrix: Tensor
    grad_transform: Tensor
    num_blocks: Tensor
    _deferral: Any
    #: The model's fold coordinator (set by ``convert_model``), or ``None``: the layer folds at its own blocks' ends.
    _fold_coordinator: Any = None
    #: A fold computed but not written yet (an asynchronous coordinator's, or one loaded from a checkpoint taken while
    #: it was in flight), written at this layer's next block end.
    _pending_fold: Optional[PendingFold] = None
    #: The config class of the layer's rule (EVD for the grad and direct layers, recursive for the recursive ones).
    _CONFIG: Type[WhiteningConfig] = EVDConfig
    #: Config fields a layer class has no use for (``DirectWhiten``: ``beta``); not accepted, not shown.
    _unused_fields: tuple = ()
    #: Buffers of a subclass that a fresh layer holds as zeros, zeroed by :meth:`reset_running_stats`.
    _ZEROED_ON_RESET: Tuple[str, ...] = ()

    def _init_whitening(self, num_features: int, options: Dict[str, Any], whitening: Dict[str, Any], *,
                        grad_transform: bool, device: Any = None, dtype: Optional[torch.dtype] = None,
                        groups: int = 1) -> None:
        """The whitening state of a layer with ``num_features`` features (``groups``): its rule and config from the
        layer's options (:data:`LAYER_OPTIONS`, all of them) and whitening keyword arguments (its config's fields),
        its buffers (in ``dtype``'s statistics dtype: float64 for a float64 layer, else float32; ``None``: the
        default dtype, as ``nn`` layers take it) on ``device``, an empty block."""
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, but got num_features={num_features!r}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or num_features % groups:
            raise ValueError(f"groups must be a positive integer that divides num_features={num_features}, "
                             f"but got groups={groups!r}")
        rule, config = rule_and_config(self._CONFIG, type(self).__name__, options["config"],
                                       {**whitening, "rule": options["rule"]}, exclude=self._unused_fields)
        self._check_config(config, rule)
        self.num_features = num_features
        self.groups = groups
        self.rule = rule(config)
        _add_field_properties(type(config))
        self.process_group = options["process_group"]
        self.layer_name: Optional[str] = None
        self.frozen = False
        for name, value in self._fresh_buffers(device, F_w.stats_dtype(dtype), grad_transform).items():
            self.register_buffer(name, value)
        self._refresh_rule_identity()  # the rule's name and config, for checkpoints (layers/checkpoint.py)
        self._reads = Reads()
        self._fresh_block_and_counters()
        prepare_graph_breaks()  # (the first layer built imports dynamo: torch.compile may trace it)
        if self.running_mean.device.type == "cuda" and not torch.compiler.is_compiling():
            F_w.low_precision_products_on(self.running_mean.device)  # tried once per process, before any trace

    def _fresh_buffers(self, device: Any, dtype: torch.dtype, grad_transform: bool) -> Dict[str, Tensor]:
        """The buffers of a freshly built layer by name, in the order they are registered: ``mu = 0``, ``Phi_x =
        0``, ``T = Q_s = I``, ``num_blocks = 0`` and the rule's own initial buffers."""
        fk = {"device": device, "dtype": dtype}
        m, groups = self.num_features, self.groups
        fresh = {"running_mean": torch.zeros(m, **fk), "running_cov": torch.zeros(self._block_shape, **fk),
                 "whitening_matrix": F_w.block_identity(m, groups, **fk)}
        if grad_transform:
            fresh["grad_transform"] = F_w.block_identity(m, groups, **fk)
        fresh["num_blocks"] = torch.tensor(0, dtype=torch.long, device=device)
        return {**fresh, **self.rule.initial_buffers(m, fk, groups=groups)}

    def _fresh_block_and_counters(self) -> None:
        """An empty block, the counters at zero and no warning given yet."""
        self.transform_failures = self.skipped_folds = self.nonfinite_blocks = self.clamped_steps = 0
        self._warned: set = set()
        self._block = self._new_block(self.running_mean.device)

    def _new_block(self, device: Any) -> Block:
        return Block(self.num_features, self.groups, F_w.stats_dtype(self.running_mean.dtype), device,
                     self.rule.config)

    # ---------------------------------------------------------- configuration
    @property
    def config(self) -> WhiteningConfig:
        """The layer's hyper-parameters (a frozen :class:`~whitenlayers.config.WhiteningConfig`)."""
        return self.rule.config

    @config.setter
    def config(self, value: WhiteningConfig) -> None:
        self._check_config(value)
        self.rule = type(self.rule)(value)  # type-checked by the rule
        _add_field_properties(type(value))
        block = self.__dict__.get("_block")
        if block is not None:
            block.configure(value)

    def _check_config(self, config: WhiteningConfig, rule: Any = None) -> None:
        """Hook: ``ValueError`` for a config this layer class cannot use with its rule (``rule``: the rule class, by
        default the layer's; ``DirectWhiten``: the EVD rule's damped gains)."""

    eig_failures = _renamed("eig_failures", "transform_failures")

    def __dir__(self) -> List[str]:
        """``nn.Module``'s, with the field properties of this layer's config only (and no renamed old names)."""
        own = _fields(self.rule.config)
        return sorted(n for n in super().__dir__() if (n not in _FIELD_PROPERTIES or n in own) and n != "eig_failures")

    @property
    def method(self) -> str:
        """What :func:`~whitenlayers.convert_model` calls the layer's method: ``"grad"``, ``"recursive"`` or
        ``"direct"`` (its transform rule's name is :attr:`rule_name`)."""
        if isinstance(self.rule, RecursiveRule):  # (a subclass of one's own too: it keeps the recursive buffers)
            return "recursive"
        return "grad" if "grad_transform" in self._buffers else "direct"

    @property
    def rule_name(self) -> str:
        """The transform rule's name (:attr:`~whitenlayers.TransformRule.name`): ``"evd"``, ``"recursive"`` or a rule
        of one's own."""
        return self.rule.name

    @property
    def _block_shape(self) -> tuple:
        """Shape of the per-group matrices: ``(M, M)``, or ``(G, M/G, M/G)`` for ``groups > 1``."""
        return F_w.block_shape(self.num_features, self.groups)

    def _describe(self) -> str:
        name = f" '{self.layer_name}'" if self.layer_name else ""
        groups = f", groups={self.groups}" if self.groups != 1 else ""
        return f"{type(self).__name__}{name} (num_features={self.num_features}{groups})"

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{self._describe()}: {message}", RuntimeWarning, stacklevel=3)

    def _whitening_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.non_defaults(exclude=self._unused_fields).items())

    # ------------------------------------------------------------ quantization
    # Eager-mode quantization (torch.ao.quantization.prepare / prepare_qat) gives every module a ``qconfig``, then
    # observes the modules it does not know: a whitening layer would train and calibrate unquantized without a word
    # and fail after ``convert``. Assigning it a qconfig is refused; ``None`` keeps it in float on purpose.
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

    # ------------------------------------------------------------ state
    @property
    def batches_in_block(self) -> int:
        """Training forwards accumulated in the current (partial) block, ``0 <= n < block_size``."""
        return self._block.batches

    def freeze(self, frozen: bool = True) -> "WhiteningLayer":
        """Stop (or, with ``False``, resume) updating the statistics; returns the layer.

        A frozen layer keeps applying the transform in force (centring, ``T`` or ``Q_s``) but its training forwards
        accumulate nothing and end no block, like a network whose whitening was fitted once and then fixed. A
        partial block is kept and continues when the layer is unfrozen. A block that had already ended is still
        folded (its fold pending: at the model's forward's end, or the layer's next forward); with ``fold_async``
        the fold it starts is held pending, applied at the layer's next block end (once unfrozen) or :meth:`fold`.

        Args:
            frozen: ``True`` (default) to stop updating, ``False`` to resume. :func:`~whitenlayers.frozen` freezes
                every layer of a model for the duration of a ``with`` block.
        """
        self.frozen = bool(frozen)
        return self

    def make_standalone(self) -> "WhiteningLayer":
        """Fold at the end of this layer's own blocks, not through a converted model's coordinator.

        For a layer taken (e.g. deep-copied) out of a converted model. Returns the layer.
        """
        if self._block.fold_pending:
            self._fold_now()
        self._fold_coordinator = None
        return self

    def reset_running_stats(self, keep_function: bool = False) -> None:
        """Back to the state of a freshly built layer: every buffer and the extra state.

        ``mu = 0``, ``Phi_x = 0``, ``T = Q_s = I`` (and the recursive rule's initial state), ``num_blocks = 0``, an
        empty partial block, the counters at zero and, for grad/recursive layers, no bias compensation
        (``bias_correction = 0``) and no absorbed offset. Like BatchNorm's, it reads none of the old values, so it
        also initialises a layer whose memory is garbage (``to_empty`` after building on the meta device);
        :meth:`reset_parameters` calls it. The layer then computes what a freshly converted layer with the same
        weights computes (the plain layer's function).

        Args:
            keep_function: ``True`` keeps what the layer computes instead: the old centring ``-sum_k W_k mu`` moves
                into ``bias_correction`` and the absorbed offset is kept (grad/recursive layers; reads the old
                ``mu``, so the state must be initialised). Default ``False``.
        """
        self._wait_for_fold()
        self._pending_fold = None
        with torch.no_grad():
            mean = self.running_mean
            fresh = self._fresh_buffers(mean.device, mean.dtype, "grad_transform" in self._buffers)
            if keep_function:
                fresh.update(self._mean_change_writes(-mean.to(torch.float64)))
            else:
                fresh.update({name: torch.zeros_like(self._buffers[name]) for name in self._ZEROED_ON_RESET
                              if self._buffers.get(name) is not None})
            self._write_buffers(fresh)
            self._refresh_rule_identity(force=True)
        self._fresh_block_and_counters()

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

        The whitening state keeps its precision: a cast to a dtype other than float32 / float64
        (``model.to(torch.bfloat16)``, ``.half()``) moves the layer's own floating buffers (statistics,
        transforms, bias compensation) to the new device in their own dtype (float32, or float64 for a float64
        layer); a cast between float32 and float64 casts them as before. And the partial block, which is not
        buffers (DDP would broadcast them), moves with the layer, its sums in their own dtype (float32 or float64;
        a grouped layer's float64) as a float32 <-> float64 cast of the layer decides.
        """
        self._wait_for_fold()
        own = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        result = super()._apply(fn, recurse)
        for name, old in own.items():
            new = self._buffers.get(name)
            if new is not None and new.dtype != old.dtype and new.dtype not in (torch.float32, torch.float64):
                self._buffers[name] = old.to(device=new.device)
        if "_block" in self.__dict__:
            self._block.move(fn, F_w.stats_dtype(self.running_mean.dtype))
        pending = self._pending_fold
        if pending is not None:  # a pending fold (fold_async) follows to the new device, in its own dtypes
            self._pending_fold = _moved(pending, self.running_mean.device)
        if self.running_mean.device.type == "cuda":
            F_w.low_precision_products_on(self.running_mean.device)
        self._reads.dropped()  # (torch wrote the buffers)
        return result

    def whitened_covariance(self) -> Tensor:
        """``T Phi_x T^T``: the covariance of the features the layer's weights effectively see. float64.

        For ``groups > 1`` its diagonal blocks ``(G, k, k)`` (the rest is not tracked).
        """
        t = self.whitening_matrix.to(torch.float64)
        return F_w.symmetrize(F_w.whitened_covariance(t, self.running_cov.to(torch.float64)))

    # ------------------------------------------------------------ the block
    def _reset_accumulators(self, device: Any = None) -> None:
        """An empty block (on ``device``, default the buffers')."""
        dev = self.running_mean.device if device is None else torch.device(device)
        block = self._block
        if block.s1.device == dev and not block.s1.is_meta and not block.store.is_meta:
            for sums in block.restart():
                sums.zero_()
        else:
            self._block = self._new_block(dev)

    def _fold_weight_of(self, weight: Optional[Tensor]) -> Optional[Tensor]:
        """What the coming fold compensates with, taken at the block's end (grad layers: the forward's weight, which
        a sharded wrapper gathers only during the forward); ``None``: nothing."""
        return None

    # -------------------------------------------------------------------- fold
    # The fold's interface: what :mod:`whitenlayers.fold` and the coordinator's fold read of a layer (besides its
    # public attributes: rule, config, num_features, groups, the buffers, process_group) and the only methods through
    # which they change it (besides the block's float64 sums, which a distributed fold's ``_global_summaries`` uses as
    # scratch space before the block restarts). A fold computes each layer's outcome (``fold.FoldOutcome``, in a
    # ``fold.PendingFold``) from :attr:`fold_block` and :meth:`fold_buffers`; the layer says what it writes
    # (:meth:`fold_writes`) and :meth:`write_buffers` writes it.
    @property
    def fold_block(self) -> Block:
        """The partial block that a fold reads (its sums, its non-finite batches, whether it ended)."""
        return self._block

    def fold_buffers(self) -> Dict[str, Tensor]:
        """The layer's buffers by name, as a fold reads them (the module's own dict, not a copy: read only)."""
        return self._buffers  # (a whitening layer's buffers are never None)

    def begin_next_block(self, nonfinite: int) -> None:
        """A fold has read the block: count the ranks whose block had non-finite sums (``nonfinite``) and start an
        empty block."""
        self._count_nonfinite(nonfinite)
        for sums in self._block.restart():
            sums.zero_()

    def take_pending_fold(self) -> Optional[PendingFold]:
        """The fold held pending (computed one block late by an asynchronous coordinator, or loaded from a
        checkpoint taken while it was in flight), no longer held; ``None``: none. The caller applies it."""
        fold, self._pending_fold = self._pending_fold, None
        return fold

    def hold_pending_fold(self, fold: PendingFold) -> None:
        """Hold ``fold`` (an asynchronous fold's, computed) until this layer's next block end, where the fold
        takes it (:meth:`take_pending_fold`) and applies it."""
        self._pending_fold = fold

    def _count_nonfinite(self, nonfinite: int) -> None:
        """Count the ranks whose block had non-finite sums; the layer is named in the fold's one warning."""
        if nonfinite:
            self.nonfinite_blocks += nonfinite
            if "nonfinite" not in self._warned:  # (said once per layer)
                self._warned.add("nonfinite")
                note_nonfinite(self)

    def outcome_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """``(name, shape)`` of the buffers a fold's outcome may hold, in a fixed order."""
        buffers = self._buffers
        names = ["running_cov", "whitening_matrix"] + (["grad_transform"] if "grad_transform" in buffers else [])
        names += self.rule_buffer_names()
        return [(name, tuple(buffers[name].shape)) for name in names]

    def rule_buffer_names(self) -> List[str]:
        """The names of the rule's own buffers, kept with the rule they came from (building them on the meta device
        costs about 0.35 ms a layer, at every asynchronous fold)."""
        kept = self.__dict__.get("_rule_buffer_names")
        if kept is None or kept[0] is not self.rule:
            names = list(self.rule.initial_buffers(self.num_features, {"device": "meta"}, groups=self.groups))
            kept = self.__dict__["_rule_buffer_names"] = (self.rule, names)
        return list(kept[1])

    @torch.no_grad()
    def fold_writes(self, fold: PendingFold, outcome: FoldOutcome) -> Optional[Dict[str, Tensor]]:
        """What a fold computed for this layer writes into its buffers (the fold's apply writes them, for every layer
        at once: :meth:`write_buffers`): ``outcome`` (``fold.outcome``, or the one broadcast from the rank that
        computed it), the new mean ``fold.mean``, the bias compensation for its change ``fold.delta`` (float64) and
        ``num_blocks`` counted; ``None``: nothing (a skipped fold). The layer counts ``fold.nonfinite``, a skipped
        fold and a failed transform (the previous one is kept; warned once) and notes whether its next block sums
        unshifted."""
        self._count_nonfinite(fold.nonfinite)
        if outcome.status in SKIP_MESSAGES:
            self.skipped_folds += 1
            if SKIP_MESSAGES[outcome.status]:
                self._warn_once("skip", cast(str, SKIP_MESSAGES[outcome.status]))
            return None
        if outcome.status == FAILED:
            self.transform_failures += 1
            if outcome.problem is None:
                self._warn_once("transform", self.rule.failure_message)
            else:  # the rule's result refused: said once, and not the rule's failure message as well
                self._warn_once("rule_result", f"rule {self.rule.name!r} ({type(self.rule).__name__}) returned an "
                                               f"invalid result: {outcome.problem}; the previous transform is kept "
                                               "(counted in transform_failures)")
                self._warned.add("transform")
        self._block.unshifted = fold.unshifted
        if outcome.clamped:
            self.clamped_steps += 1
        return {**outcome.buffers, **self._mean_change_writes(fold.delta), "running_mean": fold.mean,
                "num_blocks": self.num_blocks + 1}

    @staticmethod
    def write_buffers(writes: Sequence[Tuple["WhiteningLayer", Dict[str, Tensor]]]) -> None:
        """Write each layer's values into its buffers of those names: the one writer of the layers' buffers in the
        package (a fold's apply for all its layers, a reset, a change of centring). In place, in one multi-tensor
        copy (converting dtype and device), so each buffer keeps its tensor and storage: whatever holds a reference
        to it sees the write (``torch.func.functional_call``, a captured CUDA graph, an EMA helper holding
        ``named_buffers()``). A layer's training forwards then read the new values as copies
        (:class:`~whitenlayers.layers.step.InForce`; a backward still to come keeps the values of its forward): the
        values themselves (with the copies of the buffers not written) where each is a tensor of its own as the
        buffer holds it (a fold's results: no one writes them afterwards), else copies taken at the next training
        forward. A new buffer tensor only where a value cannot go into the old one (another shape, an inference
        tensor)."""
        destinations: List[Tensor] = []
        sources: List[Tensor] = []
        for layer, values in writes:
            for name, value in values.items():
                old = cast(Tensor, layer._buffers[name])
                if old.shape == value.shape and not old.is_inference():
                    destinations.append(old)
                    sources.append(value)
                else:  # through Module.__setattr__, which buffer registration hooks see
                    setattr(layer, name, value.detach().to(device=old.device, dtype=old.dtype, copy=True))
        if destinations:
            copy_all_(destinations, sources)
        for layer, values in writes:
            kept = layer._reads.copies  # (the copies of the buffers not written stay right)
            reads = {name: values[name] if name in values else kept.state[name] if kept is not None else None
                     for name in layer._FORWARD_BUFFERS}
            if all(_own_copy(value, layer._buffers[name]) for name, value in reads.items()):
                layer._reads.copies = InForce(cast(Dict[str, Tensor], reads), {}, True)
            else:
                layer._reads.dropped()

    def _write_buffers(self, values: Dict[str, Tensor]) -> None:
        """:meth:`write_buffers` of this layer alone."""
        self.write_buffers([(self, values)])

    def _mean_change_writes(self, delta: Tensor) -> Dict[str, Tensor]:
        """Hook: the buffers that keep the layer's function when the mean in force changes by ``delta`` (float64), by
        name (none here: the grad layers' bias compensation)."""
        return {}

    # ------------------------------------------------------------- public API
    def fold(self, block: Optional[BlockSummary] = None) -> None:
        """Fold the current (possibly partial) block now, as if the block had ended.

        Either way the layer starts a new, empty block.

        Args:
            block: a block summary to fold instead of the accumulated block (from :meth:`block_statistics`, e.g. to
                time one layer's fold on the same block again and again); nothing is summed across ranks then.
                Default ``None``: the accumulated block, summed across ranks under ``torch.distributed``.
        """
        if block is None:
            self._fold_now()
            return
        fold_summary(self, block)

    def accumulate(self, x: Tensor) -> None:
        """Add ``x`` (features on dim 1: ``(N, M)`` or ``(N, M, *positions)``) to the current block's statistics,
        as a training forward does, without counting a batch toward ``block_size`` (see :meth:`fold`).

        Args:
            x: the features, ``(N, M)`` or ``(N, M, *positions)`` with ``M = num_features``: every sample and
                position is one observation (a conv layer's input before padding, or its unfolded patches).
        """
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"{self._describe()}: accumulate expects features on dim 1 ({self.num_features}), but "
                             f"got shape {tuple(x.shape)}")
        if not self.gathers_now(explicit=True):
            return
        if self._block.fold_pending:
            self._fold_now()
        self._add_batch(x)

    def block_statistics(self) -> BlockSummary:
        """This rank's current block as a :class:`~whitenlayers.functional.BlockSummary` (count, mean, scatter)."""
        return F_w.summarize_block(*self._block.sums())

    def discard_block(self) -> None:
        """Drop the current partial block (its statistics and its batch count); the state in force is kept."""
        self._reset_accumulators()


def _own_copy(value: Optional[Tensor], buffer: Tensor) -> bool:
    """Whether ``value`` can stand for ``buffer``'s copy (:meth:`WhiteningLayer.write_buffers`): a tensor apart from
    it, as it stores it (shape, dtype, device), outside autograd and inference mode."""
    return (value is not None and value is not buffer and value.shape == buffer.shape and value.dtype == buffer.dtype
            and value.device == buffer.device and not value.requires_grad and not value.is_inference())


def _moved(fold: PendingFold, device: torch.device) -> PendingFold:
    """``fold`` with its tensors on ``device`` (their dtypes kept)."""
    outcome = cast(FoldOutcome, fold.outcome)
    return fold._replace(outcome=outcome._replace(buffers={k: v.to(device) for k, v in outcome.buffers.items()}),
                         mean=fold.mean.to(device), delta=fold.delta.to(device))


for _config_class in (EVDConfig, RecursiveConfig):  # the built-in rules' fields (a rule of one's own: its first layer)
    _add_field_properties(_config_class)
