"""A whitening layer's forward, the one implementation of a step: training or not, through the model's root or not,
eager or compiled.

A forward starts with :meth:`~_StepMixin._begin`, which decides what it does as a :class:`Step`: what it reads (the
buffers, or for a training forward their copies, :class:`InForce`), whether it is a training batch (counted, at its
end, by :meth:`~_StepMixin._end`), and whether its block's end is folded at the end of the model's forward (the model's
fold coordinator, :mod:`whitenlayers.coordinator`, folds all its layers there together) or at once. A training batch
is added to the block (:meth:`~_StepMixin._add_batch`, the sums by
:meth:`~whitenlayers.layers.block.Block.add`) when its block gathers at this batch (``Block.gather_next``: the first of
every ``stats_every`` batches). Whether a layer gathers at all is one predicate, :meth:`~_StepMixin.gathers_now`.

What a forward reads. A fold writes the layer's buffers in place (they keep their tensors: ``functional_call``, CUDA
graphs), right after the forward that ends a block, before that forward's backward. So a training forward reads
copies of them (:class:`InForce`): the one writer of the buffers (:meth:`~whitenlayers.WhiteningLayer.write_buffers`:
a fold, a load, a reset, a move) makes the values it writes the new copies, or drops the copies, which the next
training forward then takes. Every other forward (evaluation, frozen, no gradient) reads the buffers themselves: no
fold runs before its backward, and it sees any write (an EMA helper's, a user's). A forward that autograd recomputes
inside a backward (activation checkpointing) reads what its original forward read.

Compiled, a forward runs :meth:`~_StepMixin._begin_traced`: the buffers copied in the graph (an operator of the
package's own, so that the partitioner saves the copies for the backward), the batch summed about the block's shift
tensor, and the batch counted outside the graph: by the coordinator after the root's graph, else through a graph
break. The graph reads one Python value that can change from step to step, whether the block gathers at this batch
(``Block.gather_next``): with ``stats_every > 1`` a second graph. Its rounding differs from the eager forward's.

:class:`_GradStep` is the forward of the grad / recursive layers (convolutions and linear layers): the weight whose
gradient is right-multiplied by ``Q_s``, and the centring (``b + c - sum_k W_k mu``; for a bias-free convolution in
training, added to the convolution's output; or absorbed by a following BatchNorm, whose running mean the layer's
offset follows: one ``addmv_`` per step, :meth:`~_GradStep._track_absorbed_offset`). Part of
:mod:`whitenlayers.layers`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple, cast

import torch
from torch import Tensor, nn

from .. import functional as F_w
from .._torch_compat import (
    TRAINING_EXPORT,
    compiling,
    exporting,
    graph_break,
    in_backward,
    no_autocast,
    transforms_active,
    unchecked_side_effect,
)
from ..autograd import grad_transformed, grad_transformed_apply
from ..fold import fold_layers
from ..functional.batch import fused_moments_on, stats_samples
from ._checks import BATCH_NORMS, FUNC_WHAT_TO_DO, check_not_tracing_function, onnx_exporting

if TYPE_CHECKING:  # pragma: no cover
    from ..coordinator import FoldCoordinator, ForwardScope
    from .block import Block

    class _Layer(nn.Module):
        """What the layers' mixins (this module's and :mod:`~whitenlayers.layers.checkpoint`'s) read of the layer they
        are part of (a :class:`~whitenlayers.WhiteningLayer`, an ``nn.Module``), declared once for the type checker."""

        _block: Block
        _reads: Reads
        _fold_coordinator: Optional[FoldCoordinator]
        _pending_fold: Any
        _buffers: Dict[str, Any]
        _parameters: Dict[str, Any]
        frozen: bool
        num_features: int
        groups: int
        rule: Any
        running_mean: Tensor
        weight: Tensor
        bias: Optional[Tensor]

        @property
        def _block_shape(self) -> tuple: ...

        @property
        def method(self) -> str: ...

        def _describe(self) -> str: ...

        def _warn_once(self, kind: str, message: str) -> None: ...

        def _fold_weight_of(self, weight: Optional[Tensor]) -> Optional[Tensor]: ...

        def outcome_layout(self) -> List[Tuple[str, Tuple[int, ...]]]: ...

        def _reset_accumulators(self, device: Any = None) -> None: ...

        def _new_block(self, device: Any) -> Block: ...

        def _features_of(self, x: Tensor, weight: Tensor) -> Tensor: ...

        def _centre_for_hooks(self) -> None: ...

        def _begin(self, x: Tensor) -> Step: ...

        def _buffers_in_force(self) -> InForce: ...

        @staticmethod
        def _derived(reads: InForce, key: Any, make: Callable[[], Any]) -> Any: ...

        def _end(self, step: Step, weight: Optional[Tensor]) -> None: ...
else:
    _Layer = object

__all__ = ["CentringRef", "InForce", "Reads", "Step", "recomputing"]


def recomputing() -> bool:
    """Whether the current forward runs inside a backward pass, i.e. autograd re-runs it (activation checkpointing).

    Both kinds of :func:`torch.utils.checkpoint.checkpoint` recompute a segment's forward while the autograd engine
    executes the backward; an original forward never runs there. Inside a compiled graph this is ``False``
    (compiled checkpointing replays the graph, not the module).
    """
    return not compiling() and in_backward()


class InForce(NamedTuple):
    """What a forward reads besides its input: the buffers of :attr:`_StepMixin._FORWARD_BUFFERS` (``state``) and
    values derived from them (``derived``: the mean per kernel tap, ``DirectWhiten``'s 1x1 weights). ``copies``:
    ``state`` holds copies of the buffers, which no one writes (a training forward's, the module docstring): the
    derived values are kept with them, made once per fold; else ``state`` holds the buffers themselves, and
    ``derived`` stays empty (made at each forward)."""

    state: Dict[str, Tensor]
    derived: Dict[Any, Any]
    copies: bool


class Reads:
    """A layer's record of what its forwards read: ``copies``, the :class:`InForce` of the training forwards (``None``:
    the buffers were written since, its copies are taken at the next one), and ``last``, what the last forward read
    (a forward recomputed inside a backward reads it again, derived values included: it runs the same operations,
    which selective checkpointing replays). Written by the forward and by :meth:`dropped` only."""

    __slots__ = ("copies", "last")

    def __init__(self) -> None:
        self.copies: Optional[InForce] = None
        self.last: Optional[InForce] = None

    def dropped(self) -> None:
        """The buffers were written: the next training forward takes new copies (a recomputed forward still reads
        what its original forward read)."""
        self.copies = None


class Step(NamedTuple):
    """What one forward of a layer does, decided once, at its start (:meth:`_StepMixin._begin`)."""

    #: What the forward reads (:class:`InForce`).
    reads: InForce
    #: A training batch that the forward counts at its end (:meth:`_StepMixin._end`).
    counts: bool
    #: The block's end is folded at the end of the model's forward (by its coordinator), not at once.
    coordinated: bool = False
    #: The forward runs inside a compiled graph (nothing kept between forwards may be read).
    traced: bool = False
    #: The rows a compiled forward added (counted outside the graph at its end).
    rows: int = 0
    #: An eager forward of a training step (no ``torch.jit`` trace, no dynamo, no torch.func transform running),
    #: which the forward's parts need not ask again.
    plain: bool = False


#: What a batch counted without a forward of its own reads: nothing (a compiled forward's calls counted after the
#: graph, a joined rank's batch without data).
NOTHING_READ = InForce({}, {}, False)


def _define_snapshot_op() -> None:
    """``torch.ops.whitenlayers.snapshot(x)``: a copy of ``x``, an operator of its own so that a compiled graph keeps
    it. A compiled forward reads its buffers through it: the graph's backward then holds the copies, which
    AOTAutograd's partitioner saves rather than recomputing them from the buffers in the backward (it recomputes a
    ``clone``; an operator outside its allowlist is never recomputed), so a fold may write the buffers in place
    between a forward and its backward, and the buffers keep their addresses (CUDA graphs)."""
    if hasattr(torch.ops.whitenlayers, "snapshot"):  # defined already (a module reloaded)
        return
    lib = torch.library.Library("whitenlayers", "FRAGMENT")
    lib.define("snapshot(Tensor x) -> Tensor")
    lib.impl("snapshot", lambda x: x.clone(), "CompositeExplicitAutograd")
    _LIBRARIES.append(lib)  # a Library object unregisters its operators when collected
    torch.fx.node.has_side_effect(torch.ops.whitenlayers.snapshot.default)  # never moved to the backward


_LIBRARIES: list = []
_define_snapshot_op()


def _work_dtype(x: Tensor) -> torch.dtype:
    """The dtype a batch's statistics are computed in: its own when float32 / float64, else float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _fold_untraced(layer: Any) -> None:
    """Fold ``layer`` outside a ``torch.jit.trace`` in progress: in a thread of its own (the tracer records the
    calling thread only), which this one waits for (its exception raised here)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="whitenlayers-fold-outside-trace") as pool:
        pool.submit(layer._fold_now).result()


class _StepMixin(_Layer):
    """The per-step part of :class:`~whitenlayers.WhiteningLayer` (this module's docstring)."""

    #: The buffers a forward reads.
    _FORWARD_BUFFERS: Tuple[str, ...] = ("running_mean",)

    # ------------------------------------------------------------------ a forward
    def _begin(self, x: Tensor) -> Step:
        """Start a forward (``x``: the batch's features on dim 1): the :class:`Step` it takes, and, for a training
        batch that gathers statistics, the batch added to the block.

        A forward recomputed inside a backward (activation checkpointing) is not a batch: it reads what its original
        forward read, even if a fold came in between. A block that ended without being folded (its model's forward
        did not end: the layer was called again within it, or the forward was exported) is folded first. Under
        ``torch.inference_mode`` a training-mode forward gathers and counts nothing (a fold there would store
        inference tensors as state)."""
        if compiling():
            return self._begin_traced(x)
        reads = self._reads
        if in_backward():  # recomputed inside a backward
            return Step(reads.last if reads.last is not None else self._buffers_in_force(), False)
        block = self._block
        if block.fold_pending:
            if torch.jit.is_tracing():
                _fold_untraced(self)  # (its check run, which finds nothing pending, traces the same graph)
            else:
                self._fold_now()
        coordinator = self._fold_coordinator
        scope = coordinator.scopes.get(get_ident()) if coordinator is not None and coordinator.scopes else None
        if not self.gathers_now(scope):
            reads.last = self._buffers_in_force()
            return Step(reads.last, False)
        if transforms_active():
            raise RuntimeError(
                f"{self._describe()}: a training-mode forward inside a torch.func transform (vmap, grad, jacrev, ...) "
                "is not supported: the layer adds the batch to its block statistics and folds them into its buffers in "
                "place, and a transformed (batched or gradient-tracking) tensor cannot be written into the layer's "
                "state. " + FUNC_WHAT_TO_DO)
        plain = not torch.jit.is_tracing()  # (a trace reads the buffers themselves: nothing kept by one run of it)
        if plain:
            reads.last = reads.copies if reads.copies is not None else self._copies_in_force()
        else:
            reads.last = self._buffers_in_force()
        if block.gather_next:
            self._add_batch(x)
        return Step(reads.last, True, scope is not None, False, 0, plain)

    def gathers_now(self, scope: Optional["ForwardScope"] = None, explicit: bool = False, traced: bool = False) -> bool:
        """Whether the layer gathers statistics now, counts its batches and folds at its blocks' ends: the one place
        that decides it, read by the eager and the compiled forward (:meth:`_begin`, :meth:`_begin_traced`),
        :meth:`~whitenlayers.WhiteningLayer.accumulate`, a joined rank's batches without data
        (:func:`~whitenlayers.joinable`) and the fold's check for layers never called. Never while
        :attr:`frozen`; for a forward (``explicit=False``) only in training mode, outside ``torch.inference_mode`` (a
        fold there would store inference tensors as state; ``traced``: inside a compiled graph, which cannot ask:
        dynamo breaks the graph on it), and not in a training-mode forward of one rank under DDP (``scope.local``,
        :meth:`~whitenlayers.coordinator.FoldCoordinator.begin_forward`). ``explicit``: a call of ``accumulate``,
        which adds its batch whatever the mode."""
        if self.frozen:
            return False
        return explicit or (self.training and (traced or not torch.is_inference_mode_enabled())
                            and (scope is None or not scope.local))

    def _buffers_in_force(self) -> InForce:
        """The buffers a forward reads, themselves (a forward after which no fold runs before its backward)."""
        buffers = self._buffers
        return InForce({name: buffers[name] for name in self._FORWARD_BUFFERS}, {}, False)

    def _copies_in_force(self) -> InForce:
        """What the training forwards read until the buffers are written again: copies of them, taken now."""
        buffers = self._buffers_in_force().state
        if any(buf.is_meta for buf in buffers.values()):
            raise RuntimeError(
                f"{self._describe()}: its state is on the meta device (the model was built there and not loaded or "
                "initialised): load a checkpoint with model.load_state_dict(state_dict, assign=True), or call "
                "model.to_empty(device=...) and then each layer's reset_parameters() (reset_running_stats() for the "
                "whitening state alone)")
        with torch.no_grad():
            copies = InForce({name: buf.clone() for name, buf in buffers.items()}, {}, True)
        if not torch.is_inference_mode_enabled():  # (never keep an inference tensor: no later step could save it)
            self._reads.copies = copies
        return copies

    @staticmethod
    def _derived(reads: InForce, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, kept with ``reads`` when they are copies (made once per fold), else made now."""
        if not reads.copies:  # (a compiled forward's are never copies)
            return make()
        value = reads.derived.get(key)
        if value is None:
            value = reads.derived[key] = make()
        return value

    def _add_batch(self, x: Tensor) -> None:
        """Add the batch ``x`` (features on dim 1) to the block: its sums about the block's shift (chosen at the
        block's first gathered batch) into the accumulator (:meth:`~whitenlayers.layers.block.Block.add`, the one
        formula), and its rows counted. No host synchronisation and no check: a non-finite batch makes its block's
        sums non-finite, and the fold drops that block (counted)."""
        block = self._block
        if block.fraction < 1.0 and x.shape[0] > 1:
            x = x[: stats_samples(x.shape[0], x.shape[1:].numel() // self.num_features, self.num_features,
                                  block.fraction)]
        device = x.device
        if block.s1.device != device:  # accumulators left on another device (the meta device: a new, empty block)
            if block.s1.is_meta or block.store.is_meta:
                self._reset_accumulators(device)
            else:
                block.move(lambda t: t.to(device), None)
        if block.shift is None:
            self._start_block(x.detach())
        elif not block.unshifted and (block.shift_x is None or block.shift_x.dim() != x.dim()):
            # a block resumed from a checkpoint, or a batch of another rank than the block's first
            block.shift_x = block.shift.to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2))
        if torch.is_autocast_enabled(device.type) and (block.acc is None or not fused_moments_on(device)):
            with no_autocast(device):  # the CPU's and grouped products (the fewest-kernel path's are in place)
                block.add(x.detach(), block.shift_x)
        else:
            block.add(x.detach(), block.shift_x)
        block.rows += x.numel() // self.num_features

    def _start_block(self, x: Optional[Tensor] = None, first: Optional[Tensor] = None) -> None:
        """Choose the block's shift: 0 when it sums unshifted, else the mean in force or, for the very first block,
        the mean of its first gathered batch ``x`` (or ``first``, float64: a compiled forward's), 0 where that is not
        finite, so that one bad batch cannot poison the block's other batches. The one place a shift is chosen; on
        the device (no host synchronisation), written into the block's shift tensor (a compiled graph reads it)."""
        block = self._block
        store = block.store
        with torch.no_grad():
            if block.unshifted:
                store.zero_()
            else:
                if first is None and x is not None and x.numel() > 0:
                    first = x.mean([0] + list(range(2, x.dim())), dtype=_work_dtype(x)).to(torch.float64)
                first = torch.zeros_like(store) if first is None else torch.nan_to_num(
                    first.to(store.device), nan=0.0, posinf=0.0, neginf=0.0)
                in_force = self._buffers["running_mean"].detach().to(store.device, torch.float64)
                store.copy_(torch.where(self._buffers["num_blocks"].to(store.device) > 0, in_force, first))
        block.shift = store
        block.shift_x = None if block.unshifted or x is None else store.to(_work_dtype(x)).view(
            (1, -1) + (1,) * (x.dim() - 2))

    def _end(self, step: Step, weight: Optional[Tensor]) -> None:
        """End a training batch: count it; at the block's end, fold (:meth:`_block_ends`). ``weight``: the weight the
        forward used (what the fold compensates with). A compiled forward's batch is counted outside the graph: by
        the coordinator after the root's forward when the root is what was compiled (one graph), else here through
        a graph break (a compiled sub-module, or a layer on its own)."""
        if step.traced:
            coordinator = self._fold_coordinator
            if coordinator is not None and coordinator.traced_open:
                unchecked_side_effect(coordinator.traced_calls.append, (self, step.rows))
            else:
                _count_outside_graph(self, step.rows)
            return
        block = self._block
        n = block.batches = block.batches + 1
        block.gather_next = n % block.every == 0
        if n >= block.length:
            self._block_ends(weight, step.coordinated)

    def _count_without_data(self) -> None:
        """A batch this rank did not run, counted as the others count theirs (a rank that has joined under
        :func:`~whitenlayers.coordinator.joinable`); a block's end is folded by the coordinator, with the others."""
        self._end(Step(NOTHING_READ, True, coordinated=True), None)

    def _block_ends(self, weight: Optional[Tensor], coordinated: bool) -> None:
        """The block's last batch was counted: fold at the end of the model's forward (``coordinated``: its
        coordinator folds all its layers together there), else now."""
        block = self._block
        block.fold_pending = True
        block.fold_weight = self._fold_weight_of(weight)
        if coordinated:
            cast(Any, self._fold_coordinator).request(self)
        else:
            self._fold_now()

    def _fold_now(self) -> None:
        """Fold this layer alone, now; a fold of an asynchronous coordinator that it still has pending first."""
        coordinator = self._fold_coordinator
        if coordinator is not None:
            coordinator.wait()
        fold_layers([cast(Any, self)])

    # -------------------------------------------------------------- compiled
    def _begin_traced(self, x: Tensor) -> Step:
        """:meth:`_begin` inside a compiled graph: the buffers copied in the graph (no backward: the buffers
        themselves) and the batch's sums added about the block's shift tensor; its end counts it outside the graph
        (:meth:`_end`)."""
        buffers = self._buffers
        names = self._FORWARD_BUFFERS
        if not torch.is_grad_enabled() or exporting():  # no backward to keep values for (an export, ONNX)
            reads = InForce({name: buffers[name] for name in names}, {}, False)
        else:
            snapshot = torch.ops.whitenlayers.snapshot
            reads = InForce({name: snapshot(buffers[name]) for name in names}, {}, False)
        if not self.gathers_now(traced=True):
            return Step(reads, False, traced=True)
        return Step(reads, True, traced=True, rows=self._add_batch_traced(x) if self._block.gather_next else 0)

    def _add_batch_traced(self, x: Tensor) -> int:
        """:meth:`_add_batch` in a compiled graph, always about the block's shift tensor (no per-layer flag to guard
        on): a block whose shift is not chosen yet is summed about the tensor's values as they are, and moved to the
        shift after the forward (:meth:`_count_traced`); the sums are :meth:`~whitenlayers.layers.block.Block.add`'s.
        Returns the rows added."""
        block = self._block
        if not TRAINING_EXPORT and type(x).__name__ == "FunctionalTensor":  # (torch.export's, not torch.compile's)
            raise RuntimeError(
                f"{self._describe()}: torch.export of a training-mode forward, which adds the batch to the layer's "
                f"block, needs torch >= 2.6 (torch {torch.__version__} cannot write it in the exported graph); export "
                "the model in eval mode (model.eval()) or inside `with wl.frozen(model):`")
        x = x.detach()
        if block.fraction < 1.0 and x.shape[0] > 1:
            x = x[: stats_samples(x.shape[0], x.shape[1:].numel() // self.num_features, self.num_features,
                                  block.fraction)]
        with no_autocast(x.device):
            block.add(x, block.store.to(_work_dtype(x)).view((1, -1) + (1,) * (x.dim() - 2)), traced=True)
        return x.numel() // self.num_features

    def _count_traced(self, calls: List[int], coordinated: bool = False) -> None:
        """Outside the graph, after a compiled forward that called this layer (``calls``: the rows of each call):
        what :meth:`_add_batch` and :meth:`_end` count in eager mode, a batch per call; ``coordinated``: the root's
        forward folds at its end. The first calls of a block whose shift was not chosen have their sums moved to
        the shift they choose (float64). A block that ends before the forward's last call takes the later calls too
        (a warning, once)."""
        block = self._block
        if block.shift is None and sum(calls) > 0:  # the block's first gathered calls: their shift now
            self._recentre_block(sum(calls))
        for i, rows in enumerate(calls):
            block.rows += rows
            self._end(Step(NOTHING_READ, True, coordinated=coordinated), None)
            if block.fold_pending and i < len(calls) - 1:
                self._warn_once("traced_calls", (
                    f"called {len(calls)} times in one compiled forward, and a block ended after call {i + 1}: the "
                    "fold waits for the forward's end, so this block also holds the forward's later calls (in "
                    "eager mode it would fold between them); make block_size * accumulation_steps a multiple of "
                    f"{len(calls)} for blocks of exactly block_size batches"))
                block.rows += sum(calls[i + 1:])
                block.batches += len(calls) - i - 1
                break

    def _recentre_block(self, rows: float) -> None:
        """The block's first compiled batch(es), summed about the shift tensor's values as they were: the shift they
        choose (:meth:`_start_block`, from their mean), and their sums moved to it in float64 (``s2 - s1 d^T -
        d s1^T + n d d^T``, ``s1 - n d``; the product's rounding stays that of the values it was taken about)."""
        block = self._block
        store = block.store
        with torch.no_grad(), no_autocast(store.device):
            n = float(rows)
            s1_64 = block.s1.to(torch.float64)
            old = store.clone()
            self._start_block(None, old + s1_64 / n if n > 0 else None)
            d = store - old
            sd = F_w.block_outer(s1_64, d, self.groups)  # per group (s2: its diagonal blocks)
            s2 = block.s2.to(torch.float64).view(sd.shape) - sd - sd.mT + n * F_w.block_outer(d, d, self.groups)
            block.s2.copy_(s2.view(block.s2.shape))
            block.s1.copy_(s1_64 - n * d)


@graph_break  # the counting and a fold run eagerly
def _count_outside_graph(layer: _StepMixin, rows: int) -> None:
    """A compiled forward's batch counted by the layer itself: nothing after the graph would count it (the graph is
    a sub-module's, or the layer has no coordinator)."""
    layer._count_traced([rows])


class _GradStep(_Layer):
    """The forward of the grad / recursive layers (convolutions of any dimension and linear layers): this module's
    docstring. The layer class sets ``_op`` (its operation: the plain conv's ``_conv_forward``, or
    ``F.linear``), ``_BATCHED_RANK`` and ``_SPATIAL``."""

    _op: Callable[..., Tensor]
    #: The rank of a batched input (the forward's fast check), and a convolution's spatial dimensions (0: linear).
    _BATCHED_RANK: int = 2
    _SPATIAL: int = 0
    #: A :func:`~whitenlayers.defer_grad_transform` deferral of the weight-gradient transform, or ``None``.
    _deferral: Any = None
    #: Where the BatchNorm that absorbs the centring is (absorb_centring), or ``None``.
    _centring_ref: Optional["CentringRef"] = None
    features: str = "channels"

    def forward(self, x: Tensor) -> Tensor:
        """The plain layer's operation with the weight whose gradient is right-multiplied by ``Q_s`` and the
        centred input's bias ``b + c - sum_k W_k mu`` (or, centring absorbed, ``b``); in training mode the batch
        also joins the block statistics.

        Args:
            x: the input as the plain layer takes it: ``(B, C, *spatial)`` or unbatched ``(C, *spatial)`` for a
                convolution (``C = in_channels``), ``(*, in_features)`` for a linear layer; floating point.
        """
        if self._centring_ref is not None and self._forward_hooks:  # hooks added after the absorption
            self._centre_for_hooks()
        params = self._parameters  # (read without Module.__getattr__; a parametrized weight is a property)
        w = params["weight"] if "weight" in params else self.weight  # read once: computed once per forward
        feats = x
        if not (isinstance(x, Tensor) and x.dim() == self._BATCHED_RANK and self.features == "channels"
                and x.shape[1] == self.num_features
                and (x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type))):
            feats = self._features_of(x, w)  # every other input: checked (a clear error), its features on dim 1
        step = self._begin(feats)
        reads = step.reads
        if not torch.is_grad_enabled():
            pass
        elif step.plain and w.requires_grad and self._deferral is None and self.features == "channels":
            w = grad_transformed_apply(w, reads.state["grad_transform"])  # (a training step's case: nothing to ask)
        elif w.requires_grad or not (step.plain or step.traced) and transforms_active():
            w = self._transformed_weight(w, reads.state["grad_transform"])
        bn = None
        ref = self._centring_ref
        if ref is not None:  # centring absorbed: by the BatchNorm there, while it normalises with batch statistics
            bn = ref.child if ref.parent is None else ref.parent._modules.get(ref.child)
            if not (isinstance(bn, BATCH_NORMS)
                    and (bn.training or (bn.running_mean is None and bn.running_var is None))):
                bn = None
        if bn is not None:
            if bn.training and bn.track_running_stats and bn._buffers.get("running_mean") is not None:
                self._track_absorbed_offset(w, bn, reads, step.plain)
            out = self._op(x, w, params["bias"] if "bias" in params else self.bias)
        elif (self._SPATIAL and params.get("bias", 0) is None and self.training and w.requires_grad
              and torch.is_grad_enabled()):
            # Training a bias-free conv (the ResNet case): the centring term added to the output, not passed as a
            # bias (the CPU convolution's bias gradient is several times slower than autograd's one reduction for
            # this add; the two differ by rounding only); out of place (a selective checkpoint may have cached the
            # convolution's output)
            out = self._op(x, w, None) + self._layer_bias(w, reads).view((-1,) + (1,) * self._SPATIAL)
        else:  # the plain layer's own bias path: bit-identical to to_plain_model's
            out = self._op(x, w, self._layer_bias(w, reads))
        if step.counts:
            self._end(step, w)
        return out

    def _transformed_weight(self, w: Tensor, q: Tensor) -> Tensor:
        """The weight whose gradient the backward right-multiplies by this forward's ``Q_s`` (even if a fold follows):
        (``q``) through the autograd Function, or, with :func:`~whitenlayers.defer_grad_transform`, the weight itself,
        whose hook transforms the gradient. Under a torch.func transform a weight with a forward-mode tangent
        (``jvp``) requires no grad: it takes the Function too, whose ``jvp`` is its backward's adjoint."""
        deferral = self._deferral
        if deferral is not None:
            if compiling():  # the graph takes the Function below; the hook must go
                deferral.leave()
            elif not transforms_active():  # (torch.func's gradients never reach the weight's hook)
                deferred = deferral(w, q)
                if deferred is not None:
                    return deferred
        check_not_tracing_function(self, "the weight-gradient transform")
        if self.features == "patches":  # Q acts on the flattened C k^2 axis
            return grad_transformed(w.flatten(1), q).view_as(w)
        return grad_transformed(w, q)

    # ------------------------------------------------------------ centring
    def _layer_bias(self, weight: Tensor, reads: Optional[InForce] = None) -> Tensor:
        """The bias of the equivalent plain layer, ``b + c - sum_k W_k mu`` (in ``weight``'s dtype), minus ``d`` when
        the centring is absorbed (the output is then the centred layer's minus ``d``, what its BatchNorm's running
        mean expects). ``reads``: what this forward reads (default: the buffers themselves)."""
        offset = self._offset(weight, self._buffers_in_force() if reads is None else reads)
        bias = offset if self.bias is None else self.bias + offset
        absorbed = self._buffers.get("absorbed_offset")
        return bias if absorbed is None else bias - absorbed.to(bias.dtype)

    def _offset(self, weight: Tensor, reads: InForce) -> Tensor:
        """``s = c - sum_k W_k mu`` (one ``addmv`` for a dense layer), in ``weight``'s dtype, from the mean and bias
        compensation the forward reads."""
        mean, comp = reads.state["running_mean"], reads.state["bias_correction"]
        if self.groups != 1:  # grouped conv: each group's outputs see its own channels of the mean
            return comp.to(weight.dtype) - F_w.weight_mean_product(weight, mean)
        rows, taps_last = _weight_rows(weight)
        mean_k = self._mean_per_tap(reads, rows.shape[1] // mean.shape[0], weight.dtype, taps_last)
        if onnx_exporting():  # the TorchScript-based exporter has no addmv
            return comp.to(weight.dtype) - rows @ mean_k
        return torch.addmv(comp.to(weight.dtype), rows, mean_k, alpha=-1)

    def _mean_per_tap(self, reads: InForce, taps: int, dtype: torch.dtype, taps_last: bool = False) -> Tensor:
        """``mu`` (the forward's) repeated for each of ``taps`` kernel taps, in ``dtype``: ``rows @ mu_k = sum_k W_k
        mu`` in one product for the weight's rows (:func:`_weight_rows`; ``taps_last``: their tap-major order; a patch
        layer's mean has one entry per tap already). Made once per fold for a training forward
        (:meth:`~_StepMixin._derived`)."""
        mean = reads.state["running_mean"]

        def make() -> Tensor:
            value = mean.to(dtype)
            if taps != 1:
                value = value.repeat(taps) if taps_last else value.repeat_interleave(taps)
            return value

        return self._derived(reads, ("taps", dtype, taps_last, mean.shape[0] * taps), make)

    def _track_absorbed_offset(self, weight: Tensor, bn: nn.Module, reads: InForce, plain: bool = False) -> None:
        """``d <- (1 - f) d + f s`` with the BatchNorm's factor ``f``, as it updates its running mean now: one in-place
        product-accumulate on the weight's rows as they lie (no copy of a channels_last weight), no autocast (in-place
        ops are never autocast). ``plain``: a training step's eager forward (:attr:`Step.plain`)."""
        if not plain and not compiling() and transforms_active():
            raise RuntimeError(
                f"{self._describe()}: its centring is absorbed by a BatchNorm in training mode, whose running mean "
                "it follows in place; a torch.func transform (vmap, grad, jacrev, ...) cannot update state in place "
                "(the BatchNorm itself fails there too). " + FUNC_WHAT_TO_DO)
        d = self._buffers["absorbed_offset"]
        factor: Any = bn.momentum
        if factor is None:  # cumulative average: f = 1 / num_batches_tracked after the BatchNorm's increment
            tracked = bn._buffers.get("num_batches_tracked")
            if tracked is None:
                return
            factor = (tracked.to(device=d.device, dtype=d.dtype) + 1).reciprocal()
        if isinstance(factor, float) and self.groups == 1 and (plain or not onnx_exporting()):
            # c = 0 for an absorbed layer (it lives in d): d <- (1 - f) d + f (c - W mu) is one product-accumulate
            rows, taps_last = _weight_rows(weight.detach() if weight.dtype == d.dtype else weight.detach().to(d.dtype))
            key = ("taps", rows.dtype, taps_last, rows.shape[1])
            mean_k = reads.derived.get(key)
            if mean_k is None:
                mean_k = self._mean_per_tap(reads, rows.shape[1] // self.num_features, rows.dtype, taps_last)
            d.addmv_(rows, mean_k, beta=1.0 - factor, alpha=-factor)
            return
        w = weight.detach().to(d.dtype)
        with no_autocast(d.device):  # an out-of-place product under CUDA's autocast would run in bf16 / fp16
            d.lerp_(self._offset(w, reads), factor)


class CentringRef(NamedTuple):
    """Where the BatchNorm that absorbs a layer's centring is (:meth:`~whitenlayers.GradWhitenConv2d.absorb_centring`):
    the BatchNorm itself (``parent`` ``None``, ``child`` the module), or whatever module is ``parent``'s child named
    ``child`` now."""

    parent: Optional[nn.Module]
    child: Any


def _weight_rows(weight: Tensor) -> Tuple[Tensor, bool]:
    """The weight as an ``(S, M k)`` matrix of rows without a copy where its layout allows: channel-major (a view of a
    contiguous weight) or, for a channels_last weight, tap-major (a view of its memory), with whether it is
    tap-major."""
    if weight.dim() > 3 and not weight.is_contiguous():
        moved = weight.movedim(1, -1)  # (S, *kernel, C): contiguous for a channels_last weight
        if moved.is_contiguous():
            return moved.reshape(weight.shape[0], -1), True
    return weight.reshape(weight.shape[0], -1), False
