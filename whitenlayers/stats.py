"""The state of a whitening layer: running statistics, buffers, the block, checkpoints.

:class:`WhiteningLayer` is a mixin of the whitening layers. It registers
the contract buffers (``running_mean``, ``running_cov``, ``whitening_matrix``,
``grad_transform``, ``num_blocks``) and its rule's own, accumulates each
training batch's moments, and folds a block every ``block_size`` training
forwards (``docs/PAPER.md``, "Conventions"): it computes the new moments and hands them to its
transform rule (:mod:`whitenlayers.rules`), which returns the new transform.
Hyper-parameters live in a frozen config (:mod:`whitenlayers.config`).

Grouped layers (``groups = G > 1``, grouped convolutions and
``DirectWhiten(groups=G)``) keep every ``M x M`` matrix as its ``G`` diagonal
blocks, a ``(G, M/G, M/G)`` tensor: ``running_cov``, ``whitening_matrix``,
``grad_transform`` and the recursive ``running_cov_whitened`` and
``whitening_gram`` (a depthwise layer with ``M = 960`` keeps ``960 x 1 x 1``
numbers, not ``960 x 960``); vectors (``running_mean``, ``running_power``)
stay ``(M,)``. ``groups=1`` layers keep the ``(M, M)`` shapes of the contract,
so their checkpoints are those of earlier versions and load unchanged.

Per-batch accumulators are *not* buffers: DistributedDataParallel re-broadcasts
every buffer from rank 0 before each forward, which would overwrite each rank's
partial sums. They travel in checkpoints through ``get_extra_state`` as one
float64 tensor (like every other entry of the state dict, so EMA helpers,
safetensors and exporters that expect tensors work; the dict of version 1
checkpoints still loads).

A forward that autograd re-runs inside a backward (activation checkpointing,
either kind) is not a new batch: it gathers nothing, folds nothing, and reads
the buffers that were in force at the layer's last original forward
(:func:`recomputing`, :meth:`WhiteningLayer._forward_state`).
Folding across layers and ranks is :mod:`whitenlayers.fold`'s.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, Hashable, Iterator, List, Optional, Tuple, Union, cast

import torch
from torch import Tensor

from . import functional as F_w
from ._deprecated import module_getattr
from .config import EVDConfig, RecursiveConfig, WhiteningConfig
from .fold import (
    FAILED,
    SKIP_MESSAGES,
    FoldCoordinator,
    FoldOutcome,
    _fold_all,
    _no_autocast,
    _read_with_firsts,
    fold_layers,
)
from .functional import BlockSummary, stats_samples
from .functional.moments import LOW_PRECISION, _as_moments_accumulator, low_precision_products_known
from .rules import TransformRule, rule_for

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["WhiteningLayer", "recomputing"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def _sole_refcount() -> int:
    """``sys.getrefcount`` of a tensor held by one local variable only, taken as :meth:`_set_fold_buffer` takes
    its spare (popped from a dict): the baseline on this interpreter (versions count the caller's own
    references differently); a tensor anything else holds counts more."""
    spares = {"spare": torch.empty(0)}
    spare = spares.pop("spare")
    return sys.getrefcount(spare)


_SOLE_REFCOUNT = _sole_refcount()


def _unshared(t: Tensor) -> bool:
    """Whether no autograd graph and no view holds ``t`` (its tensor's C++ use count is its one Python object's,
    its storage's is the tensor's and the temporary storage object's); ``False`` where this torch cannot tell."""
    use_count = getattr(t, "_use_count", None)
    storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or storage_use_count is None:
        return False
    return use_count() == 1 and storage_use_count(t.untyped_storage()._cdata) == 2


_eager = torch.compiler.disable
#: ``Module``'s global buffer registration hooks (torch 2.0+), which a buffer written past ``setattr`` would skip.
_buffer_registration_hooks: Dict[int, Any] = getattr(torch.nn.modules.module, "_global_buffer_registration_hooks",
                                                     {})


def _try_low_precision_products(device: torch.device) -> None:
    """Try, once per process, whether ``device`` multiplies bf16 / fp16 operands into float32, where the layers are
    built or moved (outside any traced graph: a compiled layer only reads the answer)."""
    if device.type == "cuda" and not _is_compiling():
        F_w.low_precision_products_on(device)


def _work_dtype(x: Tensor) -> torch.dtype:
    """The dtype a batch's statistics are computed in: its own when float32 / float64, else float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def recomputing() -> bool:
    """Whether the current forward runs inside a backward pass, i.e. autograd re-runs it (activation checkpointing).

    Both kinds of :func:`torch.utils.checkpoint.checkpoint` recompute a
    segment's forward while the autograd engine executes the backward; an
    original forward never runs there. Inside a compiled graph this is
    ``False`` (compiled checkpointing replays the graph, not the module).
    """
    if _graph_task_id is None or _is_compiling():
        return False
    return _graph_task_id() != -1


#: Layout tag of the packed extra state (:meth:`WhiteningLayer.get_extra_state`); version 1 was a dict.
_EXTRA_LAYOUT = 2
#: The scalar head of the packed extra state, in order; then ``shift (M)``, ``s1 (M)``, ``s2`` (block shape).
_EXTRA_HEAD = ("layout", "acc_batches", "has_shift", "eig_failures", "skipped_folds", "nonfinite_blocks",
               "clamped_steps", "acc_count", "stats_unshifted")
_COUNTERS = ("eig_failures", "skipped_folds", "nonfinite_blocks", "clamped_steps")
#: Set while :func:`~whitenlayers.load_plain_state_dict` loads a plain checkpoint into a converted model.
_loading_plain = [False]


@contextlib.contextmanager
def loading_plain_checkpoint() -> Iterator[None]:
    """While active, loading a plain layer's keys into a whitening layer is expected (no warning)."""
    before, _loading_plain[0] = _loading_plain[0], True
    try:
        yield
    finally:
        _loading_plain[0] = before


def _strict_load() -> bool:
    """The ``strict`` of the ``Module.load_state_dict`` call under way (PyTorch passes ``strict=True`` to every
    ``_load_from_state_dict`` and applies ``strict`` to the missing / unexpected keys afterwards); ``False`` where
    no such call is found (a loader of its own: warn, never fail a load PyTorch would accept)."""
    frame = sys._getframe(2)
    code = torch.nn.Module.load_state_dict.__code__
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return False


#: Buffers only a recursive layer has (they tell a recursive checkpoint from a grad one).
_RECURSIVE_KEYS = ("running_cov_whitened", "running_power", "whitening_gram")



class WhiteningLayer:
    """Mixin: the block statistics, buffers and fold of one whitening layer; the rule computes the transform.

    Subclasses call ``_init_whitening`` after their ``nn.Module`` base
    ``__init__``, call ``_accumulate`` with the layer input in training
    mode and ``_end_batch`` after computing the output, and may override
    ``_on_mean_change`` (bias compensation).

    Public state besides the buffers: :attr:`config` (the frozen
    hyper-parameters; assigning a new config of the same class takes effect at
    the next fold), its fields as attributes (``layer.alpha``, ...; assigning
    one replaces the config, validated), ``rule``, :attr:`method`,
    :attr:`batches_in_block`, :attr:`frozen`, ``process_group``, the
    counters ``eig_failures``, ``skipped_folds``, ``nonfinite_blocks`` and
    ``clamped_steps``.
    """

    # 2: the partial block is one tensor in ``_extra_state``; grad layers with a bias keep their bias compensation
    # in ``bias_correction`` (version 1 added it to the bias parameter).
    _version = 2
    num_features: int
    rule: TransformRule
    #: The buffers a forward reads; a recomputed forward reads those of the original one (:meth:`_forward_state`).
    _FORWARD_BUFFERS: Tuple[str, ...] = ("running_mean",)
    _in_force: Optional[Dict[str, Tensor]] = None
    _mean_taps: Optional[tuple] = None
    _pointwise_cache: Optional[tuple] = None

    if TYPE_CHECKING:  # for type checkers only: nothing here exists at runtime
        # The buffers ``_init_whitening`` registers (``grad_transform``: grad layers only).
        running_mean: Tensor
        running_cov: Tensor
        whitening_matrix: Tensor
        grad_transform: Tensor
        num_blocks: Tensor

        # Provided by the ``nn.Module`` every layer class combines this mixin with.
        training: bool
        _buffers: Dict[str, Any]  # Module's: Dict[str, Optional[Tensor]]; a whitening layer registers no None buffer

        def register_buffer(self, name: str, tensor: Optional[Tensor], persistent: bool = True) -> None: ...

        def named_buffers(self, prefix: str = "", recurse: bool = True,
                          remove_duplicate: bool = True) -> Iterator[Tuple[str, Tensor]]: ...

        def extra_repr(self) -> str: ...

        def train(self, mode: bool = True) -> Self: ...

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
    ) -> None:
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, but got num_features={num_features!r}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or num_features % groups:
            raise ValueError(f"groups must be a positive integer that divides num_features={num_features}, "
                             f"but got groups={groups!r}")
        self.num_features = num_features
        self.groups = groups
        self.rule = rule_for(config)
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
        # Counters, readable attributes (also saved in extra state).
        self.eig_failures = 0
        self.skipped_folds = 0
        self.nonfinite_blocks = 0
        self._stats_unshifted = False
        self.clamped_steps = 0
        self._warned: set = set()
        self._fold_coordinator: Optional[FoldCoordinator] = None
        _try_low_precision_products(self.running_mean.device)
        self._reset_accumulators()

    # ------------------------------------------------------------------ forward
    def _forward_state(self) -> Tuple[bool, Dict[str, Tensor]]:
        """Begin a forward: whether it is a training batch (gathers statistics, counts toward the block), and the
        buffers it reads (:attr:`_FORWARD_BUFFERS`, by reference: a fold never writes into a buffer that a forward
        or a backward may still read, :meth:`_set_fold_buffer`).

        A forward recomputed inside a backward (activation checkpointing, :func:`recomputing`) is not a batch: it
        reads the buffers of the layer's last original forward, so its output and the transform its backward uses
        are those of that forward even if a fold came in between (the fold follows the model's forward).
        """
        if _is_compiling():  # traced: no recomputation to track, and inference_mode cannot be traced
            return self.training, {name: self._buffers[name] for name in self._FORWARD_BUFFERS}
        if recomputing():
            state = self._in_force
            if state is None:  # no original forward seen (e.g. state loaded since): what is in force now
                state = {name: self._buffers[name] for name in self._FORWARD_BUFFERS}
            return False, state
        buffers = self._buffers
        state = {name: buffers[name] for name in self._FORWARD_BUFFERS}
        self.__dict__["_in_force"] = state  # a plain attribute (Module.__setattr__ costs more than this method)
        # Under torch.inference_mode a training-mode forward gathers nothing and counts nothing: a fold there would
        # store inference tensors as state, which the next training step cannot use (docs/robustness.md).
        return self.training and not torch.is_inference_mode_enabled(), state

    def __getstate__(self) -> Dict[str, Any]:
        # The buffers of the last forward and the weight of a fold under way are transient: not pickled or copied.
        state = dict(self.__dict__)
        for transient in ("_in_force", "_fold_weight", "_mean_taps", "_pointwise_cache", "_spares", "_deferred_grad",
                          "_deferred_q"):  # a copy is stepped by no optimizer of the deferral (defer_grad_transform)
            state.pop(transient, None)
        if state.get("_acc_aug") is not None:  # views of it: made again on load (a pickle would copy them apart)
            state.pop("_acc_s1", None)
            state.pop("_acc_s2", None)
            state.pop("_acc_blocks", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        aug = self.__dict__.get("_acc_aug")
        if aug is not None:
            self._set_accumulator(aug)

    def __prepare_scriptable__(self) -> Any:
        raise RuntimeError(
            f"{self._describe()}: torch.jit.script cannot compile a whitening layer (its forward gathers statistics "
            "and folds blocks in Python). To deploy, script the plain model: "
            "torch.jit.script(wl.to_plain_model(copy.deepcopy(model)).eval()); to trace or compile the converted model "
            "use torch.jit.trace, torch.export.export or torch.compile")

    # ---------------------------------------------------------- configuration
    @property
    def config(self) -> WhiteningConfig:
        """The layer's hyper-parameters (a frozen :class:`~whitenlayers.config.WhiteningConfig`)."""
        return self.rule.config

    @config.setter
    def config(self, value: WhiteningConfig) -> None:
        self.rule = type(self.rule)(value)  # type-checked by the rule

    @property
    def method(self) -> str:
        """The transform rule's name, ``"evd"`` or ``"recursive"``."""
        return self.rule.name

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

    @property
    def _block_shape(self) -> tuple:
        """Shape of the per-group matrices: ``(M, M)``, or ``(G, M/G, M/G)`` for ``groups > 1``."""
        return F_w.block_shape(self.num_features, self.groups)

    # ------------------------------------------------------------------ naming
    def _describe(self) -> str:
        name = f" '{self.layer_name}'" if self.layer_name else ""
        groups = f", groups={self.groups}" if self.groups != 1 else ""
        return f"{type(self).__name__}{name} (num_features={self.num_features}{groups})"

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{self._describe()}: {message}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ accumulators
    def _reset_accumulators(self, device=None) -> None:
        zero = self._clear_block(device)
        if zero:
            torch._foreach_zero_(zero)

    def _clear_block(self, device=None) -> List[Tensor]:
        """Start an empty block (on ``device``, default the buffers'); returns the accumulators the caller must
        zero (in place: no fresh allocation, and its page faults, at every fold; the fold zeroes those of many
        layers in one multi-tensor op)."""
        dev = self.running_mean.device if device is None else torch.device(device)
        # Plain attributes, written straight into the instance dict (as in _end_batch): at every fold, per layer.
        self.__dict__.update(
            _acc_batches=0,
            _gather_next=True,
            _acc_count=0.0,  # rows (samples x positions) gathered: known from shapes, no device op
            _acc_shift=None,
            _acc_shift_x=None,  # the shift as the batches subtract it (None: unshifted)
            _fold_pending=False,
        )
        zero = []
        if self.groups == 1:  # one augmented accumulator (functional.accumulate_moments); s1, s2 are its views
            aug, m1 = self.__dict__.get("_acc_aug"), self.num_features + 1
            dtype = self._acc_dtype()
            if aug is not None and aug.device == dev and aug.shape == (m1, m1) and aug.dtype == dtype:
                zero.append(aug if aug._base is None else aug._base)  # its storage, padding too: a dense tensor
            else:
                self._set_accumulator(F_w.moments_accumulator(self.num_features, dtype, dev))
            return zero
        s1, s2 = getattr(self, "_acc_s1", None), getattr(self, "_acc_s2", None)
        if s1 is not None and s1.device == dev and s1.shape == (self.num_features,):
            zero.append(s1)
        else:
            self._acc_s1 = torch.zeros(self.num_features, dtype=torch.float64, device=dev)
        if s2 is not None and s2.device == dev and tuple(s2.shape) == self._block_shape:
            zero.append(s2)
        else:
            self._acc_s2 = torch.zeros(self._block_shape, dtype=torch.float64, device=dev)
        return zero

    # The current block's plain state (:meth:`_clear_block` resets it; written through the instance dict).
    #: The block's shift ``k`` (float64; ``None``: chosen at its first gathered batch).
    _acc_shift: Optional[Tensor] = None
    #: The shift as the batches subtract it (their dtype and rank; ``None``: unshifted, or not made yet).
    _acc_shift_x: Optional[Tensor] = None
    _acc_batches: int
    _acc_count: float
    _fold_pending: bool

    #: ``groups=1``: the block's sums, ``(M + 1, M + 1)`` (``s2``, ``s1`` and the row count; ``_acc_s1`` and
    #: ``_acc_s2`` are views of it). ``None`` for grouped layers (float64 ``_acc_s1``, ``_acc_s2`` of their own).
    _acc_aug: Optional[Tensor] = None
    #: ``_acc_aug``'s ``s2`` block and its ``s1`` column ``(M, 1)``, the out tensors of the hot path's products.
    _acc_blocks: Tuple[Tensor, Tensor]

    def _acc_dtype(self) -> torch.dtype:
        """The dtype a block's sums accumulate in: the input's (float32, float64 for a float64 layer)."""
        return torch.float64 if self.running_mean.dtype == torch.float64 else torch.float32

    def _set_accumulator(self, aug: Tensor) -> None:
        self._acc_aug = aug
        self._acc_s2 = aug[:-1, :-1]
        self._acc_s1 = aug[:-1, -1]
        # The blocks the eager hot path's two products write into, sliced once here (Python indexing costs
        # about a microsecond per slice, four per layer per step): s2 and s1 as a column.
        self._acc_blocks = (self._acc_s2, aug[:-1, -1:])

    def _add_sums(self, x: Tensor, shift_x: Optional[Tensor]) -> None:
        """Add the batch ``x``'s sums about ``shift_x`` (``None``: about 0) to the block's accumulators."""
        if self._acc_aug is not None:
            F_w.accumulate_moments(self._acc_aug, x, shift_x)
            return
        s1, s2 = F_w.batch_sums(x, shift_x, self.groups)
        self._acc_s1.add_(s1)  # float64 accumulators: one mixed-dtype add each
        self._acc_s2.add_(s2)

    def _gathers_now(self) -> bool:
        """Whether this training forward gathers statistics: the first of every ``stats_every`` of the block."""
        return self._acc_batches % self.config.stats_every == 0

    def _accumulate(self, x: Tensor) -> None:
        """Add one batch (``x`` with features on dim 1) to the block's sums.

        The hot path: the batch's sums about the block's shift (one product, one sum; a subtraction unless the
        layer sums unshifted) added to float64 accumulators. No host synchronisation, no per-batch checks: a
        non-finite batch makes its block's sums non-finite, and the fold drops that block (counted).
        """
        if self.frozen:
            return
        if _is_compiling():
            return self._accumulate_traced(x)
        if self._fold_pending:  # a requested fold whose coordinator never ran
            self._fold_now()
        if not self._gathers_now():
            return
        self._add_batch(x)

    def _stats_batch(self, x: Tensor, low_precision: bool = False) -> Tensor:
        """The part of the batch ``x`` the statistics use: detached, float32 (or float64; ``low_precision``: a
        bf16 / fp16 batch stays as it is), its leading ``stats_fraction`` of samples."""
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64) and not low_precision:
            x = x.float()
        fraction = self.config.stats_fraction
        if fraction < 1.0 and x.shape[0] > 1:
            x = x[: stats_samples(x.shape[0], x[0].numel() // self.num_features, self.num_features, fraction)]
        return x

    def _add_batch(self, x: Tensor) -> None:
        """Add ``x``'s sums about the block's shift to the accumulators (the shift chosen at the block's first
        gathered batch); count its rows. A bf16 / fp16 batch summed about 0 reaches the product as it is where
        the device multiplies it into float32 (``functional.accumulate_moments``); otherwise it is converted to
        float32 first."""
        aug = self._acc_aug is not None
        x = self._stats_batch(x, low_precision=aug)
        if self._acc_s1.device != x.device:
            self._reset_accumulators_to(x.device)
        shift_x = self._acc_shift_x  # made for the rank of the block's first batch: made again for another rank
        if (aug and self._acc_shift is not None and F_w.fused_moments_on(x.device)
                and (self._stats_unshifted or (shift_x is not None and shift_x.dim() == x.dim()))):
            # The hot path, within a block: accumulate_moments' two-op path is in place or takes out= or an explicit
            # dtype, apart from a subtraction and (a contiguous NC... batch) a concatenation, none of which autocast
            # touches: no context. Eager only (_accumulate traces elsewhere): the accumulator's blocks as sliced
            # once (_set_accumulator).
            F_w.accumulate_moments(cast(Tensor, self._acc_aug), x, self._acc_shift_x, self._acc_blocks)
        else:
            with _no_autocast(x.device):  # under autocast, products would run (and overflow) in fp16/bf16
                if self._acc_shift is None:
                    self._start_block(x)
                elif not self._stats_unshifted and (shift_x is None or shift_x.dim() != x.dim()):
                    # a block resumed from a checkpoint, or a batch of another rank than the block's first
                    self._acc_shift_x = self._acc_shift.to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2))
                self._add_sums(x, self._acc_shift_x)
        self.__dict__["_acc_count"] = self._acc_count + x.numel() // self.num_features  # a plain counter

    # ------------------------------------------------------------ torch.compile
    # Inside a compiled graph a layer reads no Python number that changes from step to step (dynamo would guard on
    # it and recompile at every step of a block). The graph holds the tensor work only: the batch's sums added to
    # the accumulators (always about a shift, the mean in force, never the unshifted product: no per-layer flag that
    # could change between blocks). It writes down, as Python attributes that it never reads, that the layer was
    # called and how many rows it gathered; the model's FoldCoordinator, a forward hook that runs outside the graph
    # (torch.compiler.disable), then counts the batch, keeps the block's row count and folds at the block's end, as
    # an eager layer does for itself. A layer without a coordinator (built alone, not by convert_model) leaves the
    # graph for that bookkeeping: a graph break per layer, still no recompilation.
    _traced_seen = False
    _traced_rows = 0
    #: Whether the next training forward gathers statistics (``stats_every``), kept by the eager bookkeeping.
    _gather_next = True

    def _accumulate_traced(self, x: Tensor) -> None:
        if self._fold_coordinator is None:
            return _eager(WhiteningLayer._accumulate_eager)(self, x)
        if not self._gather_next:  # stats_every > 1: a guard with two values, two graphs at most
            self._traced_rows = 0
            return
        # A bf16 / fp16 batch, where the device multiplies it into float32 (tried before the trace): its float32
        # differences from the shift split in two low-precision numbers, multiplied on tensor cores
        # (functional.accumulate_moments_split; the float32 product of every layer would run on SIMT cores).
        aug = self._acc_aug
        lowp = (aug is not None and aug.dtype == torch.float32 and x.dtype in LOW_PRECISION
                and F_w.fused_moments_on(x.device) and low_precision_products_known(x.device))
        x = self._stats_batch(x, low_precision=lowp)
        with _no_autocast(x.device):
            if self._acc_shift is None:  # the first block's first batch (or after a reset): a second graph, once
                self._start_block(x, shifted=True)
            # the shift as x subtracts it, made in the graph (one small cast; no attribute that may be None)
            shift_x = cast(Tensor, self._acc_shift).to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2))
            if lowp:
                F_w.accumulate_moments_split(cast(Tensor, aug), x, shift_x)
            else:
                self._add_sums(x, shift_x)
        self._traced_rows = x.numel() // self.num_features

    def _accumulate_eager(self, x: Tensor) -> None:
        """:meth:`_accumulate` outside a compiled graph (a graph break; for a layer without a coordinator)."""
        if self._fold_pending:
            self._fold_now()
        if self._gathers_now():
            self._add_batch(x)

    def _count_traced_batch(self) -> None:
        """The coordinator, outside the graph, after a compiled forward that called this layer: what
        :meth:`_add_batch` and :meth:`_end_batch` count in eager mode."""
        self._traced_seen = False
        self.__dict__["_double_buffered"] = True  # its folds keep the forward's buffers at two addresses each
        self._acc_count += self._traced_rows
        self._traced_rows = 0
        self._end_batch()

    def _start_block(self, x: Tensor, shifted: bool = False) -> None:
        """Choose the block's shift at its first gathered batch (once per block): zero when the layer sums
        unshifted, else the mean in force, or for the very first block this batch's mean (0 where it is not
        finite, so that one bad batch cannot poison the block's other batches). Chosen on the device: no host
        synchronisation, no graph break under torch.compile."""
        m = self.num_features
        if not shifted and self._stats_unshifted:  # `shifted` first: a traced block start never reads the flag
            self._acc_shift = torch.zeros(m, dtype=torch.float64, device=x.device)
            self._acc_shift_x = None
            return
        if x.numel() > 0:
            dims = [0] + list(range(2, x.dim()))
            first = torch.nan_to_num(x.mean(dims, dtype=_work_dtype(x)).to(torch.float64), nan=0.0, posinf=0.0,
                                     neginf=0.0)
        else:
            first = torch.zeros(m, dtype=torch.float64, device=x.device)
        in_force = self.running_mean.detach().to(device=x.device, dtype=torch.float64)
        self._acc_shift = torch.where(self.num_blocks.to(x.device) > 0, in_force, first)
        self._acc_shift_x = self._acc_shift.to(_work_dtype(x)).view((1, m) + (1,) * (x.dim() - 2))

    def _reset_accumulators_to(self, device) -> None:
        if self._acc_s1.is_meta:  # accumulators left on the meta device hold nothing: a new, empty block
            self._reset_accumulators(device)
            return
        self._move_accumulators(lambda t: t.to(device))

    def _move_accumulators(self, fn) -> None:
        """Apply ``fn`` (a move, ``to_empty``) to the partial block's tensors, keeping their dtypes."""
        sums = ("_acc_aug",) if self._acc_aug is not None else ("_acc_s1", "_acc_s2")
        names = ("_acc_shift", "_acc_shift_x") + sums
        for name in names:
            old = self.__dict__.get(name)
            if old is not None:
                new = fn(old)
                self.__dict__[name] = new if new.dtype == old.dtype else old.to(device=new.device)
        aug = self._acc_aug
        if aug is not None:
            # A float32 <-> float64 cast of the layer (the block's sums follow its statistics), or a move that
            # copied the accumulator contiguous: again as moments_accumulator's aligned rows.
            self._set_accumulator(_as_moments_accumulator(aug, self._acc_dtype()))

    def _end_batch(self) -> None:
        """Count one training forward; fold (or ask the coordinator to) at the block's end."""
        if self.frozen:
            return
        if _is_compiling():
            if self._fold_coordinator is None:
                return _eager(WhiteningLayer._end_batch)(self)
            self._traced_seen = True  # counted by the coordinator after the graph (a write only: no guard)
            return
        # Plain counters written straight into the instance dict: Module.__setattr__ (which looks for a parameter,
        # buffer or submodule of the name first) cost more than the rest of this method, per layer per step.
        attrs, config = self.__dict__, self.config
        batches = attrs["_acc_batches"] = self._acc_batches + 1
        attrs["_gather_next"] = batches % config.stats_every == 0
        if batches >= config.block_size * config.accumulation_steps:
            self._fold_pending = True
            self._capture_fold_inputs()
            if self._fold_coordinator is not None:
                self._fold_coordinator.request(self)
            else:
                fold_layers([self])

    def _capture_fold_inputs(self) -> None:
        """Hook: keep what the coming fold needs from this forward (grad layers: the weight, which a sharded
        wrapper gathers only during the forward)."""

    def _fold_now(self) -> None:
        """Fold this layer alone, now (not at the end of the forward that ended its block)."""
        self._fold_weight = None
        fold_layers([self])

    _fold_weight: Optional[Tensor] = None

    def _block_sums(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """This rank's block: ``(count, shift, s1, s2)``, the shifted sums (float64)."""
        shift = self._acc_shift if self._acc_shift is not None else torch.zeros_like(self._acc_s1)
        count = torch.tensor(self._acc_count, dtype=torch.float64, device=self._acc_s1.device)
        return count, shift, self._acc_s1.to(torch.float64), self._acc_s2.to(torch.float64)

    def _block_nonfinite(self) -> Tensor:
        """``1.0`` when this rank's block sums are not finite (a batch with non-finite values, or products that
        overflow the input's precision), else ``0.0``: float64, on the device (checked once per block)."""
        return ((self._acc_s1.sum() + self._acc_s2.sum()) * 0 != 0).to(torch.float64)  # x * 0: NaN for NaN, Inf

    def _block_summary(self) -> BlockSummary:
        return F_w.summarize_block(*self._block_sums())

    # -------------------------------------------------------------------- fold
    # :mod:`whitenlayers.fold` computes a fold for stacks of layers (moments, transforms, Q_s) from the layers'
    # blocks and buffers; the layer's part: _begin_fold (every rank: counters, an empty block) and _fold_finish
    # (every rank: writes the outcome, counters, bias compensation).
    def _rule_batch_key(self) -> Optional[Hashable]:
        if self.groups != 1:
            return self.rule.batch_key(self.num_features, self.running_mean.dtype, self.running_mean.device,
                                       groups=self.groups)
        return self.rule.batch_key(self.num_features, self.running_mean.dtype, self.running_mean.device)

    def _fold(self, block: BlockSummary) -> None:
        """Fold this layer alone on ``block`` (already summed over ranks): every step here, nothing sent."""
        nonfinite, firsts = _read_with_firsts(self._block_nonfinite().view(1), [self])  # one host synchronisation
        _fold_all([self], [block], [int(nonfinite[0])], firsts)

    def _begin_fold(self, nonfinite: int) -> List[Tensor]:
        """Count the ranks whose block had non-finite sums (``nonfinite``) and start an empty block; returns the
        accumulators to zero. Read the block's sums before."""
        if nonfinite:
            self.nonfinite_blocks += nonfinite
            self._warn_once("nonfinite", "a block with non-finite activations (or second moments that overflow "
                                         "the input's precision) was dropped: its fold was skipped and the "
                                         "transform kept")
        return self._clear_block()

    def _outcome_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """``(name, shape)`` of the buffers a fold's outcome may hold (:meth:`_fold_outcome`), in a fixed order."""
        names = ["running_cov", "whitening_matrix"] + (["grad_transform"] if hasattr(self, "grad_transform") else [])
        names += list(self.rule.initial_buffers(self.num_features, {"device": "meta"}, groups=self.groups))
        return [(name, tuple(getattr(self, name).shape)) for name in names]

    @torch.no_grad()
    def _fold_finish(self, outcome: FoldOutcome, mean: Tensor, delta: Tensor, unshifted: bool, shift: Tensor) -> bool:
        """Write a fold's ``outcome`` (a skipped fold, a failed transform: the previous one is kept, and
        counted), the new mean ``mean`` (as stored, a tensor of its own), the bias compensation for the mean's
        change ``delta`` (float64), whether the next block sums unshifted and that block's shift ``shift``
        (float64, a tensor of its own: 0 when ``unshifted``, else ``mean``). ``outcome.buffers`` are taken as
        they are (tensors of their own, ``fold._stored_all``). Returns whether the block counts (the caller adds
        it to ``num_blocks``, many layers in one op); ``False`` for a skipped fold."""
        if outcome.status in SKIP_MESSAGES:
            self.skipped_folds += 1
            if SKIP_MESSAGES[outcome.status]:
                self._warn_once("skip", cast(str, SKIP_MESSAGES[outcome.status]))
            return False
        if outcome.status == FAILED:
            self.eig_failures += 1
            self._warn_once("transform", self.rule.failure_message)
        for name, value in outcome.buffers.items():
            self._set_fold_buffer(name, value)
        self._on_mean_change(delta)
        self._set_fold_buffer("running_mean", mean)
        # Plain attributes, written straight into the instance dict (as in _end_batch). The next block's shift, as
        # its first gathered batch would choose it (_start_block after a counted fold): chosen here, a compiled
        # graph needs no second variant for a block's first batch.
        self.__dict__.update(clamped_steps=self.clamped_steps + int(outcome.clamped), _stats_unshifted=unshifted,
                             _acc_shift=shift, _acc_shift_x=None)
        return True

    def _set_fold_buffer(self, name: str, value: Tensor) -> None:
        """Set buffer ``name`` to a fold's new ``value``, a tensor of its own.

        A fold never writes into a tensor that a forward or a backward may still read: a backward still to come
        may hold the old tensor (``torch.compile`` saves the buffer itself for the backward rather than the
        forward's clone of it, and an in-place update would make that backward fail, or use the new transform);
        DDP re-reads reassigned buffers before each sync. A layer that runs inside compiled graphs
        (``torch.compile``) keeps each of its forward's buffers (:attr:`_FORWARD_BUFFERS`) to two tensors: the
        new value goes into the tensor the buffer held before the previous fold (the spare) when nothing else
        holds that tensor any more (no other Python reference, no autograd graph that saved it, no view), and
        the tensor the buffer held becomes the next spare. CUDA graph trees (``mode="reduce-overhead"``) read a
        buffer as a static input at a fixed address and record the graph again when the address changes: two
        addresses are two recordings in all, where a new tensor at every fold is a new recording at every block.
        Eager layers take the new tensor (no spare kept: no memory spent).
        """
        if not (self.__dict__.get("_double_buffered") and name in self._FORWARD_BUFFERS):
            self._replace_buffer(name, value)
            return
        spares: Dict[str, Tensor] = self.__dict__.setdefault("_spares", {})
        old = self._buffers.get(name)
        spare = spares.pop(name, None)
        # no Python reference to the spare but `spare` (the refcount of a tensor held by one local variable)
        if (spare is not None and sys.getrefcount(spare) == _SOLE_REFCOUNT and _unshared(spare)
                and spare.shape == value.shape and spare.dtype == value.dtype and spare.device == value.device):
            value = spare.copy_(value)
        self._replace_buffer(name, value)
        if old is not None and old is not value:
            spares[name] = old

    def _replace_buffer(self, name: str, value: Tensor) -> None:
        """``self.<name> = value`` for an existing buffer: straight into ``_buffers`` (what ``Module.__setattr__``
        ends in, after lookups that cost more than the rest of a fold's write; ~7 writes per layer per fold),
        through ``setattr`` where a buffer registration hook is installed
        (``torch.nn.modules.module.register_module_buffer_registration_hook``), which must see the write."""
        if _buffer_registration_hooks:
            setattr(self, name, value)
        else:
            self._buffers[name] = value

    def _on_mean_change(self, delta: Tensor) -> None:
        """Hook for layers that must keep their function when the mean in force changes by ``delta`` (float64)."""

    # ------------------------------------------------------------- public API
    def fold(self, block: Optional[BlockSummary] = None) -> None:
        """Fold the current (possibly partial) block now, as if the block had ended.

        Either way the layer starts a new, empty block.

        Args:
            block: a block summary to fold instead of the accumulated block (from :meth:`block_statistics`,
                e.g. to time one layer's fold on the same block again and again); nothing is summed across
                ranks then. Default ``None``: the accumulated block, summed across ranks under
                ``torch.distributed``.
        """
        if block is None:
            self._fold_now()
        else:
            self._fold(block)

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
        self._accumulate(x)

    def block_statistics(self) -> BlockSummary:
        """This rank's current block as a :class:`~whitenlayers.functional.BlockSummary` (count, mean, scatter)."""
        return self._block_summary()

    def discard_block(self) -> None:
        """Drop the current partial block (its statistics and its batch count); the state in force is kept."""
        self._reset_accumulators()

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
        self._mean_taps = None
        self._pointwise_cache = None
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
        own = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in own.items():
            new = self._buffers.get(name)
            if new is not None and new.dtype != old.dtype and new.dtype not in (torch.float32, torch.float64):
                self._buffers[name] = old.to(device=new.device)
        if "_acc_s1" in self.__dict__:
            self._move_accumulators(fn)
        self._acc_shift_x = None  # the shift as batches subtract it: made again from _acc_shift at the next batch
        _try_low_precision_products(self.running_mean.device)
        self.__dict__.pop("_spares", None)  # the next folds' spares on the new device / dtype
        self._in_force = None
        self._mean_taps = None
        self._pointwise_cache = None
        return result

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

    # ---------------------------------------------------------- checkpointing
    def get_extra_state(self) -> Tensor:
        """The partial block and the counters as one float64 tensor, so a mid-block checkpoint resumes bit-for-bit.

        Layout: the scalars ``_EXTRA_HEAD`` (a layout tag first), then the block's shift (``M``), first sums
        (``M``) and second sums (the block shape, flattened). A tensor, not a dict, so the state dict holds
        tensors only (EMA helpers, safetensors and exporters iterate over it as tensors); a fresh one at each
        call, owned by nobody.
        """
        f64: Dict[str, Any] = {"dtype": torch.float64, "device": self.running_mean.device}
        head = torch.tensor([_EXTRA_LAYOUT, self._acc_batches, self._acc_shift is not None]
                            + [getattr(self, name) for name in _COUNTERS] + [self._acc_count, self._stats_unshifted],
                            **f64)
        shift = self._acc_shift if self._acc_shift is not None else torch.zeros_like(self._acc_s1)
        sums = [shift, self._acc_s1, self._acc_s2.reshape(-1)]
        return torch.cat([head] + [t.to(device=head.device, dtype=torch.float64) for t in sums])

    def set_extra_state(self, state: Union[Tensor, Dict[str, Any]]) -> None:
        """Restore the partial block and the counters (``load_state_dict`` calls this).

        Args:
            state: what :meth:`get_extra_state` returned (a float64 tensor), or the dict of a version-1
                checkpoint.
        """
        if isinstance(state, dict):  # version 1 checkpoints
            state = self._unpack_dict_extra_state(state)
        else:
            state = self._unpack_extra_state(state)
        dev = self.running_mean.device
        self._acc_batches = int(state["acc_batches"])
        self._gather_next = self._acc_batches % self.config.stats_every == 0
        self._acc_count = float(state["acc_count"])
        self._stats_unshifted = bool(state.get("stats_unshifted", False))
        shift = state["acc_shift"]
        self._acc_shift = None if shift is None else shift.to(dev, torch.float64).clone()
        self._acc_shift_x = None  # set from the shift at the next gathered batch (its dtype and rank)
        if self.groups == 1:  # the augmented accumulator, in its own dtype (exact for sums it had written)
            m = self.num_features
            aug = F_w.moments_accumulator(m, self._acc_dtype(), dev)
            aug[:m, :m] = state["acc_s2"]
            aug[:m, m] = state["acc_s1"]
            aug[m, :m] = state["acc_s1"]
            aug[m, m] = self._acc_count
            self._set_accumulator(aug)
        else:
            self._acc_s1 = state["acc_s1"].to(dev, torch.float64).clone()
            self._acc_s2 = state["acc_s2"].to(dev, torch.float64).clone()
        for name in _COUNTERS:
            setattr(self, name, int(state.get(name, 0)))
        self._fold_pending = False

    def _unpack_extra_state(self, packed: Tensor) -> Dict[str, Any]:
        m, block = self.num_features, self._block_shape
        numel = len(_EXTRA_HEAD) + 2 * m + math.prod(block)
        if not isinstance(packed, Tensor) or packed.dim() != 1 or not packed.is_floating_point():
            raise RuntimeError(f"{self._describe()}: checkpoint extra state must be a 1-D float tensor (the partial "
                               f"block), but got {type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}")
        if packed.numel() < len(_EXTRA_HEAD) or int(packed[0]) != _EXTRA_LAYOUT:
            raise RuntimeError(f"{self._describe()}: checkpoint extra state has an unknown layout "
                               f"(tag {float(packed[0]) if packed.numel() else None}, expected {_EXTRA_LAYOUT})")
        if packed.numel() != numel:
            raise RuntimeError(
                f"{self._describe()}: checkpoint extra state holds {packed.numel()} values, but this layer needs "
                f"{numel}: block statistics of shape {block} ({_shape_words(block)}) for {m} features")
        head = dict(zip(_EXTRA_HEAD, packed[: len(_EXTRA_HEAD)].tolist()))
        shift, s1, s2 = torch.split(packed[len(_EXTRA_HEAD):], [m, m, math.prod(block)])
        out: Dict[str, Any] = {name: head[name] for name in _COUNTERS}
        out.update(acc_batches=head["acc_batches"], acc_count=head["acc_count"],
                   stats_unshifted=head["stats_unshifted"], acc_shift=shift if head["has_shift"] else None,
                   acc_s1=s1, acc_s2=s2.view(block))
        return out

    def _unpack_dict_extra_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        if tuple(state["acc_s2"].shape) != self._block_shape:
            raise RuntimeError(
                f"{self._describe()}: checkpoint block statistics have shape {tuple(state['acc_s2'].shape)} "
                f"({_shape_words(tuple(state['acc_s2'].shape))}), but this layer needs {self._block_shape} "
                f"({_shape_words(self._block_shape)})"
            )
        state = dict(state)
        state["nonfinite_blocks"] = state.get("nonfinite_batches", 0)  # version 1 counted batches
        state["acc_count"] = float(state["acc_count"])
        return state

    def _method_name(self) -> str:
        """``"grad"``, ``"recursive"`` or ``"direct"``: :func:`~whitenlayers.convert_model`'s name of the method."""
        if self.rule.name == "recursive":
            return "recursive"
        return "grad" if "grad_transform" in self._buffers else "direct"

    def _checkpoint_method(self, state_dict: Dict[str, Any], prefix: str) -> Tuple[Optional[str], str]:
        """What the checkpoint holds in this layer's place, and where: ``"grad"``, ``"recursive"``, ``"direct"``,
        ``"plain"`` (an unconverted layer) or ``None`` (nothing there). A direct layer sits at ``<name>.whiten.``,
        a grad or recursive one at ``<name>.`` (PyTorch hands a module only the keys under its prefix: the direct
        wrapper checks for its whitening layer, :class:`~whitenlayers.DirectWhitenWrapper`)."""
        place = prefix[: -len("whiten.")] if self._method_name() == "direct" and prefix.endswith("whiten.") else prefix
        where = place[:-1] or "<root>"
        for found in (place, place + "whiten."):
            if any(found + name in state_dict for name in _RECURSIVE_KEYS):
                return "recursive", where
            if found + "grad_transform" in state_dict:
                return "grad", where
            if found + "whitening_matrix" in state_dict:
                return "direct", where
        if place + "weight" in state_dict:
            return "plain", where
        return None, where

    def _check_checkpoint_method(self, state_dict: Dict[str, Any], prefix: str, error_msgs: List[str]) -> None:
        """A checkpoint of another method (or of the plain model) in this layer's place: an error that names both
        (a strict load), or a warning (``strict=False``, where PyTorch would drop the other method's keys
        silently)."""
        (theirs, where), mine = self._checkpoint_method(state_dict, prefix), self._method_name()
        if theirs is None or theirs == mine or (theirs == "plain" and _loading_plain[0]):
            return
        if theirs == "plain":
            if mine == "direct":
                return  # a plain layer's keys at the wrapper's place: the wrapped layer's own check (missing keys)
            msg = (f"{self._describe()}: the checkpoint holds a plain (unconverted) layer at '{where}', but this "
                   f"model's layer there is a '{mine}' whitening layer; load it with "
                   "wl.load_plain_state_dict(model, state_dict)")
        else:
            msg = (f"{self._describe()}: the checkpoint holds a '{theirs}' whitening layer at '{where}', but this "
                   f"model's layer there is '{mine}'; convert the model with method={theirs!r} before loading")
        if _strict_load():
            error_msgs.append(msg)
        else:
            warnings.warn(msg + " (strict=False: the whitening state of the other method is not loaded; only keys "
                                "with the same names are)", UserWarning, stacklevel=4)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._check_checkpoint_method(state_dict, prefix, error_msgs)
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
        ckey = prefix + "running_cov"
        if ckey in state_dict and tuple(state_dict[ckey].shape) != self._block_shape:
            shape = tuple(state_dict[ckey].shape)
            error_msgs.append(
                f"{self._describe()}: checkpoint '{ckey}' has shape {shape} ({_shape_words(shape)}), "
                f"but this layer needs {self._block_shape} ({_shape_words(self._block_shape)})"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _shape_words(shape: tuple) -> str:
    """What a per-group matrix shape means, for error messages."""
    if len(shape) == 3:
        return f"groups={shape[0]} of {shape[1]} features"
    return "groups=1" if len(shape) == 2 else "unknown layout"


def _config_attribute(name: str) -> property:
    def get(self: WhiteningLayer) -> Any:
        return getattr(self.config, name)  # AttributeError for a field this layer's rule does not have

    def set(self: WhiteningLayer, value: Any) -> None:
        self.config = self.config.replace(**{name: value})

    return property(get, set, doc=f"``config.{name}``; assigning replaces the config (validated).")


for _name in dict.fromkeys(EVDConfig.field_names() + RecursiveConfig.field_names()):
    setattr(WhiteningLayer, _name, _config_attribute(_name))
del _name

__getattr__ = module_getattr("whitenlayers.stats", "WhiteningStatistics")
