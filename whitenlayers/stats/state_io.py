"""A whitening layer's state outside training: checkpoints (the partial block as extra state, loading with
checks for another method's or an old version's keys), pickling and copying, scripting.
Part of :mod:`whitenlayers.stats`.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union, cast

import torch
from torch import Tensor

from .. import functional as F_w
from ..fold import FAILED, FOLDED, FoldOutcome, PendingFold
from ..rules import RecursiveRule
from ._core import _LayerCore

__all__ = ["loading_plain_checkpoint"]


#: Layout tag of the packed extra state (:meth:`WhiteningLayer.get_extra_state`); version 1 was a dict.
_EXTRA_LAYOUT = 2
#: The layout of a layer with a pending fold (an asynchronous fold in flight): layout 2's, then the fold.
_EXTRA_LAYOUT_PENDING = 3
#: The layout of a layer whose coordinator folds asynchronously (``fold_async``): layout 3's with the fold's part
#: always there, every buffer of the outcome layout included (zeros where the fold holds none; status
#: :data:`_NO_FOLD` where there is no pending fold), so that its size depends only on how the layer was built.
#: Loaders that load into tensors shaped by a fresh model (``torch.distributed.checkpoint``) need that.
_EXTRA_LAYOUT_SLOT = 4
#: The status of an empty pending-fold slot (layout 4).
_NO_FOLD = -1
_LAYOUTS = (_EXTRA_LAYOUT, _EXTRA_LAYOUT_PENDING, _EXTRA_LAYOUT_SLOT)
#: The scalar head of a pending fold, in order; then its new mean, mean change and next shift (``M`` each) and the
#: buffers its outcome holds (:meth:`~whitenlayers.stats.WhiteningLayer._outcome_layout`, the first ``kept``).
_PENDING_HEAD = ("status", "clamped", "unshifted", "nonfinite", "kept")
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

class _StateIOMixin(_LayerCore):
    """Checkpoints, pickling and scripting of :class:`~whitenlayers.WhiteningLayer` (this module's
    docstring)."""


    # 2: the partial block is one tensor in ``_extra_state``; grad layers with a bias keep their bias compensation
    # in ``bias_correction`` (version 1 added it to the bias parameter).
    _version = 2


    def __getstate__(self) -> Dict[str, Any]:
        self._wait_for_fold()  # a fold in flight: its result is the layer's pending fold, copied with it
        # The buffers of the last forward and the weight of a fold under way are transient: not pickled or copied;
        # nor is the deferral's state (a copy is stepped by no optimizer of the deferral, defer_grad_transform).
        state = dict(self.__dict__)
        for transient in ("_in_force", "_snapshot", "_fold_weight", "_mean_taps", "_pointwise_cache", "_shift_cache",
                          "_rows_cache", "_shift_store", "_deferred_grad", "_deferred_q", "_absorb_plan",
                          "_planned", "_shared_weight", "_wrapper", "_t_transposed",
                          "_spares", "_double_buffered"):  # the last two: set by versions before 2026-11-28
            state.pop(transient, None)
        state.pop("_acc_dense", None)
        aug = state.get("_acc_aug")
        if aug is not None:  # views of it: made again on load (a pickle would copy them apart)
            state.pop("_acc_s1", None)
            state.pop("_acc_s2", None)
            state.pop("_acc_blocks", None)
            if aug._base is not None and aug._base.dim() == 3:  # a slice of a coordinator's stacked accumulator
                state["_acc_aug"] = F_w.moments_accumulator(aug.shape[0] - 1, aug.dtype, aug.device).copy_(aug)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.__dict__.setdefault("_traced_calls", [])  # layers pickled before compiled forwards counted their calls
        aug = self.__dict__.get("_acc_aug")
        if aug is not None:
            self._set_accumulator(aug)

    def __prepare_scriptable__(self) -> Any:
        raise RuntimeError(
            f"{self._describe()}: torch.jit.script cannot compile a whitening layer (its forward gathers statistics "
            "and folds blocks in Python). To deploy, script the plain model: "
            "torch.jit.script(wl.to_plain_model(copy.deepcopy(model)).eval()); to trace or compile the converted model "
            "use torch.jit.trace, torch.export.export or torch.compile")

    # ---------------------------------------------------------- checkpointing
    def _wait_for_fold(self) -> None:
        """Wait for an asynchronous fold in flight (the coordinator's), which makes it this layer's pending fold."""
        coordinator = self.__dict__.get("_fold_coordinator")
        if coordinator is not None:
            coordinator.wait()

    def get_extra_state(self) -> Tensor:
        """The partial block and the counters as one float64 tensor, so a mid-block checkpoint resumes bit-for-bit.

        Layout: the scalars ``_EXTRA_HEAD`` (a layout tag first), then the block's shift (``M``), first sums
        (``M``) and second sums (the block shape, flattened). A tensor, not a dict, so the state dict holds
        tensors only (EMA helpers, safetensors and exporters iterate over it as tensors); a fresh one at each
        call, owned by nobody. A layer with a pending fold (``fold_async``: this waits for a fold in flight) has
        layout tag 3 and the fold after the block: ``_PENDING_HEAD``, its new mean, mean change and next
        shift, and the buffers its outcome holds, so that a resume writes it where the run would have. A layer of
        a model converted with ``fold_async=True`` always has layout tag 4: layout 3's with room for every buffer
        of a fold, pending or not, so that the tensor's size depends only on how the layer was built
        (``torch.distributed.checkpoint`` loads into the tensors of a fresh model's ``state_dict``).
        """
        self._flush_handed()
        self._wait_for_fold()
        pending = cast(Optional[PendingFold], self._pending_fold)
        f64: Dict[str, Any] = {"dtype": torch.float64, "device": self.running_mean.device}
        coordinator = self.__dict__.get("_fold_coordinator")
        slot = coordinator is not None and coordinator.fold_async
        layout = _EXTRA_LAYOUT_SLOT if slot else _EXTRA_LAYOUT if pending is None else _EXTRA_LAYOUT_PENDING
        head = torch.tensor([layout, self._acc_batches, self._acc_shift is not None]
                            + [getattr(self, name) for name in _COUNTERS] + [self._acc_count, self._stats_unshifted],
                            **f64)
        shift = self._acc_shift if self._acc_shift is not None else torch.zeros_like(self._acc_s1)
        parts = [head, shift, self._acc_s1, self._acc_s2.reshape(-1)]
        if pending is not None:
            outcome = cast(FoldOutcome, pending.outcome)
            layout_shapes = self._outcome_layout()
            kept = [name for name, _ in layout_shapes if name in outcome.buffers]
            parts += [torch.tensor([outcome.status, outcome.clamped, pending.unshifted, pending.nonfinite, len(kept)],
                                   **f64),
                      pending.mean, pending.delta, pending.shift] + [outcome.buffers[name].reshape(-1) for name in kept]
            if slot:  # the buffers the outcome does not hold (a failed fold keeps the transform): zeros
                parts += [torch.zeros(math.prod(shape), **f64) for _, shape in layout_shapes[len(kept):]]
        elif slot:
            m = self.num_features
            size = 3 * m + sum(math.prod(shape) for _, shape in self._outcome_layout())
            parts += [torch.tensor([_NO_FOLD, 0, 0, 0, 0], **f64), torch.zeros(size, **f64)]
        return torch.cat([t.to(device=head.device, dtype=torch.float64) for t in parts])

    def set_extra_state(self, state: Union[Tensor, Dict[str, Any]]) -> None:
        """Restore the partial block and the counters (``load_state_dict`` calls this).

        Args:
            state: what :meth:`get_extra_state` returned (a float64 tensor), or the dict of a version-1
                checkpoint.
        """
        self._wait_for_fold()  # a fold in flight is dropped: the checkpoint's state replaces it
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
        self._pending_fold = state.get("pending")

    def _unpack_extra_state(self, packed: Tensor) -> Dict[str, Any]:
        m, block = self.num_features, self._block_shape
        numel = len(_EXTRA_HEAD) + 2 * m + math.prod(block)
        if not isinstance(packed, Tensor) or packed.dim() != 1 or not packed.is_floating_point():
            raise RuntimeError(f"{self._describe()}: checkpoint extra state must be a 1-D float tensor (the partial "
                               f"block), but got {type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}")
        if packed.numel() < len(_EXTRA_HEAD) or int(packed[0]) not in _LAYOUTS:
            raise RuntimeError(f"{self._describe()}: checkpoint extra state has an unknown layout "
                               f"(tag {float(packed[0]) if packed.numel() else None}, expected one of {_LAYOUTS})")
        pending = None
        if int(packed[0]) != _EXTRA_LAYOUT:
            pending = self._unpack_pending(packed[numel:], padded=int(packed[0]) == _EXTRA_LAYOUT_SLOT)
            packed = packed[:numel]
        if packed.numel() != numel:
            raise RuntimeError(
                f"{self._describe()}: checkpoint extra state holds {packed.numel()} values, but this layer needs "
                f"{numel}: block statistics of shape {block} ({_shape_words(block)}) for {m} features")
        head = dict(zip(_EXTRA_HEAD, packed[: len(_EXTRA_HEAD)].tolist()))
        shift, s1, s2 = torch.split(packed[len(_EXTRA_HEAD):], [m, m, math.prod(block)])
        out: Dict[str, Any] = {name: head[name] for name in _COUNTERS}
        out.update(acc_batches=head["acc_batches"], acc_count=head["acc_count"],
                   stats_unshifted=head["stats_unshifted"], acc_shift=shift if head["has_shift"] else None,
                   acc_s1=s1, acc_s2=s2.view(block), pending=pending)
        return out

    def _unpack_pending(self, packed: Tensor, padded: bool = False) -> Optional[PendingFold]:
        """The pending fold of a layout-3 extra state (what follows the block), on this layer's device; ``padded``:
        layout 4's slot (every buffer of the outcome layout there; ``None`` for an empty slot)."""
        m, layout = self.num_features, self._outcome_layout()
        n_head = len(_PENDING_HEAD)
        head = dict(zip(_PENDING_HEAD, packed[:n_head].tolist())) if packed.numel() >= n_head else {}
        kept = int(head.get("kept", -1))
        status = int(head.get("status", -2))
        sizes = [m, m, m] + [math.prod(shape) for _, shape in layout[: len(layout) if padded else max(kept, 0)]]
        if padded and status == _NO_FOLD and kept == 0 and packed.numel() == n_head + sum(sizes):
            return None
        expected = {FOLDED: len(layout), FAILED: 1}.get(status, 0)
        if kept != expected or packed.numel() != n_head + sum(sizes):
            raise RuntimeError(f"{self._describe()}: checkpoint extra state holds a pending fold of "
                               f"{packed.numel()} values that does not match this layer (status {status}, "
                               f"{kept} buffers for {m} features)")
        dev = self.running_mean.device
        values = [t.to(dev).clone() for t in torch.split(packed[n_head:], sizes)]
        buffers = {name: t.view(shape) for (name, shape), t in zip(layout[:kept], values[3:])}
        return PendingFold(FoldOutcome(status, bool(head["clamped"]), buffers),
                           values[0].to(self.running_mean.dtype), values[1], bool(head["unshifted"]), values[2],
                           int(head["nonfinite"]))

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
        if isinstance(self.rule, RecursiveRule):  # (a subclass of one's own too: it keeps the recursive buffers)
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
        self._wait_for_fold()  # a fold in flight reads the buffers this writes (set_extra_state then replaces it)
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
