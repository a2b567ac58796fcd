"""The per-step path of a whitening layer: what a training forward runs when no fold is due.

A training forward begins with :meth:`~_PerStepMixin._forward_state` (the buffers it reads; a recomputed
forward reads its original's), adds the batch's sums to the block's accumulators (:meth:`~_PerStepMixin._accumulate`:
one product and one sum about the block's shift, no host synchronisation; inside a converted model's forward on
CUDA's path, handed to the model's fold coordinator, which adds the batches of all layers of one input shape
together at the forward's end) and ends with :meth:`~_PerStepMixin._end_batch` (counts the batch; at the block's
end, asks for a fold). Under ``torch.compile``
the graph holds the tensor work only and the model's fold coordinator does the counting outside it. Everything
else a layer does (the fold, checkpoints, casts) is in the other modules of :mod:`whitenlayers.stats`.
Part of :mod:`whitenlayers.stats`.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import TYPE_CHECKING, Dict, Iterator, Optional, Tuple, cast

import torch
from torch import Tensor

from .. import functional as F_w
from ..fold import _no_autocast, fold_layers
from ..functional import stats_samples
from ..functional.moments import LOW_PRECISION, low_precision_products_known
from ._core import _is_compiling, _LayerCore

if TYPE_CHECKING:  # pragma: no cover
    from .layer import WhiteningLayer

__all__ = ["recomputing"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_jit_tracing = torch._C._is_tracing
#: The innermost saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``: activation checkpointing,
#: ``save_on_cpu``), or ``None``; a torch without the query answers "some" (nothing handed over).
_saved_tensor_hooks = (functools.partial(torch._C._autograd._top_saved_tensors_default_hooks, False)
                       if hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks") else lambda: True)
_eager = torch.compiler.disable
_version = operator.attrgetter("_version")


def _define_snapshot_op() -> None:
    """``torch.ops.whitenlayers.snapshot(x)``: a copy of ``x``, an operator of its own so that a compiled graph
    keeps it. A compiled forward reads its buffers through it: the graph's backward then holds the copies, which
    AOTAutograd's partitioner saves rather than recomputing them from the buffers in the backward (it recomputes
    a ``clone``; an operator outside its allowlist is never recomputed), so a fold may write the buffers in place
    between a forward and its backward, and the buffers keep their addresses (CUDA graphs)."""
    if hasattr(torch.ops.whitenlayers, "snapshot"):  # defined already (a module reloaded)
        return
    lib = torch.library.Library("whitenlayers", "FRAGMENT")
    lib.define("snapshot(Tensor x) -> Tensor")
    lib.impl("snapshot", lambda x: x.clone(), "CompositeExplicitAutograd")
    _LIBRARIES.append(lib)  # a Library object unregisters its operators when collected
    # a side effect for torch.fx: the partitioners never move an impure node into the backward
    side_effect = getattr(torch.fx.node, "has_side_effect", None)
    if side_effect is not None:
        side_effect(torch.ops.whitenlayers.snapshot.default)


_LIBRARIES: list = []
_define_snapshot_op()
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch.export (ONNX's exporter among its users)


@contextlib.contextmanager
def _tracing_suspended() -> Iterator[None]:
    """No ``torch.jit.trace`` recording inside (what it would record is not part of the traced function)."""
    set_state = torch._C._set_tracing_state  # type: ignore[attr-defined]  # (not in torch's type stubs)
    state = torch._C._get_tracing_state()
    set_state(None)
    try:
        yield
    finally:
        set_state(state)


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


class _PerStepMixin(_LayerCore):
    """The per-step path of :class:`~whitenlayers.WhiteningLayer` (this module's docstring)."""

    # ------------------------------------------------------------------ forward
    def _forward_state(self) -> Tuple[bool, Dict[str, Tensor]]:
        """Begin a forward: whether it is a training batch (gathers statistics, counts toward the block), and the
        buffers it reads (:attr:`_FORWARD_BUFFERS`) as a snapshot: copies taken at the first forward after the
        buffers last changed (once per block, :meth:`_forward_snapshot`), never the buffers themselves, which a
        fold writes in place (:meth:`_set_fold_buffer`).

        A forward recomputed inside a backward (activation checkpointing, :func:`recomputing`) is not a batch: it
        reads the snapshot of the layer's last original forward, so its output and the transform its backward
        uses are those of that forward even if a fold came in between (the fold follows the model's forward).
        """
        if _is_compiling():  # traced: no recomputation to track, and inference_mode cannot be traced
            buffers = self._buffers
            if not torch.is_grad_enabled() or _is_exporting():  # no backward to keep values for (an export, ONNX)
                return self.training, {name: buffers[name] for name in self._FORWARD_BUFFERS}
            snapshot = torch.ops.whitenlayers.snapshot
            return self.training, {name: snapshot(buffers[name]) for name in self._FORWARD_BUFFERS}
        if recomputing():
            state = self._in_force
            if state is None:  # no original forward seen (e.g. state loaded since): what is in force now
                state = self._forward_snapshot()
            return False, state
        if self._fold_pending:
            # A block ended and no model forward's end folded it: the layer was called on its own or through a
            # sub-module (a backbone, a neck), not through the converted model's root, or twice in one forward.
            # Fold now, before this forward reads its buffers, as the root's end would have: the forward then
            # uses the new transform and mean, and an absorbed offset follows the mean in force (read before the
            # fold, it would track the old one). Under torch.jit.trace outside the trace (its check run, which finds
            # nothing pending, would record another graph).
            if _jit_tracing():
                with _tracing_suspended():
                    self._fold_now()
            else:
                self._fold_now()
        state = self._forward_snapshot()
        self.__dict__["_in_force"] = state  # a plain attribute (Module.__setattr__ costs more than this method)
        # Under torch.inference_mode a training-mode forward gathers nothing and counts nothing: a fold there would
        # store inference tensors as state, which the next training step cannot use (docs/robustness.md).
        return self.training and not torch.is_inference_mode_enabled(), state

    def _forward_snapshot(self) -> Dict[str, Tensor]:
        """The forward's buffers as copies of their own, taken again only when a buffer changed since (another
        tensor in its place, e.g. under ``torch.func.functional_call``, or a write into it: a fold, a checkpoint
        load, DDP's buffer broadcast): per step, one identity and one version check per buffer."""
        buffers = self._buffers
        names = self._FORWARD_BUFFERS
        if _jit_tracing():  # the trace reads the buffers themselves: no copy, nothing cached by one run
            return {name: buffers[name] for name in names}
        snap = self.__dict__.get("_snapshot")
        # the same tensors (the snapshot holds them), unwritten since (their versions): C-level loops, no tuple made
        if (snap is not None and all(map(operator.is_, snap[0], map(buffers.__getitem__, names)))
                and all(map(operator.eq, map(_version, snap[0]), snap[1]))):
            return snap[2]
        held = tuple(map(buffers.__getitem__, names))
        if torch.is_inference_mode_enabled():  # never keep an inference tensor (the next training step can't save it)
            return dict(zip(names, held))
        with torch.no_grad():
            state = {name: buf.clone() for name, buf in zip(names, held)}
        self.__dict__["_snapshot"] = (held, tuple(map(_version, held)), state)
        return state

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
        x_in, x = x, self._stats_batch(x, low_precision=aug)
        if self._acc_s1.device != x.device:
            self._reset_accumulators_to(x.device)
        shift_x = self._acc_shift_x  # made for the rank of the block's first batch: made again for another rank
        if (aug and self._acc_shift is not None and F_w.fused_moments_on(x.device)
                and (self._stats_unshifted or (shift_x is not None and shift_x.dim() == x.dim()))):
            # The hot path, within a block: accumulate_moments' two-op path is in place or takes out= or an explicit
            # dtype, apart from a subtraction and (a contiguous NC... batch) a concatenation, none of which autocast
            # touches: no context. Eager only (_accumulate traces elsewhere): the accumulator's blocks as sliced
            # once (_set_accumulator). Inside a model's forward the batch is handed to its fold coordinator, which
            # adds those of all layers at the forward's end, grouped by shape (a few operations for all of them).
            self._hand_or_add(x, self._stats_sink(x_in))
        else:
            with _no_autocast(x.device):  # under autocast, products would run (and overflow) in fp16/bf16
                if self._acc_shift is None:
                    self._start_block(x)
                elif not self._stats_unshifted and (shift_x is None or shift_x.dim() != x.dim()):
                    # a block resumed from a checkpoint, or a batch of another rank than the block's first
                    self._acc_shift_x = self._acc_shift.to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2))
                self._add_sums(x, self._acc_shift_x)
        self.__dict__["_acc_count"] = self._acc_count + x.numel() // self.num_features  # a plain counter

    def _hand_or_add(self, x: Tensor, sink: Optional[list]) -> None:
        """The hot path's sums of the batch ``x`` about the block's shift: handed to ``sink`` (the coordinator's
        list, added at the forward's end under ``no_grad``: ``x`` may be the layer's input itself, no detached copy
        made), or, ``None``, added now with two products (``x`` detached)."""
        if sink is not None:
            sink.append((self, x, x._version, self._acc_shift_x))
        else:
            F_w.accumulate_moments(cast(Tensor, self._acc_aug), x, self._acc_shift_x, self._acc_blocks)

    def _stats_sink(self, x: Tensor) -> Optional[list]:
        """Where this training forward hands its batch ``x`` (the layer's input) for the statistics: the fold
        coordinator's list while the model's forward runs (:meth:`FoldCoordinator.flush_stats` adds it at the
        forward's end), or ``None``: added now. Handed over only where holding the batch until then keeps nothing
        alive that the forward would free: a backward is recorded that saves the input (:meth:`_input_saved`), and
        no saved-tensor hooks are active (activation checkpointing, offloading to the host)."""
        coordinator = self._fold_coordinator
        if coordinator is None or not coordinator._scopes or self.__dict__.get("_is_replica"):
            return None  # (a DataParallel replica shares its accumulators with the module it copies: added now)
        sink = coordinator.stats_sink()
        if sink is None or not torch.is_grad_enabled() or _saved_tensor_hooks() is not None or _jit_tracing():
            return None  # (a torch.jit trace records the layer's own operations)
        return sink if self._input_saved(x) else None

    def _input_saved(self, x: Tensor) -> bool:
        """Whether the forward's backward keeps the input ``x`` anyway (a grad layer: its weight's gradient needs
        it); here, whether ``x`` is part of the recorded graph."""
        return x.requires_grad

    # ------------------------------------------------------------ planned steps
    # Inside a converted model's eager forward the fold coordinator's pre-hook decides, for all its grad / recursive
    # layers at once, what their next training forward does (convert._common.plan_forward): the checks of the path above
    # that hold for the whole forward are made there, once, and the layer's forward runs the rest
    # (:meth:`_planned_stats`, :meth:`_planned_end`). The same operations in the same order as the path above.
    def _step_counts(self, rank: int, device: torch.device) -> Optional[Tuple[int, Optional[Tuple[int, bool]]]]:
        """What this layer's next training forward adds and counts, decided before it (``rank``: the dimensions of
        its statistics' input; ``device``: where its weight is, so its input is): ``(gather, end)``, or ``None``
        where that forward takes the full path (frozen, a fold pending). ``gather``: 0 nothing (``stats_every``),
        1 the hot path of :meth:`_add_batch` (handed to the coordinator or added with two products), 2
        :meth:`_add_batch` itself; ``end``: the block's batch count and ``_gather_next`` after it, or ``None`` where
        the block ends (:meth:`_end_batch`, which asks for the fold)."""
        if self.frozen or self._fold_pending:
            return None
        config = self.rule.config  # (the config property's value)
        batches = self._acc_batches
        gather = 0
        if batches % config.stats_every == 0:
            gather = 2
            aug, shift_x = self._acc_aug, self._acc_shift_x
            if (aug is not None and self._acc_shift is not None and config.stats_fraction == 1.0
                    and aug.device == device and F_w.fused_moments_on(device)
                    and (self._stats_unshifted or (shift_x is not None and shift_x.dim() == rank))):
                gather = 1
        batches += 1
        if batches >= config.block_size * config.accumulation_steps:
            return gather, None
        return gather, (batches, batches % config.stats_every == 0)

    def _planned_stats(self, x: Tensor, gather: int, sink: Optional[list]) -> None:
        """:meth:`_accumulate` of a planned forward (:meth:`_step_counts`' ``gather``): ``x`` handed to ``sink``
        (the coordinator's list; not under saved-tensor hooks, as :meth:`_stats_sink`) or added now."""
        if gather == 1:
            sink = sink if _saved_tensor_hooks() is None else None
            self._hand_or_add(x if sink is not None else x.detach(), sink)
            attrs = self.__dict__
            attrs["_acc_count"] = attrs["_acc_count"] + x.numel() // self.num_features
        elif gather == 2:
            self._add_batch(x)

    def _planned_end(self, end: Optional[Tuple[int, bool]]) -> None:
        """:meth:`_end_batch` of a planned forward (:meth:`_step_counts`' ``end``)."""
        if end is None:
            self._end_batch()
        else:
            attrs = self.__dict__
            attrs["_acc_batches"], attrs["_gather_next"] = end

    # ------------------------------------------------------------ torch.compile
    # Inside a compiled graph a layer reads no Python number that changes from step to step (dynamo would guard on
    # it and recompile at every step of a block). The graph holds the tensor work only: the batch's sums added to
    # the accumulators (always about a shift, the mean in force, never the unshifted product: no per-layer flag that
    # could change between blocks). Each call appends the rows it gathered to the layer's list `_traced_calls`
    # (empty whenever a graph starts: a guard that always holds); the model's FoldCoordinator, a forward hook that
    # runs outside the graph (torch.compiler.disable), then counts a batch per call, keeps the block's row count
    # and folds at the block's end, as an eager layer does for itself. A layer called twice in one forward counts
    # two batches, as in eager mode. A layer without a coordinator (built alone, not by convert_model) leaves the
    # graph for that bookkeeping: a graph break per layer, still no recompilation.
    #: Whether the next training forward gathers statistics (``stats_every``), kept by the eager bookkeeping.
    _gather_next = True
    #: The tensor a compiled forward sums its batch about: float64 ``(M,)``, made with the first block
    #: (stats/block.py), the block's shift itself (``_acc_shift``) whenever one is chosen, written in place by
    #: the folds (one address over any number of blocks).
    _shift_store: Tensor

    def _accumulate_traced(self, x: Tensor) -> None:
        if self._fold_coordinator is None:
            return _eager(_PerStepMixin._accumulate_eager)(self, x)
        if not self._gather_next:  # stats_every > 1: a guard with two values, two graphs at most
            self._traced_calls.append(0)
            return
        # A bf16 / fp16 batch, where the device multiplies it into float32 (tried before the trace): its float32
        # differences from the shift split in two low-precision numbers, multiplied on tensor cores
        # (functional.accumulate_moments_split; the float32 product of every layer would run on SIMT cores).
        aug = self._acc_aug
        lowp = (aug is not None and aug.dtype == torch.float32 and x.dtype in LOW_PRECISION
                and F_w.fused_moments_on(x.device) and low_precision_products_known(x.device))
        x = self._stats_batch(x, low_precision=lowp)
        with _no_autocast(x.device):
            # About the shift tensor (_shift_store), the block's shift whenever one is chosen, never None: one
            # graph for every step, a block's first batch included. A batch of a block whose shift is not chosen
            # yet (the very first one, or after a reset or a skipped fold) is summed about the tensor's values as
            # they are, and the coordinator moves the sums to the shift the batch chooses, outside the graph
            # (_recentre_block); the shift as x subtracts it is made in the graph (one small cast).
            shift_x = self._shift_store.to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2))
            if lowp:
                F_w.accumulate_moments_split(cast(Tensor, aug), x, shift_x)
            elif aug is not None and x.dim() > 2 and x.is_contiguous() and not F_w.fused_moments_on(x.device):
                # A contiguous (B, M, *spatial) batch where the products are not fused (the CPU): its rows (M, B P)
                # made in the subtraction's pass, one product, an external kernel (a batched product summed over
                # the batch is a reduction inductor generates code for, per layer width: compile time)
                m = x.shape[1]
                rows = (x - shift_x).transpose(0, 1).reshape(m, -1)
                aug[:m, :m].add_(rows @ rows.t())
                aug[:m, m].add_(rows.sum(1))
            else:
                self._add_sums(x, shift_x)
        self._traced_calls.append(x.numel() // self.num_features)

    def _accumulate_eager(self, x: Tensor) -> None:
        """:meth:`_accumulate` outside a compiled graph (a graph break; for a layer without a coordinator)."""
        if self._fold_pending:
            self._fold_now()
        if self._gathers_now():
            self._add_batch(x)

    def _count_traced_batches(self) -> None:
        """The coordinator, outside the graph, after a compiled forward that called this layer: what
        :meth:`_add_batch` and :meth:`_end_batch` count in eager mode, a batch per call.

        The sums of all the forward's calls are in the accumulators already: a block that ends before the
        forward's last call (``block_size * accumulation_steps`` not a multiple of the calls per forward) takes
        the forward's later calls too, and the next block starts after the forward (a warning, once)."""
        calls = self._traced_calls
        self._traced_calls = []
        if self._acc_shift is None and self._gather_next:  # the block's first gathered batch: its shift now
            self._recentre_block(sum(calls))
        for i, rows in enumerate(calls):
            self._acc_count += rows
            self._end_batch()
            if self._fold_pending and i < len(calls) - 1:
                self._warn_once("traced_calls", (
                    f"called {len(calls)} times in one compiled forward, and a block ended after call {i + 1}: the "
                    "fold waits for the forward's end, so this block also holds the forward's later calls (in "
                    "eager mode it would fold between them); make block_size * accumulation_steps a multiple of "
                    f"{len(calls)} for blocks of exactly block_size batches"))
                self._acc_count += sum(calls[i + 1:])
                self._acc_batches += len(calls) - i - 1
                break

    def _recentre_block(self, rows: float) -> None:
        """After a compiled forward whose batches started the block (no shift chosen before it), outside the graph:
        the shift the block's first batch chooses in eager mode (:meth:`_start_block`: the mean in force, or for the
        very first block the batch's mean, 0 where not finite), and the block's sums, which the graph took about the
        shift tensor's values as they were, moved to it (float64: ``s2 - s1 d^T - d s1^T + n d d^T``,
        ``s1 - n d``; the product's rounding stays that of the values it was taken about). The shift is written
        into the tensor the graph reads (its address kept). ``rows``: the rows the forward gathered."""
        store = self._shift_store
        with torch.no_grad(), _no_autocast(store.device):
            n = float(rows)
            s1, s2 = self._acc_s1, self._acc_s2
            s1_64 = s1.to(torch.float64)
            first = torch.nan_to_num(store + s1_64 / n if n > 0 else torch.zeros_like(store), nan=0.0, posinf=0.0,
                                     neginf=0.0)
            in_force = self.running_mean.detach().to(device=store.device, dtype=torch.float64)
            shift = torch.where(self.num_blocks.to(store.device) > 0, in_force, first)
            d = shift - store
            if self.groups == 1:
                sd = torch.outer(s1_64, d)
                s2.copy_(s2.to(torch.float64) - sd - sd.t() + n * torch.outer(d, d))
            else:  # the diagonal blocks (G, k, k)
                g = s2.shape[0]
                a, b = s1_64.view(g, -1, 1), d.view(g, -1, 1)
                sd = a @ b.transpose(1, 2)
                s2.copy_(s2.to(torch.float64) - sd - sd.transpose(1, 2) + n * (b @ b.transpose(1, 2)))
            s1.copy_(s1_64 - n * d)
            store.copy_(shift)
        self.__dict__.update(_acc_shift=store, _acc_shift_x=None)

    def _start_block(self, x: Tensor, shifted: bool = False) -> None:
        """Choose the block's shift at its first gathered batch (once per block): zero when the layer sums
        unshifted, else the mean in force, or for the very first block this batch's mean (0 where it is not
        finite, so that one bad batch cannot poison the block's other batches). Chosen on the device: no host
        synchronisation. The shift is also the tensor a compiled forward of the layer sums about (_shift_store)."""
        m = self.num_features
        if not shifted and self._stats_unshifted:  # `shifted`: the mean in force or the batch's, whatever the flag
            self._acc_shift = self.__dict__["_shift_store"] = torch.zeros(m, dtype=torch.float64, device=x.device)
            self._acc_shift_x = None
            return
        if x.numel() > 0:
            dims = [0] + list(range(2, x.dim()))
            first = torch.nan_to_num(x.mean(dims, dtype=_work_dtype(x)).to(torch.float64), nan=0.0, posinf=0.0,
                                     neginf=0.0)
        else:
            first = torch.zeros(m, dtype=torch.float64, device=x.device)
        in_force = self.running_mean.detach().to(device=x.device, dtype=torch.float64)
        self._acc_shift = self.__dict__["_shift_store"] = torch.where(self.num_blocks.to(x.device) > 0, in_force,
                                                                      first)
        self._acc_shift_x = self._acc_shift.to(_work_dtype(x)).view((1, m) + (1,) * (x.dim() - 2))

    def _end_batch(self) -> None:
        """Count one training forward; fold (or ask the coordinator to) at the block's end."""
        if self.frozen:
            return
        if _is_compiling():
            if self._fold_coordinator is None:
                return _eager(_PerStepMixin._end_batch)(self)
            return  # counted by the coordinator after the graph (_count_traced_batches)
        # Plain counters written straight into the instance dict: Module.__setattr__ (which looks for a parameter,
        # buffer or submodule of the name first) cost more than the rest of this method, per layer per step.
        attrs, config = self.__dict__, self.config
        batches = attrs["_acc_batches"] = self._acc_batches + 1
        attrs["_gather_next"] = batches % config.stats_every == 0
        if batches >= config.block_size * config.accumulation_steps:
            self._fold_pending = True
            self._capture_fold_inputs()
            if self._fold_coordinator is not None:
                self._fold_coordinator.request(cast("WhiteningLayer", self))
            else:
                fold_layers([cast("WhiteningLayer", self)])

    def _capture_fold_inputs(self) -> None:
        """Hook: keep what the coming fold needs from this forward (grad layers: the weight, which a sharded
        wrapper gathers only during the forward)."""
