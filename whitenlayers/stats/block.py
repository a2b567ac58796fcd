"""A whitening layer's block: its accumulators, and its side of a fold.

A block starts empty (:meth:`~_BlockMixin._clear_block`), gathers the sums of ``block_size`` training forwards
(:mod:`whitenlayers.stats.step`) and ends in a fold: :mod:`whitenlayers.fold` computes the new moments and
transform for stacks of layers at once from each layer's :meth:`~_BlockMixin._block_sums`; the layer's part is
:meth:`~_BlockMixin._begin_fold` (counters, an empty block) and :meth:`~_BlockMixin._fold_finish` (the outcome
written into its buffers, the bias compensation). The public block API (:meth:`~_BlockMixin.fold`,
:meth:`~_BlockMixin.accumulate`, ...) is here too. Part of :mod:`whitenlayers.stats`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Tuple, cast

import torch
from torch import Tensor

from .. import functional as F_w
from ..fold import (
    FAILED,
    SKIP_MESSAGES,
    FoldOutcome,
    _fold_all,
    _note_nonfinite,
    _read_with_firsts,
    _warn_nonfinite,
    fold_layers,
)
from ..functional import BlockSummary
from ..functional.moments import _as_moments_accumulator
from ..rules import batch_key_of
from ._core import _LayerCore

if TYPE_CHECKING:  # pragma: no cover
    from .layer import WhiteningLayer

#: ``Module``'s global buffer registration hooks (torch 2.0+), which a buffer written past ``setattr`` would skip.
_buffer_registration_hooks: Dict[int, Any] = getattr(torch.nn.modules.module, "_global_buffer_registration_hooks",
                                                     {})


def _owned(value: Tensor, old: Tensor) -> Tensor:
    """``value`` as buffer ``old`` stores it (its device and dtype), a contiguous tensor of its own."""
    new = value.to(device=old.device, dtype=old.dtype)
    if new.data_ptr() == value.data_ptr() or not new.is_contiguous():
        new = new.clone(memory_format=torch.contiguous_format)
    return new


class _BlockMixin(_LayerCore):
    """The block of :class:`~whitenlayers.WhiteningLayer` and its side of a fold (this module's docstring)."""

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
        shift = self.__dict__.get("_acc_shift")
        if shift is not None and shift.device == dev:  # the next fold writes the next block's shift into it
            self.__dict__["_shift_store"] = shift       # (_fold_finish), and a compiled forward sums about it
        else:
            store = self.__dict__.get("_shift_store")
            if store is None or store.device != dev:  # a first block: made here, before any compiled forward
                self.__dict__["_shift_store"] = torch.zeros(self.num_features, dtype=torch.float64, device=dev)
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
                zero.append(self.__dict__.get("_acc_dense", aug))  # its storage, padding too: a dense tensor
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

    def _set_accumulator(self, aug: Tensor, dense: Optional[Tensor] = None) -> None:
        """Make ``aug`` the block's augmented accumulator; ``dense``: the dense storage it views, which a new block
        zeroes (default: its base, a :func:`~whitenlayers.functional.moments_accumulator`'s padded rows; a slice of
        a fold coordinator's stacked accumulator passes its own rows)."""
        if dense is None:
            base = aug._base
            dense = base if base is not None and base.dim() == 2 and base.shape[0] == aug.shape[0] else aug
        self.__dict__["_acc_dense"] = dense
        self._acc_aug = aug
        self._acc_s2 = aug[:-1, :-1]
        self._acc_s1 = aug[:-1, -1]
        # The blocks the eager hot path's two products write into, sliced once here (Python indexing costs
        # about a microsecond per slice, four per layer per step): s2 and s1 as a column.
        self._acc_blocks = (self._acc_s2, aug[:-1, -1:])

    def _reset_accumulators_to(self, device) -> None:
        if self._acc_s1.is_meta:  # accumulators left on the meta device hold nothing: a new, empty block
            self._reset_accumulators(device)
            return
        self._move_accumulators(lambda t: t.to(device))

    def _move_accumulators(self, fn) -> None:
        """Apply ``fn`` (a move, ``to_empty``) to the partial block's tensors, keeping their dtypes."""
        sums = ("_acc_aug",) if self._acc_aug is not None else ("_acc_s1", "_acc_s2")
        names = ("_acc_shift", "_acc_shift_x") + sums
        attrs = self.__dict__
        shared = attrs.get("_shift_store") is not None and attrs.get("_shift_store") is attrs.get("_acc_shift")
        if not shared:
            names += ("_shift_store",)
        for name in names:
            old = attrs.get(name)
            if old is not None:
                new = fn(old)
                attrs[name] = new if new.dtype == old.dtype else old.to(device=new.device)
        if shared:  # the block's shift and the tensor a compiled forward sums about: still one tensor
            attrs["_shift_store"] = attrs["_acc_shift"]
        aug = self._acc_aug
        if aug is not None:
            # A float32 <-> float64 cast of the layer (the block's sums follow its statistics), or a move that
            # copied the accumulator contiguous: again as moments_accumulator's aligned rows.
            self._set_accumulator(_as_moments_accumulator(aug, self._acc_dtype()))

    def _fold_now(self) -> None:
        """Fold this layer alone, now (not at the end of the forward that ended its block); synchronously, a fold
        of an asynchronous coordinator that it still has pending written first."""
        self._fold_weight = None
        self._flush_handed()  # the batches this forward's layers handed over, this one's too
        if self._fold_coordinator is not None:
            self._fold_coordinator.wait()
        fold_layers([cast("WhiteningLayer", self)])

    def _block_sums(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """This rank's block: ``(count, shift, s1, s2)``, the shifted sums (float64)."""
        shift = self._acc_shift if self._acc_shift is not None else torch.zeros_like(self._acc_s1)
        count = torch.tensor(self._acc_count, dtype=torch.float64, device=self._acc_s1.device)
        return count, shift, self._acc_s1.to(torch.float64), self._acc_s2.to(torch.float64)

    def _block_nonfinite(self) -> Tensor:
        """``1.0`` when this rank's block sums are not finite (a batch with non-finite values, or products that
        overflow the input's precision), else ``0.0``: float64, on the device (checked once per block)."""
        return ((self._acc_s1.sum() + self._acc_s2.sum()) * 0 != 0).to(torch.float64)  # x * 0: NaN for NaN, Inf

    def _flush_handed(self) -> None:
        """Add the batches that the layers handed to their fold coordinator in the forward under way (a read of the
        block inside the model's forward sees this layer's batches so far)."""
        coordinator = self._fold_coordinator
        if coordinator is not None and coordinator._scopes:
            coordinator.flush_stats()

    def _block_summary(self) -> BlockSummary:
        self._flush_handed()
        return F_w.summarize_block(*self._block_sums())

    # -------------------------------------------------------------------- fold
    # :mod:`whitenlayers.fold` computes a fold for stacks of layers (moments, transforms, Q_s) from the layers'
    # blocks and buffers; the layer's part: _begin_fold (every rank: counters, an empty block) and _fold_finish
    # (every rank: writes the outcome, counters, bias compensation).
    def _rule_batch_key(self) -> Optional[Hashable]:
        """The rule's batch key (:func:`~whitenlayers.rules.batch_key_of`: ``None`` for a rule class that does not
        batch its own results)."""
        return batch_key_of(self.rule, self.num_features, self.running_mean.dtype, self.running_mean.device,
                            self.groups)

    def _fold(self, block: BlockSummary) -> None:
        """Fold this layer alone on ``block`` (already summed over ranks): every step here, nothing sent."""
        layers = [cast("WhiteningLayer", self)]
        nonfinite, firsts = _read_with_firsts(self._block_nonfinite().view(1), layers)  # one host synchronisation
        _fold_all(layers, [block], [int(nonfinite[0])], firsts)
        _warn_nonfinite()

    def _begin_fold(self, nonfinite: int) -> List[Tensor]:
        """Count the ranks whose block had non-finite sums (``nonfinite``) and start an empty block; returns the
        accumulators to zero. Read the block's sums before."""
        self._count_nonfinite(nonfinite)
        return self._clear_block()

    def _count_nonfinite(self, nonfinite: int) -> None:
        """Count the ranks whose block had non-finite sums (``nonfinite``; an asynchronous fold counts them when it
        is written)."""
        if nonfinite:
            self.nonfinite_blocks += nonfinite
            _note_nonfinite(cast("WhiteningLayer", self))  # one warning for the fold's layers (fold._warn_nonfinite)

    def _block_parts(self) -> Tuple[float, Optional[Tensor], Tuple[Tensor, ...]]:
        """This block's row count, shift and sums as they lie (the augmented accumulator, or ``s1`` and ``s2``):
        what :func:`~whitenlayers.fold._taken_blocks` copies for an asynchronous fold."""
        aug = self._acc_aug
        return self._acc_count, self._acc_shift, (aug,) if aug is not None else (self._acc_s1, self._acc_s2)

    def _outcome_layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """``(name, shape)`` of the buffers a fold's outcome may hold (:meth:`_fold_outcome`), in a fixed order."""
        buffers = self._buffers  # (read without Module.__getattr__: at every asynchronous block end, per layer)
        names = ["running_cov", "whitening_matrix"] + (["grad_transform"] if "grad_transform" in buffers else [])
        names += self._rule_buffer_names()
        return [(name, tuple(buffers[name].shape)) for name in names]

    def _rule_buffer_names(self) -> List[str]:
        """The names of the rule's own buffers (:meth:`~whitenlayers.rules.Rule.initial_buffers`), kept with the rule
        they came from: building them (on the meta device) cost about 0.35 ms a layer, at every asynchronous fold."""
        cached = self.__dict__.get("_rule_buffers")
        if cached is None or cached[0] is not self.rule:
            names = list(self.rule.initial_buffers(self.num_features, {"device": "meta"}, groups=self.groups))
            cached = self.__dict__["_rule_buffers"] = (self.rule, names)
        return list(cached[1])

    @torch.no_grad()
    def _fold_finish(self, outcome: FoldOutcome, mean: Tensor, delta: Tensor, unshifted: bool, shift: Tensor,
                     writes: Tuple[List[Tensor], List[Tensor]]) -> bool:
        """Write a fold's ``outcome`` (a skipped fold, a failed transform: the previous one is kept, and
        counted), the new mean ``mean``, the bias compensation for the mean's change ``delta`` (float64), whether
        the next block sums unshifted and that block's shift ``shift`` (float64, a tensor of its own: 0 when
        ``unshifted``, else ``mean``). ``outcome.buffers`` and ``mean`` may be views of the fold's stacks, in
        another dtype: they are copied into the buffers (:meth:`_set_fold_buffer`). Returns whether the block
        counts (the caller adds it to ``num_blocks``, many layers in one op); ``False`` for a skipped fold. ``writes``:
        ``(buffers, values)`` lists the in-place copies are appended to, for the caller to make for many layers in
        one multi-tensor op (``torch._foreach_copy_``) before anything reads the buffers."""
        if outcome.status in SKIP_MESSAGES:
            self.skipped_folds += 1
            if SKIP_MESSAGES[outcome.status]:
                self._warn_once("skip", cast(str, SKIP_MESSAGES[outcome.status]))
            return False
        if outcome.status == FAILED:
            self.eig_failures += 1
            self._warn_once("transform", self.rule.failure_message)
        for name, value in outcome.buffers.items():
            self._set_fold_buffer(name, value, writes)
        self._on_mean_change(delta)
        self._set_fold_buffer("running_mean", mean, writes)
        # Plain attributes, written straight into the instance dict (as in _end_batch). The next block's shift, as
        # its first gathered batch would choose it (_start_block after a counted fold): chosen here, a compiled
        # graph needs no second variant for a block's first batch.
        # The shift goes into the tensor of the block before (one tensor across folds: a compiled graph reads it at
        # a fixed address, and CUDA graph trees record again when an input moves).
        store = self.__dict__.get("_shift_store")
        if (store is not None and store.shape == shift.shape and store.dtype == shift.dtype
                and store.device == shift.device and not store.is_inference()):
            writes[0].append(store)
            writes[1].append(shift)
            shift = store
        self.__dict__.update(clamped_steps=self.clamped_steps + int(outcome.clamped), _stats_unshifted=unshifted,
                             _acc_shift=shift, _acc_shift_x=None, _shift_store=shift)
        return True

    def _set_fold_buffer(self, name: str, value: Tensor, writes: Optional[Tuple[List[Tensor], List[Tensor]]] = None
                         ) -> None:
        """Write a fold's new ``value`` into buffer ``name``: in place (``copy_``), so the buffer keeps its tensor
        and its storage across folds.

        Whatever holds a reference to a buffer sees the fold: ``torch.func.functional_call`` (which puts the
        module's own tensors back after the call), a captured CUDA graph (static addresses, compiled layers
        included), an optimizer or EMA helper holding ``named_buffers()``. A forward never hands a buffer itself
        to autograd: an eager one reads a snapshot taken once per block, a compiled one copies the buffers in the
        graph (:meth:`_forward_state`), so a backward still to come (the fold follows the forward of the block's
        last batch), or a forward recomputed by activation checkpointing, keeps the values that were in force at
        its forward.

        A new tensor only where ``value`` cannot go into the old one (another shape, dtype or device, an
        inference tensor). ``writes``: the copy appended to these ``(buffers, values)`` lists instead of made
        (:meth:`_fold_finish`).
        """
        old = cast(Tensor, self._buffers.get(name))
        if old.shape == value.shape and not old.is_inference():
            if writes is None:
                old.copy_(value)  # converts to the buffer's dtype and device
            else:
                writes[0].append(old)
                writes[1].append(value)
        else:
            self._replace_buffer(name, _owned(value, old))

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
        self._flush_handed()
        self._reset_accumulators()
