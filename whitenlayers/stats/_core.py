"""What every part of a whitening layer's state shares: the class attributes and buffers it declares, its config,
its name in messages. Part of :mod:`whitenlayers.stats`."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .. import functional as F_w
from ..config import WhiteningConfig
from ..rules import TransformRule

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self

    from ..coordinator import FoldCoordinator

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

def _try_low_precision_products(device: torch.device) -> None:
    """Try, once per process, whether ``device`` multiplies bf16 / fp16 operands into float32, where the layers are
    built or moved (outside any traced graph: a compiled layer only reads the answer)."""
    if device.type == "cuda" and not _is_compiling():
        F_w.low_precision_products_on(device)


class _LayerCore:
    """The base of :class:`~whitenlayers.WhiteningLayer`'s parts (per-step path, block life cycle, state
    I/O): the attributes they share and the few methods they all call."""

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
        _parameters: Dict[str, Any]
        _modules: Dict[str, Any]

        def register_buffer(self, name: str, tensor: Optional[Tensor], persistent: bool = True) -> None: ...

        def named_buffers(self, prefix: str = "", recurse: bool = True,
                          remove_duplicate: bool = True) -> Iterator[Tuple[str, Tensor]]: ...

        def extra_repr(self) -> str: ...

        def train(self, mode: bool = True) -> Self: ...

        # Provided by the other parts of WhiteningLayer (stats/step.py, stats/block.py, stats/state_io.py).
        groups: int
        layer_name: Optional[str]
        process_group: Any
        frozen: bool
        eig_failures: int
        skipped_folds: int
        nonfinite_blocks: int
        clamped_steps: int
        _stats_unshifted: bool
        _warned: set
        _fold_coordinator: Optional[FoldCoordinator]
        _acc_s1: Tensor
        _acc_s2: Tensor
        _gather_next: bool
        _traced_calls: List[int]

        def _fold_now(self) -> None: ...

        def _flush_handed(self) -> None: ...

        def _reset_accumulators(self, device: Any = None) -> None: ...

        def _reset_accumulators_to(self, device: Any) -> None: ...

        def _set_accumulator(self, aug: Tensor, dense: Optional[Tensor] = None) -> None: ...

        def _move_accumulators(self, fn: Any) -> None: ...

        def _on_mean_change(self, delta: Tensor) -> None: ...

        def _outcome_layout(self) -> List[Tuple[str, Tuple[int, ...]]]: ...

        def _start_block(self, x: Tensor, shifted: bool = False) -> None: ...

        def _end_batch(self) -> None: ...

        def _add_sums(self, x: Tensor, shift_x: Optional[Tensor]) -> None: ...

        def _accumulate(self, x: Tensor) -> None: ...

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


    _fold_weight: Optional[Tensor] = None
    #: A fold computed but not written yet (:class:`~whitenlayers.fold.PendingFold`: an asynchronous coordinator's,
    #: or one loaded from a checkpoint taken while it was in flight), written at this layer's next block end.
    _pending_fold: Optional[Any] = None

    # ---------------------------------------------------------- configuration
    @property
    def config(self) -> WhiteningConfig:
        """The layer's hyper-parameters (a frozen :class:`~whitenlayers.config.WhiteningConfig`)."""
        return self.rule.config

    @config.setter
    def config(self, value: WhiteningConfig) -> None:
        self._check_config(value)
        self.rule = type(self.rule)(value)  # type-checked by the rule

    def _check_config(self, config: WhiteningConfig) -> None:
        """Hook: ``ValueError`` for a config this layer class cannot use (``DirectWhiten``: damped gains)."""

    @property
    def method(self) -> str:
        """The transform rule's name (:attr:`~whitenlayers.TransformRule.name`): ``"evd"``, ``"recursive"``
        or a rule of one's own."""
        return self.rule.name

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

    def _acc_dtype(self) -> torch.dtype:
        """The dtype a block's sums accumulate in: the input's (float32, float64 for a float64 layer)."""
        return torch.float64 if self.running_mean.dtype == torch.float64 else torch.float32
