"""The fold coordinator: a converted model's forward hooks, which fold together, once per forward of the model, the
layers whose blocks ended in it (one set of collectives per block, the transforms of layers of one width in one
batched call), at once or (with ``fold_async``) one block late in a worker thread. Every step is the layers' own
(:mod:`whitenlayers.layers.step`); a layer called without the hooks (through a sub-module, or on its own) folds
alone at its block's end. The fold is :mod:`whitenlayers.fold`'s."""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ._torch_compat import ddp_forward, graph_break, no_autocast, queue_after_backward
from .fold import (
    PendingFold,
    _compute_folds,
    _dist_group,
    _fold_chunks,
    _fold_states,
    _global_summaries,
    _local_summaries,
    _start_next_blocks,
    _taken_blocks,
    _warn_uncalled,
    check_strategy,
    fold_layers,
    warn_nonfinite,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.hooks import RemovableHandle

    from .fold import BlockSums
    from .functional.moments import BlockSummary
    from .layers import WhiteningLayer

__all__ = ["FoldCoordinator", "ForwardScope", "check_fold_async", "joinable"]

_get_ident = threading.get_ident


class ForwardScope(NamedTuple):
    """An eager forward of a coordinator's model in progress (one per thread, ``coordinator.scopes``): a layer whose
    block ends while it is open asks the coordinator to fold it at the forward's end."""

    #: A forward inside DDP's in a ``Join`` context: its fold comes after its backward.
    join: bool = False
    #: Nothing gathered or counted, for a training-mode forward of one rank (the module inside DDP called alone).
    local: bool = False


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward (the module docstring).

    :func:`whitenlayers.convert_model` installs it on the root module: :meth:`begin_forward` as a forward pre-hook,
    the coordinator itself as a forward hook (always called, so a forward that raised still folds). Before an eager
    forward it opens the thread's :class:`ForwardScope`; layers whose block ends during the forward ask to be folded
    (:meth:`request`), and the hook folds them in one :func:`~whitenlayers.fold.fold_layers` call. Folding after
    the model's forward instead of right after each layer's forward changes nothing: a block's statistics and the
    transform in force for that batch's backward are the same. ``strategy`` is
    :func:`~whitenlayers.fold.fold_layers`'s (how transforms are spread over ranks).

    When the root is compiled, the pre-hook runs inside the graph and marks the forward (:attr:`traced_open`): the
    layers' compiled forwards list their calls in ``traced_calls`` instead of counting them (the counts stay out
    of the graph), and the hook, outside the graph, counts them and folds. A compiled sub-module has no such mark:
    its layers count through a graph break each. A compiled forward whose backward holds the layers' buffers
    themselves (compiled activation checkpointing recomputes the graph's copies of them there) folds after that
    backward.

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
    checked: bool = True
    fold_async: bool = False
    #: The open scopes of eager forwards, per thread (``DataParallel`` runs replicas in threads); never pickled.
    scopes: Dict[int, ForwardScope] = {}
    #: Set by the pre-hook inside a compiled root forward; its layers' calls (``(layer, rows)``) in
    #: ``traced_calls``, counted by the hook after the graph.
    traced_open: bool = False
    traced_calls: List[Tuple[Any, int]] = []
    #: The model has run inside ``DistributedDataParallel``'s forward (:meth:`begin_forward`).
    under_ddp: bool = False
    warned_local: bool = False
    #: A ``Join`` holding the whitening's :func:`~whitenlayers.joinable` is open (its join hook made, its post hook
    #: not run yet).
    joined: bool = False
    #: The fold in flight (:class:`_InFlight`), or ``None``.
    _in_flight: Optional["_InFlight"] = None
    _executor: Any = None
    _streams: Dict[torch.device, Any]

    def __init__(self, strategy: str = "auto", fold_async: bool = False) -> None:
        self.pending: List["WhiteningLayer"] = []
        self.handle: Optional[RemovableHandle] = None
        self.begin_handle: Optional[RemovableHandle] = None  # the pre-hook's (begin_forward)
        self.strategy = check_strategy(strategy)
        self.fold_async = check_fold_async(fold_async, strategy)
        self.layers = []
        self.checked = False
        self.scopes, self._streams = {}, {}

    def begin_forward(self, module: nn.Module, inputs: Any) -> None:
        """The model's forward pre-hook: open this thread's :class:`ForwardScope` (a forward of the model inside it,
        nested, keeps the open one). Inside a compiled graph: mark the forward (:attr:`traced_open`).

        Under ``torch.distributed`` with ``DistributedDataParallel``: a forward inside DDP's that runs in a ``Join``
        context (uneven inputs) folds after its backward (the fold's collectives after DDP's gradient all-reduces,
        as :func:`~whitenlayers.joinable`'s hook shadows them on a rank that has joined); a training-mode forward of
        the module DDP wraps, called without DDP (a forward of one rank, e.g. for logging), gathers and counts
        nothing: the ranks' blocks stay in step, and no rank folds alone."""
        if torch.compiler.is_compiling():
            self.traced_open = True
            self.traced_calls = []
            return
        if _get_ident() in self.scopes:  # nested: the outer forward's scope
            return
        join = local = False
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ddp, join = ddp_forward()
            if ddp is not None:
                self.under_ddp = True
                if join and not self.joined:
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
        self.scopes[_get_ident()] = ForwardScope(join, local)

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
        """Fold ``layer`` (its block ended) at the end of the model's forward."""
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
        if folds is None:  # cancelled at interpreter exit (_compute_jobs): read by an exit handler after all
            warnings.warn(f"whitenlayers: the fold in flight of {len(layers)} layers was cancelled at interpreter "
                          "exit; their last block is not folded", RuntimeWarning, stacklevel=2)
            return
        if event is not None:  # the fold ran on a CUDA stream of its own: this thread's stream waits for it
            torch.cuda.current_stream(device).wait_event(event)
        del jobs  # its tensors' memory may be reused now, after that wait
        for layer, fold in zip(layers, folds):
            layer.hold_pending_fold(fold)

    @graph_break  # Python bookkeeping and the fold: outside any compiled graph, never guarded on
    def __call__(self, module, inputs, output) -> None:
        """The model's forward hook: a compiled forward's calls counted, then the layers whose block ended folded
        (none while ``torch.export`` traces: a fold is no part of the graph); under ``Join``, after the backward
        (DDP's all-reduces first, :func:`joinable`); after a compiled forward whose backward holds their buffers
        themselves, after that backward (compiled activation checkpointing recomputes the graph's copies of them
        there: :func:`_reads_buffers`)."""
        scope = self.scopes.pop(_get_ident(), None)
        traced = self.traced_open
        if traced:
            self.traced_open = False
            calls: Dict[Any, List[int]] = {}
            for layer, rows in self.traced_calls:
                calls.setdefault(layer, []).append(rows)
            self.traced_calls = []
            for layer, rows in calls.items():
                layer._count_traced(rows, coordinated=True)
        if not self.pending or torch.compiler.is_compiling():  # torch.export tracing (torch.compile's graph breaks
            return  # before this hook, which runs eagerly): a fold is no part of the graph
        leaf = _grad_leaf(output) if traced or (scope is not None and scope.join) else None
        if traced and not _reads_buffers(leaf, self.pending):
            leaf = None
        self._fold_after(leaf)

    def _fold_after(self, leaf: Optional[Tensor]) -> None:
        """Fold the pending layers after the backward that reaches ``leaf``, or now (``None``)."""
        if leaf is None:
            self.flush()
        else:
            leaf.register_hook(self._fold_after_backward)

    def _fold_after_backward(self, grad: Tensor) -> None:
        """A hook on the forward's output: the fold queued for the end of the backward, after the callback DDP
        queues there (a callback queued by a callback runs after those queued before it)."""
        queue_after_backward(lambda: queue_after_backward(self.flush))

    def _shadow_forward(self) -> None:
        """On a rank that has joined (:func:`~whitenlayers.joinable`), once for every forward the others still run:
        each training layer counts a batch without data, and the layers whose block ends fold with the others."""
        for layer in self.layers:
            if layer.gathers_now():
                layer._count_without_data()
        if self.pending:
            self.flush()

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
                    _start_next_blocks(chunk, [0] * len(chunk), [False] * len(chunk))
                    jobs.append(_FoldJob(chunk, sums, None, _fold_states(chunk)))
            else:  # all ranks' sums, on this thread: every rank folds every layer, in the same parts as one process
                summaries, nonfinite, firsts = _global_summaries(layers, None, group)
                firsts = _start_next_blocks(layers, [0] * len(layers), firsts)
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
        self._in_flight = _InFlight([layer for job in jobs for layer in job.layers],
                                    self._executor.submit(_compute_jobs, jobs, device, stream), device, jobs)

    def __getstate__(self) -> Dict[str, Any]:
        self.wait()
        return {"pending": list(self.pending), "handle": None, "begin_handle": None, "strategy": self.strategy,
                "layers": list(self.layers), "checked": self.checked, "fold_async": self.fold_async}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = {k: v for k, v in state.items() if k != "wrappers"}  # (pickled before the wrappers went)
        self.__dict__.update({"strategy": "auto", **state, "scopes": {}, "_streams": {}})


def _grad_leaf(output: Any) -> Optional[Tensor]:
    """A tensor of a forward's output (a tensor, or one in a tuple, list or dict, however nested) that a backward
    will reach, or ``None``."""
    if isinstance(output, Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return next((leaf for leaf in map(_grad_leaf, values) if leaf is not None), None)


def _reads_buffers(leaf: Optional[Tensor], layers: Sequence["WhiteningLayer"]) -> bool:
    """Whether the backward of a compiled forward's output ``leaf`` holds a forward buffer of ``layers`` itself, not
    the graph's copy: compiled activation checkpointing recomputes the copies there (AOTAutograd recomputes what a
    checkpointed region computes), so the fold waits for that backward."""
    try:
        saved = getattr(leaf.grad_fn, "saved_tensors", ()) if leaf is not None else ()
    except RuntimeError:  # its tensors freed (a backward ran)
        return False
    buffers = [layer._buffers[name] for layer in layers for name in layer._FORWARD_BUFFERS]
    return any(isinstance(t, Tensor) and any(t is buf for buf in buffers) for t in saved)


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

        def post_hook(self, is_last_joiner: bool) -> None:
            coord.joined = False  # the Join is over

    class _Whitening(Joinable):
        def __init__(self) -> None:  # (Joinable's __init__ is abstract)
            super().__init__()

        def join_hook(self, **kwargs: Any) -> JoinHook:
            coord.joined = True  # (a Join asks each of its joinables for its hook when it is made)
            return _Shadow()

        @property
        def join_device(self) -> torch.device:
            return coord.layers[0].running_mean.device

        @property
        def join_process_group(self) -> Any:
            group = coord.layers[0].process_group
            return torch.distributed.group.WORLD if group is None else group  # (DDP's default: the same group)

    return _Whitening()


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
#: layer, so that a fold in flight at interpreter exit stops within one such call (:func:`_compute_jobs`).
ASYNC_CHUNK_ELEMENTS = 1 << 22


def _compute_jobs(jobs: Sequence[_FoldJob], device: torch.device,
                  stream: Any) -> Tuple[Optional[List[PendingFold]], Any]:
    """The worker thread's part of an asynchronous fold: for each job (layers of one stack, split by
    :func:`~whitenlayers.fold._fold_chunks`), the summaries of their copied sums (or the summaries made on the
    training thread) and ``fold._compute_folds`` from copies of their buffers; no gradient, no autocast (both are
    per thread), on ``stream`` (CUDA) with an event recorded after it. Reads nothing the training thread writes
    while it runs (``num_blocks`` is written when a fold is, after waiting for this one)."""
    folds: List[PendingFold] = []
    with torch.no_grad(), no_autocast(device), contextlib.ExitStack() as ctx:
        if stream is not None:
            ctx.enter_context(torch.cuda.device(device))
            ctx.enter_context(torch.cuda.stream(stream))
        for job in jobs:
            if not threading.main_thread().is_alive():
                # The interpreter exits (it stops the main thread before joining this worker, which it does rather
                # than abandon it: a daemon thread whose torch op returns during finalization aborts the process):
                # no one reads the fold in flight, so no further part of it is computed.
                return None, None
            summaries, nonfinite, firsts = _local_summaries(job.layers, job.sums) if job.given is None else job.given
            done = _compute_folds(job.layers, summaries, nonfinite, firsts, job.states)
            folds += [fold._replace(nonfinite=n) for fold, n in zip(done, nonfinite)]
        return folds, None if stream is None else stream.record_event()
