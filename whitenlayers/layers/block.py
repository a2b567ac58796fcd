"""A layer's partial block: what its training forwards have added since its last fold.

:class:`Block` is plain state (no module behind it): the block's sums, the shift they are taken about, the
batches and rows counted. A whitening layer holds one (``layer._block``); its forward adds to it
(:mod:`~whitenlayers.layers.step`), a fold reads and clears it (:mod:`whitenlayers.fold`), a checkpoint packs it
(:mod:`~whitenlayers.layers.checkpoint`). Its fields are written as plain attributes, which costs a fraction of a
module attribute's write on every step. Part of :mod:`whitenlayers.layers`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import functional as F_w
from ..functional.batch import LOW_PRECISION, _as_moments_accumulator, low_precision_products_known

__all__ = ["Block"]


class Block:
    """One layer's partial block (see the module docstring).

    ``groups == 1``: the sums live in one augmented accumulator ``acc`` ``(M + 1, M + 1)``
    (:func:`~whitenlayers.functional.moments_accumulator`; ``s2`` and ``s1`` are its views), in the statistics'
    dtype (float32, or float64 for a float64 layer). Grouped layers keep float64 ``s1`` ``(M,)`` and ``s2``
    ``(G, k, k)`` of their own (``acc`` is ``None``).

    The shift ``shift`` (float64 ``(M,)``) is chosen at the block's first gathered batch
    (:meth:`~whitenlayers.WhiteningLayer._start_block`), written into ``store``: one tensor for the layer's life,
    which a compiled forward sums about at a fixed address. ``unshifted``: the block sums about 0 (its shift is 0
    and the batches are not shifted), as the last fold decided from its block's statistics.
    """

    __slots__ = ("batches", "rows", "gather_next", "length", "every", "fraction", "fold_pending", "fold_weight", "acc",
                 "dense", "s1", "s2", "parts", "shift", "shift_x", "store", "unshifted")

    def __init__(self, num_features: int, groups: int, dtype: torch.dtype, device: Any, config: Any) -> None:
        self.configure(config)
        self.unshifted = False
        self.fold_weight: Optional[Tensor] = None  # the weight a fold compensates with, taken at the block's end
        self.store = torch.zeros(num_features, dtype=torch.float64, device=device)
        self.acc: Optional[Tensor] = None
        if groups == 1:
            self.set_accumulator(F_w.moments_accumulator(num_features, dtype, device))
        else:
            self.s1 = torch.zeros(num_features, dtype=torch.float64, device=device)
            self.s2 = torch.zeros(F_w.block_shape(num_features, groups), dtype=torch.float64, device=device)
        self.restart()

    def configure(self, config: Any) -> None:
        """The config's numbers the block's forwards read (a new config takes effect at the next batch)."""
        self.length = config.block_size * config.accumulation_steps  # forwards per block
        self.every = config.stats_every  # the first of every `every` forwards gathers
        self.fraction = config.stats_fraction  # the leading fraction of a batch's samples gathered

    def restart(self) -> List[Tensor]:
        """Start an empty block; returns the tensors the caller zeroes (the fold zeroes those of many layers in one
        multi-tensor op)."""
        self.batches = 0
        self.rows = 0.0  # samples x positions gathered: known from shapes, no device op
        self.gather_next = True
        self.fold_pending = False
        self.shift: Optional[Tensor] = None  # chosen at the block's first gathered batch
        self.shift_x: Optional[Tensor] = None  # the shift as the batches subtract it (None: summed about 0)
        return [self.dense] if self.acc is not None else [self.s1, self.s2]

    def set_accumulator(self, acc: Tensor) -> None:
        """Make ``acc`` the block's augmented accumulator; a new block zeroes the dense storage it views (its base,
        :func:`~whitenlayers.functional.moments_accumulator`'s padded rows, else ``acc`` itself)."""
        base = acc._base
        self.dense = base if base is not None and base.dim() == 2 and base.shape[0] == acc.shape[0] else acc
        self.acc = acc
        self.s2 = acc[:-1, :-1]
        self.s1 = acc[:-1, -1]
        self.parts = (self.s2, acc[:-1, -1:])  # the blocks the hot path's two products write into, sliced once

    def add(self, x: Tensor, shift: Optional[Tensor], traced: bool = False) -> None:
        """Add the batch ``x``'s sums about ``shift`` (``x - shift``, broadcasting; ``None``: about 0) to the block:
        the one formula of every path that adds a batch, a layer's eager forward and its compiled one. ``x``
        detached, outside autocast; the caller counts its rows; ``traced``: inside a compiled graph.

        ``groups == 1``: into the augmented accumulator (:func:`~whitenlayers.functional.accumulate_moments`; inside
        a compiled graph a bf16 / fp16 batch on the fewest-kernel path is multiplied in two bf16 halves on tensor
        cores, :func:`~whitenlayers.functional.accumulate_moments_split`). Grouped layers: ``s1`` and the diagonal
        blocks of ``s2`` (:func:`~whitenlayers.functional.batch_sums`, in float32 at least)."""
        acc = self.acc
        if acc is None:
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()
            s1, s2 = F_w.batch_sums(x, shift, self.s2.shape[0])
            self.s1.add_(s1)
            self.s2.add_(s2)
        elif not traced:
            F_w.accumulate_moments(acc, x, shift, self.parts, traced=False)
        elif (shift is not None and acc.dtype == torch.float32 and x.dtype in LOW_PRECISION
              and F_w.fused_moments_on(x.device) and low_precision_products_known(x.device)):
            F_w.accumulate_moments_split(acc, x, shift)  # (low_precision_products_known: tried before the trace)
        else:
            F_w.accumulate_moments(acc, x, shift, traced=True)

    def sums(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(count, shift, s1, s2)``: the block's shifted sums (float64)."""
        shift = self.shift if self.shift is not None else torch.zeros_like(self.s1, dtype=torch.float64)
        count = torch.tensor(self.rows, dtype=torch.float64, device=self.s1.device)
        return count, shift, self.s1.to(torch.float64), self.s2.to(torch.float64)

    def parts_to_copy(self) -> Tuple[float, Optional[Tensor], Tuple[Tensor, ...]]:
        """The row count, shift and sums as they lie (the accumulator, or ``s1`` and ``s2``): what an asynchronous
        fold copies (:func:`~whitenlayers.fold._taken_blocks`)."""
        return self.rows, self.shift, (self.acc,) if self.acc is not None else (self.s1, self.s2)

    def nonfinite(self) -> Tensor:
        """``1.0`` when the sums are not finite (a batch with non-finite values, or products that overflow the
        input's precision), else ``0.0``: float64, on the device (read once per block)."""
        return ((self.s1.sum() + self.s2.sum()) * 0 != 0).to(torch.float64)  # x * 0: NaN for NaN and +-Inf

    def move(self, fn: Callable[[Tensor], Tensor], dtype: Optional[torch.dtype]) -> None:
        """Apply ``fn`` (a move, ``to_empty``) to the block's tensors, keeping their dtypes; ``dtype``: the
        accumulator's dtype from now on (a float32 <-> float64 cast of the layer)."""
        def moved(t: Tensor) -> Tensor:
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(device=new.device)

        shared = self.shift is self.store
        self.store = moved(self.store)
        self.shift = self.store if shared else None if self.shift is None else moved(self.shift)
        self.shift_x = None  # made again from the shift at the next gathered batch
        if self.acc is not None:  # again as moments_accumulator's aligned rows, in the statistics' dtype
            self.set_accumulator(_as_moments_accumulator(moved(self.acc), dtype or self.acc.dtype))
        else:
            self.s1, self.s2 = moved(self.s1), moved(self.s2)
        if self.fold_weight is not None:
            self.fold_weight = moved(self.fold_weight)

    def __getstate__(self) -> Dict[str, Any]:
        transient = ("dense", "parts", "shift_x", "s1", "s2") if self.acc is not None else ("shift_x",)
        state = {name: getattr(self, name) for name in self.__slots__ if name not in transient and hasattr(self, name)}
        if self.shift is self.store:
            state["shift"] = "store"
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.shift_x = None
        for name, value in state.items():
            setattr(self, name, value)
        if state.get("shift") == "store":
            self.shift = self.store
        if self.acc is not None:
            self.set_accumulator(self.acc)
