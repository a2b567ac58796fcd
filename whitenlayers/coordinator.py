"""The fold coordinator: the forward hook that folds a model's layers together after its forward, at once or (with
``fold_async``) one block late in a worker thread. The fold itself is :mod:`whitenlayers.fold`'s."""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .fold import (
    PendingFold,
    _begin,
    _compute_folds,
    _dist_group,
    _fold_chunks,
    _fold_states,
    _global_summaries,
    _install_pending,
    _local_summaries,
    _no_autocast,
    _taken_blocks,
    _warn_nonfinite,
    _warn_uncalled,
    check_strategy,
    fold_layers,
)
from .functional.moments import accumulate_moments
from .functional.stacked import accumulate_moments_grouped, stack_shifts, stacked_moments_accumulator

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.hooks import RemovableHandle

    from .stats import WhiteningLayer

__all__ = ["FoldCoordinator", "check_fold_async"]

_get_ident = threading.get_ident
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_traced_calls = operator.attrgetter("_traced_calls")
_dict_of = operator.attrgetter("__dict__")
# (for the C-level loops over a forward's handed batches, _add_handed_batches)
_version = operator.attrgetter("_version")
_shape = operator.attrgetter("shape")
_stride = operator.methodcaller("stride")
_dtype = operator.attrgetter("dtype")
_get_device = operator.methodcaller("get_device")
_acc_of = operator.attrgetter("_acc_aug")
_acc_dtype = operator.attrgetter("_acc_aug.dtype")
_fourth = operator.itemgetter(3)
_not_none = functools.partial(operator.is_not, None)
_pop_shared = operator.methodcaller("pop", "_shared_weight", None)
_pop_planned = operator.methodcaller("pop", "_planned", None)


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward.

    Installed as a forward hook on the root module by
    :func:`whitenlayers.convert_model`: layers whose block ends during a
    forward ask to be folded, and the hook folds them in one
    :func:`~whitenlayers.fold.fold_layers` call (one set of collectives per block for the whole
    model instead of one per layer). Folding after the model's forward instead
    of right after each layer's forward changes nothing: a block's statistics
    and the transform in force for that batch's backward are the same.
    ``strategy`` is :func:`~whitenlayers.fold.fold_layers`'s (how transforms are spread over ranks).

    ``fold_async=True``: the fold of a block runs in a worker thread (on CUDA, on a stream of its own) while
    the next block trains, and is written at the end of that next block: the transform built from block ``i`` is
    in force from block ``i + 2`` on. At each block's end the coordinator waits for the fold in flight (block
    ``i - 1``'s), reads block ``i``'s sums (summed across ranks on this thread: the collectives never leave the
    training thread) and starts a new block, writes block ``i - 1``'s fold (the bias compensation with the
    weight of this forward, so the function is unchanged at the swap), then starts block ``i``'s fold from copies
    of the buffers it reads. The result never depends on timing: two runs are bit-identical. Every rank folds
    every layer (``"replicated"``; ``"owner"`` is refused). A checkpoint taken while a fold is in flight waits
    for it and saves its result (each layer's extra state), which is written at the next block's end after a
    resume.

    The statistics of the forward's layers are added together at its end (where the device takes the
    fewest-kernel path, CUDA's, and the forward records a backward): a layer hands its batch to the coordinator
    instead of adding it to its own accumulator, and the hook adds the batches of all layers whose inputs share a
    shape with a few operations for all of them (``functional.accumulate_moments_grouped``) before any fold. The
    same sums up to rounding, far fewer operations per step on a host-bound step. A layer keeps its own two
    operations where the batch would otherwise not outlive its layer (no backward recorded, activation
    checkpointing or any saved-tensor hooks, a weight and an input that need no gradient) and inside compiled
    graphs. The pre-hook that opens a forward's collection is ``ForwardBegins``. It also calls :attr:`on_forward`,
    which ``convert_model`` sets to ``convert._common.plan_forward``: in one process, the grad / recursive layers'
    weights through one autograd node for their weight-gradient transforms, the fused ``direct`` wrappers' ``W T``
    through another, and each layer's step planned (docs/robustness.md, "Planned steps"); the views and plans no
    layer used are dropped at the forward's end.

    At the first fold after a conversion it checks that every whitening layer
    of the model (:attr:`layers`) in training mode was called: a layer whose
    weight the model uses without calling it as a module (e.g. torchvision's
    Swin attention passes ``qkv.weight`` to a function) never sees its input,
    so it cannot whiten; a ``RuntimeWarning`` names such layers.

    Args:
        strategy: :func:`~whitenlayers.fold.fold_layers`'s, ``"auto"`` (default), ``"replicated"`` or ``"owner"``.
        fold_async: fold off the training thread, one block late (default ``False``), as above.
    """

    #: Defaults for coordinators pickled before these attributes existed (nothing to check).
    layers: Sequence["WhiteningLayer"] = ()
    checked: bool = True
    fold_async: bool = False
    #: The fold in flight: ``(layers, future, device, jobs)``, the future's result the layers' :class:`PendingFold`
    #: (and a CUDA event, or ``None``); ``jobs`` its inputs, held until this thread's stream has waited for the fold
    #: (CUDA: made on this stream, read on the fold's, their memory must not be reused before). Never pickled
    #: (:meth:`__getstate__` waits for it).
    _in_flight: Optional[Tuple[List["WhiteningLayer"], Any, torch.device, Any]] = None
    _executor: Any = None
    _streams: Optional[Dict[torch.device, Any]] = None
    #: The batches handed over by the layers during the model's forward, per thread (``threading.get_ident``:
    #: ``DataParallel`` runs replicas in threads): ``(layer, batch, its version, shift)``, added at the forward's
    #: end (:meth:`flush_stats`). Only while a forward runs; never pickled.
    _scopes: Optional[Dict[int, List[tuple]]] = None
    #: The stacked accumulators of the groups of layers whose batches are added together (``_arena``); never
    #: pickled (the layers' accumulators are pickled apart, and stacked again at the next forward).
    _arenas: Optional[Dict[tuple, list]] = None
    #: Called with the layers and the model before each forward (``convert_model`` sets ``convert._common.
    #: plan_forward``: shared weight nodes and planned steps); returns whether it left views or plans on them.
    on_forward: Any = None
    #: Whether this forward's layers hold views of the shared transform (dropped at the forward's end).
    shared_weights: bool = False
    #: Whether a layer ran inside a compiled graph (which takes no view; then :attr:`on_forward` is not called).
    traced: bool = False

    def __init__(self, strategy: str = "auto", fold_async: bool = False) -> None:
        check_strategy(strategy)
        self.pending: List["WhiteningLayer"] = []
        self.handle: Optional[RemovableHandle] = None
        self.begin_handle: Optional[RemovableHandle] = None  # the pre-hook's (ForwardBegins)
        self.strategy = strategy
        self.fold_async = check_fold_async(fold_async, strategy)
        self.layers = []
        self.checked = False

    def request(self, layer: "WhiteningLayer") -> None:
        if not any(p is layer for p in self.pending):
            self.pending.append(layer)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        layers = [p for p in pending if p._fold_pending]
        try:
            if self.fold_async:
                self._fold_async(layers)
            else:
                fold_layers(layers, strategy=self.strategy, _coordinator=self)
        finally:
            _warn_nonfinite()

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
            layer._pending_fold = fold

    def begin_forward(self, module: Any = None) -> None:
        """Open this thread's collection of the layers' batches (``ForwardBegins``, before the model's
        forward). A forward of the same model inside it (nested) adds to the open one. Then :attr:`on_forward`, if
        set (the layers' shared weight-gradient transform, set by ``convert_model``)."""
        scopes = self._scopes
        if scopes is None:
            scopes = self._scopes = {}
        if scopes.get(_get_ident()):  # batches a forward left (its end hook removed, or a nested forward): added now
            self.flush_stats()
        scopes.setdefault(_get_ident(), [])
        if self.on_forward is not None and not self.traced and self.on_forward(self.layers, module):
            self.shared_weights = True

    def stats_sink(self) -> Optional[List[tuple]]:
        """The list a layer hands its batch to in this thread's forward, or ``None`` outside one."""
        scopes = self._scopes
        return scopes.get(_get_ident()) if scopes else None

    def flush_stats(self, end: bool = False) -> None:
        """Add the batches handed over so far in this thread's forward to their layers' accumulators (before any
        fold reads them); ``end``: and close the collection (the forward's end)."""
        scopes = self._scopes
        if not scopes:
            return
        ident = _get_ident()
        entries = scopes.pop(ident, None) if end else scopes.get(ident)
        if entries:
            batch, entries[:] = list(entries), []
            if self._arenas is None:
                self._arenas = {}
            _add_handed_batches(batch, self._arenas)

    @torch.compiler.disable  # Python bookkeeping: outside any compiled graph, never guarded on
    def __call__(self, module, inputs, output) -> None:
        self.flush_stats(end=True)  # registered with always_call: a forward that raised still leaves its sums
        layers = self.layers
        if self.shared_weights:  # the views of the shared weight nodes and the plans no layer used in this forward
            self.shared_weights = False
            dicts = list(map(_dict_of, layers))
            deque(map(_pop_shared, dicts), 0)  # (C-level loops: a layer's forward took its own already)
            deque(map(_pop_planned, dicts), 0)
        if any(map(_traced_calls, layers)):
            for layer in layers:
                if layer._traced_calls:  # called inside a compiled graph: count its batches here (WhiteningLayer)
                    layer._count_traced_batches()
                    self.traced = True  # compiled layers take no shared transform's view: on_forward runs no more
        if self.pending and not _exporting():  # (torch.export traces the forward: a fold is no part of it)
            self.flush()

    @torch.compiler.disable  # host logic and the fold: outside any compiled graph
    def _fold_async(self, layers: List["WhiteningLayer"]) -> None:
        """A block's end with ``fold_async``: wait for the fold in flight, read the block's sums and start the next
        block, write the pending folds, start this block's fold in the worker (the class docstring)."""
        if not self.checked:
            self.checked = True
            _warn_uncalled(self.layers)
        self.wait()
        if not layers:
            return
        device = layers[0].running_mean.device
        with _no_autocast(device), torch.no_grad():
            group, world = _dist_group(layers)
            jobs: List[tuple] = []
            if world == 1:  # the block's sums copied, summarised by the worker
                for chunk in _fold_chunks(layers, ASYNC_CHUNK_ELEMENTS):
                    sums = _taken_blocks(chunk)
                    _begin(chunk, [0] * len(chunk))  # non-finite blocks: counted when their fold is written
                    _install_pending(chunk, [False] * len(chunk))
                    jobs.append((chunk, sums, None, _fold_states(chunk), True))
            else:  # all ranks' sums, on this thread (split in stacks by the worker): every rank folds every layer
                summaries, nonfinite, firsts = _global_summaries(layers, None, group)
                _begin(layers, [0] * len(layers))
                firsts = _install_pending(layers, firsts)
                jobs.append((layers, None, (summaries, nonfinite, firsts), _fold_states(layers),
                             False))
        stream = None
        if device.type == "cuda":
            if self._streams is None:
                self._streams = {}
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the copies and summaries made on this stream
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whitenlayers-fold")
            _cancel_at_exit()
        self._in_flight = ([layer for job in jobs for layer in job[0]],
                           self._executor.submit(_compute_jobs, jobs, device, stream), device, jobs)

    def __getstate__(self) -> Dict[str, Any]:
        self.wait()
        self.flush_stats()
        return {"pending": list(self.pending), "handle": None, "begin_handle": None, "strategy": self.strategy,
                "layers": list(self.layers), "checked": self.checked, "fold_async": self.fold_async,
                "on_forward": self.on_forward, "traced": self.traced}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update({"strategy": "auto", **state})  # coordinators pickled before strategies existed


class ForwardBegins:
    """The model's forward pre-hook of a :class:`FoldCoordinator`: opens the collection of the layers' batches for
    this forward (:meth:`FoldCoordinator.begin_forward`). Traced by ``torch.compile`` as a no-op (no graph break):
    compiled layers add their statistics in the graph."""

    def __init__(self, coordinator: FoldCoordinator) -> None:
        self.coordinator = coordinator

    def __call__(self, module: Any, inputs: Any) -> None:
        if not torch.compiler.is_compiling():
            self.coordinator.begin_forward(module)


#: The largest stack of handed batches made at once (bytes): a group of layers with more is added in parts.
GROUP_BYTES = 256 << 20


def _add_handed_batches(entries: Sequence[tuple], arenas: Dict[tuple, list]) -> None:
    """Add the batches of a forward's layers to their accumulators, grouped by input shape, dtype and layout
    (:func:`~whitenlayers.functional.accumulate_moments_grouped`; in a group where some are summed about a shift,
    those summed about 0 take a zero shift: one group, the same sums up to rounding). The
    accumulators of a group's layers are slices of one stacked tensor (``arenas``, kept by the coordinator across
    steps, made again when a layer's accumulator was replaced: a reset, a move, a load); a layer whose batch is not
    the first it handed over this forward (called twice) adds on its own. No gradient, no autocast (a batched
    product would run in bf16 there)."""
    groups: Dict[tuple, List[tuple]] = {}
    layers, xs, versions, _ = zip(*entries)
    if not all(map(operator.eq, map(_version, xs), versions)):
        for layer, x, version, _ in entries:
            if x._version != version:
                raise RuntimeError(
                    f"{layer._describe()}: its input was modified in place during the model's forward, after the "
                    f"layer read it, and before its statistics were added at the forward's end (the backward would "
                    f"fail on it too); do not write into a whitening layer's input")
    # (C-level loops over the entries: this runs once per forward for all of a model's layers)
    keys: Iterable[tuple] = zip(map(_shape, xs), map(_stride, xs), map(_dtype, xs), map(_get_device, xs),
                                map(_acc_dtype, layers))
    if len(set(map(id, layers))) < len(layers):  # a layer called twice: its later batches each on their own
        seen: set = set()
        marked: List[tuple] = []
        for layer, key in zip(layers, keys):
            marked.append(("alone", len(marked)) if id(layer) in seen else key)
            seen.add(id(layer))
        keys = marked
    for key, entry in zip(keys, entries):
        groups.setdefault(key, []).append(entry)
    # (No autocast context: the products are in place or take out= / out_dtype, which autocast leaves alone; the
    # one out-of-place product, accumulate_moments_grouped's fallback, turns it off itself.)
    with torch.no_grad():
        for key, members in groups.items():
            x0 = members[0][1]
            size = max(1, GROUP_BYTES // max(1, x0.numel() * x0.element_size()))
            for start in range(0, len(members), size):
                part = members[start:start + size]
                if len(part) == 1:
                    layer, x, _, shift = part[0]
                    accumulate_moments(layer._acc_aug, x, shift, layer._acc_blocks)
                    continue
                arena = _arena(arenas, key + (start,), [e[0] for e in part])
                if arena is None:  # some of a kept group's layers (a block's first batch): each adds on its own
                    for layer, x, _, shift in part:
                        accumulate_moments(layer._acc_aug, x, shift, layer._acc_blocks)
                    continue
                shifted = any(e[3] is not None for e in part)
                shifts: Optional[Tensor] = _stacked_shifts(arena, part) if shifted else None
                accumulate_moments_grouped(arena[1], [e[1] for e in part], shifts, arena[3])


def _stacked_shifts(arena: list, part: Sequence[tuple]) -> Tensor:
    """The shifts of a group's batches stacked ``(L, M)`` in its accumulators' dtype (zeros for a batch summed
    about 0, :func:`~whitenlayers.functional.stack_shifts`): kept in ``arena`` while they are the same tensors,
    unwritten (within a block), so stacked once per block."""
    shifts = tuple(map(_fourth, part))
    versions = tuple(map(_version, filter(_not_none, shifts)))  # (of the shifts that are tensors)
    kept = arena[4]
    if kept is not None and kept[1] == versions and all(map(operator.is_, kept[0], shifts)):
        return kept[2]
    acc = arena[1]
    stacked = stack_shifts(shifts, acc.shape[-1] - 1, acc.dtype)
    arena[4] = (shifts, versions, stacked)
    return stacked


def _arena(arenas: Dict[tuple, list], key: tuple, layers: List[Any]) -> Optional[list]:
    """``[layers, acc, views, blocks, shifts]``: the stacked accumulator ``acc`` whose slices (``views``) are
    ``layers``' accumulators, its ``s2`` and ``s1`` blocks, and the group's stacked shifts
    (:func:`_stacked_shifts`): the one kept under ``key`` while every layer's accumulator is still its slice, else
    a new one holding their sums so far (the layers' accumulators become its slices). ``None`` where ``layers``
    are some of the kept one's, still its slices (the layers whose batches a block's first forward hands over:
    those summed about 0; a new stack for them would be replaced by the whole group's at the next forward)."""
    kept = arenas.get(key)
    if kept is not None and all(map(operator.is_, map(_acc_of, kept[0]), kept[2])):
        if len(kept[0]) == len(layers) and all(map(operator.is_, kept[0], layers)):
            return kept
        if len(layers) < len(kept[0]) and {id(layer) for layer in layers} <= {id(layer) for layer in kept[0]}:
            return None
    first = layers[0]._acc_aug
    acc = stacked_moments_accumulator(len(layers), first.shape[0] - 1, first.dtype, first.device)
    views = []
    for i, layer in enumerate(layers):
        acc[i].copy_(layer._acc_aug)
        layer._set_accumulator(acc[i], dense=acc._base[i] if acc._base is not None else acc[i])
        views.append(layer._acc_aug)
    m = acc.shape[-1] - 1
    blocks = (acc[:, :m, :m], acc[:, :m, m:])
    arena = arenas[key] = [list(layers), acc, views, blocks, None]
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
_EXIT_REGISTERED = [False]


def _cancel_at_exit() -> None:
    """At interpreter exit the fold in flight is read by no one: the worker stops after the part it is computing.
    ``threading._register_atexit`` runs before the interpreter joins the worker (an ``atexit`` handler would run
    after that join); once per process."""
    if _EXIT_REGISTERED[0]:
        return
    _EXIT_REGISTERED[0] = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_EXITING.set)


def _compute_jobs(jobs: Sequence[tuple], device: torch.device,
                  stream: Any) -> Tuple[Optional[List[PendingFold]], Any]:
    """The worker thread's part of an asynchronous fold: for each job (layers of one stack, or all layers under
    ``torch.distributed``), the summaries of their copied sums (or the summaries made on the training thread) and
    ``fold._compute_folds`` from copies of their buffers; no gradient, no autocast (both are per thread), on
    ``stream`` (CUDA) with an event recorded after it. Reads nothing the training thread writes while it runs
    (``num_blocks`` is written when a fold is, after waiting for this one)."""
    folds: List[PendingFold] = []
    with torch.no_grad(), _no_autocast(device), contextlib.ExitStack() as ctx:
        if stream is not None:
            ctx.enter_context(torch.cuda.device(device))
            ctx.enter_context(torch.cuda.stream(stream))
        for chunk, sums, given, states, one_stack in jobs:
            if _EXITING.is_set():
                return None, None
            summaries, nonfinite, firsts = _local_summaries(chunk, sums) if given is None else given
            done = _compute_folds(chunk, summaries, nonfinite, firsts, one_stack=one_stack, begin=False,
                                  states=states)
            folds += [fold._replace(nonfinite=n) for fold, n in zip(done, nonfinite)]
        if stream is None:
            return folds, None
        event = torch.cuda.Event()
        event.record(stream)
    return folds, event
