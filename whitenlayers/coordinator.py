"""The fold coordinator: a converted model's forward hooks, which do together, once per forward of the model, what
its layers would do alone: their weights through one shared gradient-transform node, their batches' statistics
added a few operations for all of them, and their folds stacked at the forward's end (one set of collectives per
block), at once or (with ``fold_async``) one block late in a worker thread. A layer called without them (through a
sub-module, or compiled on its own) does the same work itself. The fold is :mod:`whitenlayers.fold`'s."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ._torch_compat import no_autocast
from .autograd import _fast_apply, _transforms_active
from .fold import (
    PendingFold,
    _begin,
    _compute_folds,
    _dist_group,
    _fold_chunks,
    _fold_states,
    _global_summaries,
    _local_summaries,
    _taken_blocks,
    _warn_uncalled,
    check_strategy,
    fold_layers,
    warn_nonfinite,
)
from .functional.batch import _kernel1_weight_grad, transform_weight_grad
from .functional.stacked import accumulate_moments_grouped, stack_shifts, stacked_moments_accumulator

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.hooks import RemovableHandle

    from .fold import BlockSums
    from .functional.moments import BlockSummary
    from .layers import WhiteningLayer

__all__ = ["FoldCoordinator", "ForwardScope", "SharedWeightGradTransform", "SharedWeightProduct", "check_fold_async",
           "joinable"]

_get_ident = threading.get_ident
_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# (for the C-level loops over a forward's handed batches, _add_handed_batches)
_version = operator.attrgetter("_version")
_shape = operator.attrgetter("shape")
_stride = operator.methodcaller("stride")
_dtype = operator.attrgetter("dtype")
_get_device = operator.methodcaller("get_device")
_acc_of = operator.attrgetter("_block.acc")
_acc_dtype = operator.attrgetter("_block.acc.dtype")
_shift_of = operator.attrgetter("shift")
_not_none = functools.partial(operator.is_not, None)

#: Under ``torch.distributed`` the grad / recursive weights go through a shared node in runs of this many layers
#: (consecutive in the model's order), not one node for all: DDP all-reduces a bucket of gradients once every
#: gradient in it is ready, so a run holds its layers' gradients only until its last layer's backward.
DISTRIBUTED_RUN = 4


class SharedWeightGradTransform(torch.autograd.Function):
    """The weight-gradient transform of several layers' weights in one autograd node: the identity on each weight in
    the forward (a view of it); in the backward, called once for all of them, each weight's gradient
    right-multiplied by the ``Q_s`` its layer's forward registered in ``qs`` when it took the view (``None`` where a
    weight took no gradient or its view was not taken). One Python call per forward and per backward instead of
    one per layer each. Not for the torch.func transforms (no vmap or jvp rule)."""

    @staticmethod
    def forward(ctx: Any, qs: List[Optional[Tensor]], *weights: Tensor) -> Tuple[Tensor, ...]:
        ctx.qs = qs  # filled by the layers' forwards (ForwardScope.weights)
        ctx.set_materialize_grads(False)
        return weights  # each an input returned as it is: autograd returns a view of it (made in C++), its output

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        out: List[Optional[Tensor]] = [None]
        for g, q in zip(grads, ctx.qs):
            if g is None or q is None:
                out.append(None)
                continue
            shape = g.shape
            if (len(shape) == 4 and shape[2] == 1 and shape[3] == 1 and q.dim() == 2 and q.dtype == g.dtype
                    and g.is_contiguous()):
                out.append(_kernel1_weight_grad(g, q))  # most of a ResNet's layers, without the general dispatch
            else:
                out.append(transform_weight_grad(g, q))
        return tuple(out)


class SharedWeightProduct(torch.autograd.Function):
    """Several fused ``direct`` wrappers' weights times their ``T`` on the input-feature axis (``W T``, what each
    convolves with) in one autograd node: the products in the forward (in the weights' dtype: no autocast), and in
    the backward, called once for all of them, each weight's gradient ``dW = d(W T) T^T`` (``None`` where a product
    took no gradient). Not for the torch.func transforms."""

    @staticmethod
    def forward(ctx: Any, ts: Tuple[Tensor, ...], ts_transposed: Tuple[Tensor, ...], *weights: Tensor
                ) -> Tuple[Tensor, ...]:
        ctx.ts_transposed = ts_transposed  # each T^T (``T.mT``, kept in the layer's step cache across forwards)
        ctx.set_materialize_grads(False)
        with torch.autocast(device_type=weights[0].device.type, enabled=False):  # (one device: _shared_products)
            return tuple(map(transform_weight_grad, weights, ts))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        out: List[Optional[Tensor]] = [None, None]
        for g, tt in zip(grads, ctx.ts_transposed):
            out.append(None if g is None else transform_weight_grad(g, tt))
        return tuple(out)


#: The shared nodes' C++ apply (their callers run outside the torch.func transforms, with Parameters: nothing to
#: unwrap), or their ``Function.apply``.
shared_weight_grad_apply: Any = _fast_apply(SharedWeightGradTransform) or SharedWeightGradTransform.apply
shared_weight_product_apply: Any = _fast_apply(SharedWeightProduct) or SharedWeightProduct.apply


class SharedWeight(NamedTuple):
    """A grad / recursive layer's weight in a shared ``SharedWeightGradTransform`` node (:func:`_shared_weights`):
    the layer takes ``view`` when ``weight`` is its forward's, registering that forward's ``Q_s`` as
    ``qs[slot]``."""

    view: Tensor
    weight: Tensor
    qs: List[Optional[Tensor]]
    slot: int


class SharedProduct(NamedTuple):
    """A fused ``direct`` wrapper's ``W T`` (``product``) in a shared ``SharedWeightProduct`` node
    (:func:`_shared_products`), made from ``weight`` and ``t`` with the buffers in force (``state``, which its
    forward reads)."""

    product: Tensor
    weight: Tensor
    t: Tensor
    state: Dict[str, Tensor]


class HandedBatch(NamedTuple):
    """A batch a layer handed to its forward's scope (:meth:`~whitenlayers.layers.step._StepMixin._add_batch`), added
    at the forward's end: the batch ``x`` as the layer read it (its ``version`` then: a write since is an error),
    and the ``shift`` it is summed about (``None``: about 0)."""

    layer: Any
    x: Tensor
    version: int
    shift: Optional[Tensor]


class TracedCall(NamedTuple):
    """A layer's call inside a compiled root forward (``FoldCoordinator.traced_calls``): the ``rows`` it added,
    counted after the graph."""

    layer: Any
    rows: int


class ForwardScope(NamedTuple):
    """What a fold coordinator offers its layers during one eager forward of its model (one per thread,
    ``coordinator.scopes``). A layer whose block ends while a scope is open asks the coordinator to fold it at the
    forward's end."""

    #: Each grad / recursive layer's :class:`SharedWeight`: its weight's view in one shared node.
    weights: Dict[Any, SharedWeight]
    #: Each fused ``direct`` wrapper's ``DirectWhiten``'s :class:`SharedProduct`: its ``W T`` in one shared node.
    products: Dict[Any, SharedProduct]
    #: The batches the layers hand over (:class:`HandedBatch`), added together at the forward's end; ``None`` where
    #: the forward keeps no batch for later (no backward recorded, a ``torch.jit`` trace).
    batches: Optional[List[HandedBatch]]
    #: A forward inside DDP's in a ``Join`` context: its fold comes after its backward.
    join: bool = False
    #: Nothing gathered or counted, for a training-mode forward of one rank (the module inside DDP called alone).
    local: bool = False


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward (the module docstring).

    :func:`whitenlayers.convert_model` installs it on the root module: :meth:`begin_forward` as a forward pre-hook,
    the coordinator itself as a forward hook (always called, so a forward that raised still adds its batches).
    Before an eager forward it opens the thread's ``ForwardScope``; layers whose block ends during the forward
    ask to be folded, and the hook folds them in one :func:`~whitenlayers.fold.fold_layers` call. Folding after
    the model's forward instead of right after each layer's forward changes nothing: a block's statistics and the
    transform in force for that batch's backward are the same. ``strategy`` is
    :func:`~whitenlayers.fold.fold_layers`'s (how transforms are spread over ranks).

    When the root is compiled, the pre-hook runs inside the graph and marks the forward (:attr:`traced_open`): the
    layers' compiled forwards list their calls in ``traced_calls`` instead of counting them (no Python number
    in the graph that changes from step to step), and the hook, outside the graph, counts them and folds. A
    compiled sub-module has no such mark: its layers count through a graph break each. A compiled forward whose
    backward holds the layers' buffers themselves (compiled activation checkpointing recomputes the graph's copies of
    them there) folds after that backward.

    ``fold_async=True``: the fold of a block runs in a worker thread (on CUDA, on a stream of its own) while the
    next block trains, and is written at the end of that next block: the transform built from block ``i`` is in
    force from block ``i + 2`` on. At each block's end the coordinator waits for the fold in flight, reads the
    block's sums (summed across ranks on this thread: the collectives never leave the training thread), writes the
    previous fold (the bias compensation with the weight of this forward, so the function is unchanged at the
    swap), then starts this block's fold from copies of the buffers it reads. The result never depends on timing.
    Every rank folds every layer (``"replicated"``; ``"owner"`` is refused). A checkpoint taken while a fold is in
    flight waits for it and saves its result (each layer's extra state).

    At the first fold after a conversion it checks that every whitening layer of the model (:attr:`layers`) in
    training mode was called: a layer whose weight the model uses without calling it as a module (e.g.
    torchvision's Swin attention passes ``qkv.weight`` to a function) cannot whiten; a ``RuntimeWarning`` names
    them.

    Args:
        strategy: :func:`~whitenlayers.fold.fold_layers`'s, ``"auto"`` (default), ``"replicated"`` or ``"owner"``.
        fold_async: fold off the training thread, one block late (default ``False``), as above.
    """

    #: Defaults for coordinators pickled before these attributes existed (nothing to check).
    layers: Sequence["WhiteningLayer"] = ()
    #: The model's ``DirectWhitenWrapper`` modules (their weights' products shared, ``SharedWeightProduct``).
    wrappers: Sequence[Any] = ()
    checked: bool = True
    fold_async: bool = False
    #: The open scopes of eager forwards, per thread (``DataParallel`` runs replicas in threads); never pickled.
    scopes: Dict[int, ForwardScope] = {}
    #: Set by the pre-hook inside a compiled root forward; its layers' calls (:class:`TracedCall`) in
    #: ``traced_calls``, counted by the hook after the graph.
    traced_open: bool = False
    traced_calls: List[TracedCall] = []
    #: The model has run inside ``DistributedDataParallel``'s forward (:meth:`begin_forward`).
    under_ddp: bool = False
    warned_local: bool = False
    #: The ``Joinable`` :func:`~whitenlayers.joinable` made for this model (a ``Join`` enables it); never pickled.
    joined: Any = None
    #: The fold in flight (:class:`_InFlight`), or ``None``.
    _in_flight: Optional["_InFlight"] = None
    _executor: Any = None
    _streams: Dict[torch.device, Any]
    #: The stacked accumulators of the groups of layers whose batches are added together (``_arena``); never
    #: pickled (the layers' accumulators are pickled apart, and stacked again at the next forward).
    _arenas: Dict[tuple, "_Arena"]

    def __init__(self, strategy: str = "auto", fold_async: bool = False) -> None:
        self.pending: List["WhiteningLayer"] = []
        self.handle: Optional[RemovableHandle] = None
        self.begin_handle: Optional[RemovableHandle] = None  # the pre-hook's (begin_forward)
        self.strategy = check_strategy(strategy)
        self.fold_async = check_fold_async(fold_async, strategy)
        self.layers = []
        self.wrappers = []
        self.checked = False
        self.scopes, self._arenas, self._streams = {}, {}, {}

    def begin_forward(self, module: nn.Module, inputs: Any) -> None:
        """The model's forward pre-hook: open this thread's ``ForwardScope`` (a forward of the model inside
        it, nested, adds to the open one) with the grad / recursive layers' weights through one shared node (in one
        process; under ``torch.distributed`` in runs of ``DISTRIBUTED_RUN``). Inside a compiled graph: mark the
        forward (:attr:`traced_open`).

        Under ``torch.distributed`` with ``DistributedDataParallel``: a forward inside DDP's that runs in a ``Join``
        context (uneven inputs) folds after its backward (the fold's collectives after DDP's gradient all-reduces,
        as :func:`~whitenlayers.joinable`'s hook shadows them on a rank that has joined); a training-mode forward of
        the module DDP wraps, called without DDP (a forward of one rank, e.g. for logging), gathers and counts
        nothing: the ranks' blocks stay in step, and no rank folds alone."""
        if torch.compiler.is_compiling():
            self.traced_open = True
            self.traced_calls = []
            return
        scope = self.scopes.get(_get_ident())
        if scope is not None:  # nested, or a forward whose end was not seen: its batches added now
            self.flush_stats()
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        join = local = False
        if distributed:
            ddp = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
            if ddp is not None:
                self.under_ddp = True
                join = bool(getattr(getattr(ddp, "_join_config", None), "enable", False))
                if join and not (self.joined is not None and self.joined._join_config.enable):
                    self._refuse_join_without_joinable()
            elif self.under_ddp and module.training:
                local = True
                if not self.warned_local:
                    self.warned_local = True
                    warnings.warn(
                        "whitenlayers: a training-mode forward of the module inside DistributedDataParallel, called "
                        "without DDP (on one rank, e.g. for logging): its whitening layers gather and count nothing "
                        "(a batch counted on one rank would put the ranks' folds out of step); call the DDP model, or "
                        "the module in eval mode or inside wl.frozen(module). Said once", RuntimeWarning, stacklevel=3)
        if local or not (torch.is_grad_enabled() and not _transforms_active() and not torch._C._is_tracing()
                         and not torch.is_inference_mode_enabled() and _graph_task_id() == -1
                         and not module.__dict__.get("_is_replica")):
            # (a DataParallel replica shares its accumulators with the module it copies: each adds its own)
            scope = ForwardScope({}, {}, None, join, local)
        else:
            # (the grad / recursive layers' node where there are any: every layer not a direct wrapper's)
            scope = ForwardScope(_shared_weights(self.layers, distributed) if len(self.layers) > len(self.wrappers)
                                 else {}, {} if distributed or not self.wrappers else _shared_products(self.wrappers),
                                 [], join, False)
        self.scopes[_get_ident()] = scope

    def _refuse_join_without_joinable(self) -> None:
        """A training forward inside DDP's ``Join`` without the whitening's joinable: ``RuntimeError`` on every rank at
        its first forward there (before any fold: a rank that joined would not shadow the folds' collectives, gloo
        aborts on the sizes, NCCL may hang)."""
        if any(layer.training and not layer.frozen for layer in self.layers):
            raise RuntimeError(
                "whitenlayers: a training forward of DistributedDataParallel inside a torch.distributed Join context "
                "without the whitening's joinable: a rank that runs out of batches would not join the whitening's "
                "folds (gloo aborts, NCCL may hang). Pass it to the Join after the DDP model: "
                "Join([ddp_model, wl.joinable(ddp_model)])")

    def request(self, layer: "WhiteningLayer") -> None:
        if not any(p is layer for p in self.pending):
            self.pending.append(layer)

    def flush(self) -> None:
        """Fold the layers whose block ended, in the model's order (the same on every rank, whatever order their
        blocks ended in)."""
        if not self.checked:  # the first fold after a conversion
            self.checked = True
            _warn_uncalled(self.layers)
        pending, self.pending = self.pending, []
        order = {id(layer): i for i, layer in enumerate(self.layers)}
        layers = sorted((p for p in pending if p.fold_block.fold_pending), key=lambda p: order.get(id(p), len(order)))
        try:
            if self.fold_async:
                self._fold_async(layers)
            else:
                fold_layers(layers, strategy=self.strategy, _coordinator=self)
        finally:
            warn_nonfinite()

    def wait(self) -> None:
        """Wait for the fold in flight (if any) and hand its results to its layers (their pending folds, written
        at each layer's next block end); nothing is written into the layers' buffers here."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        layers, future, device, jobs = in_flight
        folds, event = future.result()  # re-raises the worker's exception, if any
        if folds is None:  # cancelled at interpreter exit (_cancel_at_exit): read by an exit handler after all
            warnings.warn(f"whitenlayers: the fold in flight of {len(layers)} layers was cancelled at interpreter "
                          "exit; their last block is not folded", RuntimeWarning, stacklevel=2)
            return
        if event is not None:  # the fold ran on a CUDA stream of its own: this thread's stream waits for it
            torch.cuda.current_stream(device).wait_event(event)
        del jobs  # its tensors' memory may be reused now, after that wait
        for layer, fold in zip(layers, folds):
            layer.hold_pending_fold(fold)

    def flush_stats(self) -> None:
        """Add the batches handed over so far in this thread's forward to their layers' accumulators (before any
        fold or checkpoint reads them)."""
        scope = self.scopes.get(_get_ident()) if self.scopes else None
        if scope is not None and scope.batches:
            batches = list(scope.batches)
            scope.batches.clear()
            _add_handed_batches(batches, self._arenas)

    @torch.compiler.disable  # Python bookkeeping and the fold: outside any compiled graph, never guarded on
    def __call__(self, module, inputs, output) -> None:
        """The model's forward hook: the forward's batches added, a compiled forward's calls counted, the layers
        whose block ended folded."""
        scope = self.scopes.pop(_get_ident(), None)  # (its unused weight views go with it)
        if scope is not None and scope.batches:
            _add_handed_batches(scope.batches, self._arenas)
        traced = self.traced_open
        if traced:
            self.traced_open = False
            calls: Dict[Any, List[int]] = {}
            for call in self.traced_calls:
                calls.setdefault(call.layer, []).append(call.rows)
            self.traced_calls = []
            for layer, rows in calls.items():
                layer._count_traced(rows, coordinated=True)
        if self.pending and not _exporting():  # (torch.export traces the forward: a fold is no part of it)
            leaf = _grad_leaf(output) if (scope is not None and scope.join) or traced else None
            if traced and not _reads_buffers(leaf, self.pending):
                leaf = None
            if leaf is not None:  # under Join: after the backward, so that DDP's all-reduces come first (joinable);
                # compiled checkpointing: after the backward, which reads the buffers themselves (_reads_buffers)
                leaf.register_hook(self._fold_after_backward)
            else:
                self.flush()

    def _fold_after_backward(self, grad: Tensor) -> None:
        """A hook on the forward's output under ``Join``: the fold queued for the end of the backward, after the
        callback DDP queues there (a callback queued by a callback runs after those queued before it)."""
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self.flush))

    def _shadow_forward(self) -> None:
        """On a rank that has joined (:func:`~whitenlayers.joinable`), once for every forward the others still run:
        each training layer counts a batch without data, and the layers whose block ends fold with the others."""
        for layer in self.layers:
            if layer.gathers_now():
                layer._count_without_data()
        if self.pending:
            self.flush()

    @torch.compiler.disable  # host logic and the fold: outside any compiled graph
    def _fold_async(self, layers: List["WhiteningLayer"]) -> None:
        """A block's end with ``fold_async``: wait for the fold in flight, read the block's sums and start the next
        block, write the pending folds, start this block's fold in the worker (the class docstring)."""
        self.wait()
        if not layers:
            return
        device = layers[0].running_mean.device
        with no_autocast(device), torch.no_grad():
            group, world = _dist_group(layers)
            jobs: List[_FoldJob] = []
            if world == 1:  # the block's sums copied, summarised by the worker
                for chunk in _fold_chunks(layers, ASYNC_CHUNK_ELEMENTS):
                    sums = _taken_blocks(chunk)
                    # (the non-finite blocks counted when their fold is written)
                    _begin(chunk, [0] * len(chunk), [False] * len(chunk))
                    jobs.append(_FoldJob(chunk, sums, None, _fold_states(chunk)))
            else:  # all ranks' sums, on this thread: every rank folds every layer, in the same parts as one process
                summaries, nonfinite, firsts = _global_summaries(layers, None, group)
                firsts = _begin(layers, [0] * len(layers), firsts)
                index = {id(layer): i for i, layer in enumerate(layers)}
                for chunk in _fold_chunks(layers, ASYNC_CHUNK_ELEMENTS):
                    idx = [index[id(layer)] for layer in chunk]
                    given = _GivenSummaries([summaries[i] for i in idx], [nonfinite[i] for i in idx],
                                            [firsts[i] for i in idx])
                    jobs.append(_FoldJob(chunk, None, given, _fold_states(chunk)))
        stream = None
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the copies and summaries made on this stream
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whitenlayers-fold")
            _cancel_at_exit()
        self._in_flight = _InFlight([layer for job in jobs for layer in job.layers],
                                    self._executor.submit(_compute_jobs, jobs, device, stream), device, jobs)

    def __getstate__(self) -> Dict[str, Any]:
        self.wait()
        self.flush_stats()
        return {"pending": list(self.pending), "handle": None, "begin_handle": None, "strategy": self.strategy,
                "layers": list(self.layers), "wrappers": list(self.wrappers), "checked": self.checked,
                "fold_async": self.fold_async}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update({"strategy": "auto", **state, "scopes": {}, "_arenas": {}, "_streams": {}})


def _grad_leaf(output: Any) -> Optional[Tensor]:
    """A tensor of a forward's output that a backward will reach, or ``None``."""
    leaves = torch.utils._pytree.tree_leaves(output)
    return next((leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad), None)


def _reads_buffers(leaf: Optional[Tensor], layers: Iterable["WhiteningLayer"]) -> bool:
    """Whether the backward of a compiled forward's output ``leaf`` holds a forward buffer of ``layers`` itself, not
    the graph's copy: compiled activation checkpointing recomputes the copies there (AOTAutograd recomputes what a
    checkpointed region computes), so the fold waits for that backward."""
    try:
        saved = getattr(leaf.grad_fn, "saved_tensors", ()) if leaf is not None else ()
    except RuntimeError:  # its tensors freed (a backward ran)
        return False
    buffers = {layer._buffers[name].data_ptr() for layer in layers for name in layer._FORWARD_BUFFERS}
    return any(isinstance(t, Tensor) and t.data_ptr() in buffers for t in saved)


def joinable(model: nn.Module) -> Any:
    """The whitening of a converted ``model`` as a ``torch.distributed`` ``Joinable``: DDP's way of training with
    uneven inputs (ranks with different numbers of batches) takes it after the DDP model::

        from torch.distributed.algorithms.join import Join
        with Join([ddp_model, wl.joinable(ddp_model)]):
            for x, y in loader:  # one rank may run out of batches before the others
                ...

    A rank that has run out of batches counts, for every batch the others still train on, a batch without data in
    each of its training layers, and joins their folds with the statistics it has (its last partial block, then
    none): every rank folds at the same batches and holds bit-identical whitening state, and the folds sum every
    batch any rank saw. Inside the ``Join`` a model's fold runs after the backward (its collectives after DDP's);
    every rank's forwards must call every whitening layer once (the joined rank counts them all).

    Args:
        model: the converted model, or the ``DistributedDataParallel`` wrapping it.
    """
    from torch.distributed.algorithms.join import Joinable, JoinHook

    module = getattr(model, "module", model)
    coordinator = next((h for h in module._forward_hooks.values() if isinstance(h, FoldCoordinator)), None)
    if coordinator is None:
        raise ValueError(f"joinable: {type(module).__name__} has no fold coordinator; convert it with "
                         "wl.convert_model first")
    coord: FoldCoordinator = coordinator

    class _Shadow(JoinHook):
        def main_hook(self) -> None:
            coord._shadow_forward()

    class _Whitening(Joinable):
        def __init__(self) -> None:  # (Joinable's __init__ is abstract)
            super().__init__()

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return _Shadow()

        @property
        def join_device(self) -> torch.device:
            return coord.layers[0].running_mean.device

        @property
        def join_process_group(self) -> Any:
            group = coord.layers[0].process_group
            return torch.distributed.group.WORLD if group is None else group  # (DDP's default: the same group)

    coord.joined = _Whitening()
    return coord.joined


def _shared_weights(layers: Sequence[Any], distributed: bool) -> Dict[Any, SharedWeight]:
    """:meth:`FoldCoordinator.begin_forward`'s shared weight-gradient node: for the grad / recursive layers whose
    weight is a plain Parameter that needs a gradient (channel features, not parametrized, not deferred; of its full
    shape under ``torch.distributed``: a weight sharded by FSDP is left to the layer), a :class:`SharedWeight`
    (:attr:`ForwardScope.weights`). One node for all of them in one process; under ``torch.distributed`` one per run
    of ``DISTRIBUTED_RUN`` (DDP all-reduces a layer's gradient while the backward runs; one node would hold them
    all until its end). Nothing for fewer than two layers."""
    chosen, weights = [], []
    for layer in layers:
        w = layer._parameters.get("weight")
        if ("grad_transform" not in layer._buffers or type(w) is not nn.Parameter or not w.requires_grad
                or layer.features != "channels" or "parametrizations" in layer._modules or layer._deferral is not None
                or (distributed and tuple(w.shape) != layer._full_weight_shape())):
            continue
        chosen.append(layer)
        weights.append(w)
    run = DISTRIBUTED_RUN if distributed else len(chosen)
    if len(chosen) < 2 or run < 2:
        return {}
    out = {}
    for start in range(0, len(chosen), run):  # (a run of one: its own node of one weight)
        qs: List[Optional[Tensor]] = [None] * len(weights[start:start + run])
        views = shared_weight_grad_apply(qs, *weights[start:start + run])
        for i, (layer, view) in enumerate(zip(chosen[start:start + run], views)):
            out[layer] = SharedWeight(view, weights[start + i], qs, i)
    return out


def _shared_products(wrappers: Sequence[Any]) -> Dict[Any, SharedProduct]:
    """:meth:`FoldCoordinator.begin_forward`'s shared product node: for the fused ``direct`` wrappers in training
    mode whose weight is a Parameter that needs a gradient (on the device of the first), a :class:`SharedProduct`
    keyed by their ``DirectWhiten`` (:attr:`ForwardScope.products`), ``T`` and ``state`` the buffers in force."""
    whitens, states, weights, ts, tts = [], [], [], [], []
    device = None
    for wrapper in wrappers:
        whiten = wrapper.whiten
        w = wrapper.layer._parameters.get("weight")
        if (not whiten.training or type(w) is not nn.Parameter or not w.requires_grad or not wrapper._fusable()
                or (device is not None and w.device != device)):
            continue
        device = w.device
        state = whiten._state_in_force()
        t = state["whitening_matrix"]
        derived = whiten._cache.derived
        tt = derived.get("t_transposed")
        if tt is None or tt._base is not t:  # T^T as a view made once per block (a view op is a dispatch)
            tt = derived["t_transposed"] = t.mT
        whitens.append(whiten)
        states.append(state)
        weights.append(w)
        ts.append(t)
        tts.append(tt)
    if not whitens:
        return {}
    products = shared_weight_product_apply(tuple(ts), tuple(tts), *weights)
    return dict(zip(whitens, map(SharedProduct, products, weights, ts, states)))


#: The largest stack of handed batches made at once (bytes): a group of layers with more is added in parts.
GROUP_BYTES = 256 << 20


class _StackedShifts(NamedTuple):
    """A group's shifts stacked ``(L, M)`` (:func:`_stacked_shifts`), kept while they are the same tensors
    (``shifts``) at the same ``versions`` (of those that are tensors)."""

    shifts: Tuple[Optional[Tensor], ...]
    versions: Tuple[int, ...]
    stacked: Tensor


@dataclasses.dataclass
class _Arena:
    """A group's stacked accumulator (:func:`_arena`): ``acc`` ``(L, M + 1, M + 1)``, whose slices ``views`` are
    ``layers``' accumulators, its ``s2`` and ``s1`` blocks (``blocks``, sliced once), and the group's stacked
    shifts (``shifts``, or ``None`` before the first shifted batch)."""

    __slots__ = ("layers", "acc", "views", "blocks", "shifts")
    layers: List[Any]
    acc: Tensor
    views: List[Tensor]
    blocks: Tuple[Tensor, Tensor]
    shifts: Optional[_StackedShifts]


class _GivenSummaries(NamedTuple):
    """The global block summaries of a part's layers, made on the training thread under ``torch.distributed``
    (:func:`~whitenlayers.fold._global_summaries`): what :func:`~whitenlayers.fold._local_summaries` returns in
    one process."""

    summaries: List[BlockSummary]
    nonfinite: List[int]
    firsts: List[bool]


class _FoldJob(NamedTuple):
    """One part of an asynchronous fold (:func:`_compute_jobs`): its ``layers``, one stack of at most
    :data:`ASYNC_CHUNK_ELEMENTS` (:func:`~whitenlayers.fold._fold_chunks`); their copied block sums (``sums``,
    summarised by the worker) or their summaries made on the training thread (``given``, under
    ``torch.distributed``); copies of the buffers the fold reads (``states``)."""

    layers: List["WhiteningLayer"]
    sums: Optional[List[BlockSums]]
    given: Optional[_GivenSummaries]
    states: List[Dict[str, Tensor]]


class _InFlight(NamedTuple):
    """The fold in flight (:attr:`FoldCoordinator._in_flight`): its ``layers``, the worker's ``future`` (its result
    the layers' :class:`PendingFold` and a CUDA event, or ``None``), the ``device``, and its ``jobs``' inputs, held
    until this thread's stream has waited for the fold."""

    layers: List["WhiteningLayer"]
    future: Any
    device: torch.device
    jobs: List[_FoldJob]


def _add_handed_batches(entries: Sequence[HandedBatch], arenas: Dict[tuple, _Arena]) -> None:
    """Add the batches of a forward's layers to their blocks: each layer's with :meth:`Block.add
    <whitenlayers.layers.block.Block.add>`, or, where layers share input shape, dtype and layout, several at once
    (:func:`~whitenlayers.functional.accumulate_moments_grouped`: the same sums in batched products, a few
    operations for the group; in a group where some are summed about a shift, those summed about 0 take a zero
    shift: the same sums up to rounding). The accumulators of a group's layers are slices of one stacked tensor
    (``arenas``, kept by the coordinator across steps, made again when a layer's accumulator was replaced: a reset,
    a move, a load); a layer whose batch is not the first it handed over this forward (called twice) adds on its
    own. No gradient, no autocast (a batched product would run in bf16 there)."""
    groups: Dict[tuple, List[HandedBatch]] = {}
    layers, xs, versions, _ = zip(*entries)
    if not all(map(operator.eq, map(_version, xs), versions)):
        for entry in entries:
            if entry.x._version != entry.version:
                raise RuntimeError(
                    f"{entry.layer._describe()}: its input was modified in place during the model's forward, after "
                    f"the layer read it, and before its statistics were added at the forward's end (the backward "
                    f"would fail on it too); do not write into a whitening layer's input")
    # (C-level loops over the entries: this runs once per forward for all of a model's layers)
    keys: Iterable[tuple] = zip(map(_shape, xs), map(_stride, xs), map(_dtype, xs), map(_get_device, xs),
                                map(_acc_dtype, layers))
    if len(set(map(id, layers))) < len(layers):  # a layer called twice: its later batches each on their own
        first: Dict[int, int] = {}
        for i, layer in enumerate(layers):
            first.setdefault(id(layer), i)
        keys = [key if first[id(layer)] == i else ("alone", i) for i, (layer, key) in enumerate(zip(layers, keys))]
    for key, entry in zip(keys, entries):
        groups.setdefault(key, []).append(entry)
    # (No autocast context: the products are in place or take out= / out_dtype, which autocast leaves alone; the
    # one out-of-place product, accumulate_moments_grouped's fallback, turns it off itself.)
    with torch.no_grad():
        for key, members in groups.items():
            x0 = members[0].x
            size = max(1, GROUP_BYTES // max(1, x0.numel() * x0.element_size()))
            for start in range(0, len(members), size):
                part = members[start:start + size]
                arena = _arena(arenas, key + (start,), [e.layer for e in part]) if len(part) > 1 else None
                if arena is None:  # one batch, or some of a kept group's layers (a block's first batch): each alone
                    for entry in part:
                        entry.layer._block.add(entry.x, entry.shift)
                    continue
                shifts = _stacked_shifts(arena, part) if any(e.shift is not None for e in part) else None
                accumulate_moments_grouped(arena.acc, [e.x for e in part], shifts, arena.blocks)


def _stacked_shifts(arena: _Arena, part: Sequence[HandedBatch]) -> Tensor:
    """The shifts of a group's batches stacked ``(L, M)`` in its accumulators' dtype (zeros for a batch summed
    about 0, :func:`~whitenlayers.functional.stack_shifts`): kept in ``arena`` while they are the same tensors,
    unwritten (within a block), so stacked once per block."""
    shifts = tuple(map(_shift_of, part))
    versions = tuple(map(_version, filter(_not_none, shifts)))  # (of the shifts that are tensors)
    kept = arena.shifts
    if kept is not None and kept.versions == versions and all(map(operator.is_, kept.shifts, shifts)):
        return kept.stacked
    stacked = stack_shifts(shifts, arena.acc.shape[-1] - 1, arena.acc.dtype)
    arena.shifts = _StackedShifts(shifts, versions, stacked)
    return stacked


def _arena(arenas: Dict[tuple, _Arena], key: tuple, layers: List[Any]) -> Optional[_Arena]:
    """The group's :class:`_Arena`: the one kept under ``key`` while every layer's accumulator is still its slice,
    else a new one holding their sums so far (the layers' accumulators become its slices). ``None`` where
    ``layers`` are some of the kept one's, still its slices (the layers whose batches a block's first forward hands
    over: those summed about 0; a new stack for them would be replaced by the whole group's at the next
    forward)."""
    kept = arenas.get(key)
    if kept is not None and all(map(operator.is_, map(_acc_of, kept.layers), kept.views)):
        if len(kept.layers) == len(layers) and all(map(operator.is_, kept.layers, layers)):
            return kept
        if len(layers) < len(kept.layers) and {id(layer) for layer in layers} <= {id(layer) for layer in kept.layers}:
            return None
    first = layers[0]._block.acc
    acc = stacked_moments_accumulator(len(layers), first.shape[0] - 1, first.dtype, first.device)
    for i, layer in enumerate(layers):
        block = layer._block
        acc[i].copy_(block.acc)
        block.set_accumulator(acc[i], dense=acc._base[i] if acc._base is not None else acc[i])
    views = [layer._block.acc for layer in layers]
    m = acc.shape[-1] - 1
    arena = arenas[key] = _Arena(list(layers), acc, views, (acc[:, :m, :m], acc[:, :m, m:]), None)
    return arena


def check_fold_async(fold_async: bool, strategy: str) -> bool:
    """``fold_async`` if it is a bool that ``strategy`` allows (an asynchronous fold is replicated: every rank
    folds every layer), else ``TypeError`` / ``ValueError``."""
    if not isinstance(fold_async, bool):
        raise TypeError(f"fold_async must be a bool, but got {type(fold_async).__name__}")
    if fold_async and strategy == "owner":
        raise ValueError("fold_async=True folds every layer on every rank (the replicated strategy): it cannot be "
                         "combined with fold_strategy='owner' (use 'auto' or 'replicated')")
    return fold_async


#: The most ``groups * M^2`` elements an asynchronous fold computes in one batched call: about one 2048-wide
#: layer, so that a fold cancelled at interpreter exit (:func:`_cancel_at_exit`) stops within one such call.
ASYNC_CHUNK_ELEMENTS = 1 << 22
#: Set when the interpreter exits (its threads are joined): the worker starts no further part of a fold.
_EXITING = threading.Event()


@functools.cache  # once per process
def _cancel_at_exit() -> None:
    """At interpreter exit the fold in flight is read by no one: the worker stops after the part it is computing.
    ``threading._register_atexit`` (Python 3.9 and later) runs before the interpreter joins the worker (an
    ``atexit`` handler would run after that join). The worker is joined, not abandoned: a daemon thread whose torch
    op returns during finalization (CPython 3.11: it exits while taking the GIL, inside a C++ frame) aborts the
    process ("terminate called without an active exception"), and so does an op left on torch's inter-op pool."""
    threading._register_atexit(_EXITING.set)  # type: ignore[attr-defined]


def _compute_jobs(jobs: Sequence[_FoldJob], device: torch.device,
                  stream: Any) -> Tuple[Optional[List[PendingFold]], Any]:
    """The worker thread's part of an asynchronous fold: for each job (layers of one stack, or all layers under
    ``torch.distributed``), the summaries of their copied sums (or the summaries made on the training thread) and
    ``fold._compute_folds`` from copies of their buffers; no gradient, no autocast (both are per thread), on
    ``stream`` (CUDA) with an event recorded after it. Reads nothing the training thread writes while it runs
    (``num_blocks`` is written when a fold is, after waiting for this one)."""
    folds: List[PendingFold] = []
    with torch.no_grad(), no_autocast(device), contextlib.ExitStack() as ctx:
        if stream is not None:
            ctx.enter_context(torch.cuda.device(device))
            ctx.enter_context(torch.cuda.stream(stream))
        for job in jobs:
            if _EXITING.is_set():
                return None, None
            summaries, nonfinite, firsts = _local_summaries(job.layers, job.sums) if job.given is None else job.given
            done = _compute_folds(job.layers, summaries, nonfinite, firsts, one_stack=True, begin=False,
                                  states=job.states)
            folds += [fold._replace(nonfinite=n) for fold, n in zip(done, nonfinite)]
        return folds, None if stream is None else stream.record_event()
