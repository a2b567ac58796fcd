"""The fold: when and how the layers' block statistics become new transforms.

:func:`fold_layers` folds the current block of any number of layers. Under
``torch.distributed`` it first sums their block statistics across ranks: one
coalesced ``all_reduce`` of the counts and means, then the scatter about the
global mean (which keeps the sum accurate when ``|mean| >> std``), summed on
the rank that folds the layer. Either every rank folds every layer
(``"replicated"``) or each layer is folded on one rank, its owner, which
broadcasts the outcome (new buffers, flags) to the others (``"owner"``); either
way all ranks end with identical state. Layers whose rule computes alike (EVD
layers of one width, dtype and device) share one batched eigendecomposition.

:class:`~whitenlayers.coordinator.FoldCoordinator` is the forward hook :func:`~whitenlayers.convert_model`
installs on a converted model: layers whose block ends during a forward fold
together after the model's forward. Both are plumbing: users reach them through
``convert_model`` and ``WhiteningLayer.fold``.
"""
from __future__ import annotations

import warnings
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Hashable,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
import torch.distributed as dist
from torch import Tensor

from . import functional as F_w
from ._torch_compat import graph_break, no_autocast
from .functional import BlockSummary
from .functional.stacked import _own_all, _restack, _stack, _stack64, _unstack
from .rules import _BUILT_IN, NOT_COMPUTED, Fold, RuleResult, batch_key_of, check_results

if TYPE_CHECKING:  # pragma: no cover
    from .config import EVDConfig, RecursiveConfig
    from .coordinator import FoldCoordinator
    from .layers import WhiteningLayer

__all__ = ["fold_layers", "assign_owners", "STRATEGIES"]


def _dist_group(layers: Sequence["WhiteningLayer"]):
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = layers[0].process_group
    if not all(layer.process_group is group for layer in layers):
        raise ValueError("fold_layers: all layers folded together must share one process_group")
    world = dist.get_world_size(group)
    return (None, 1) if world == 1 else (group, world)


def _global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (what ``reduce`` / ``broadcast`` take as ``dst`` / ``src``)."""
    return rank if group is None else dist.get_global_rank(group, rank)


#: The status of a layer's fold (:class:`FoldOutcome`).
FOLDED, FAILED, SKIPPED_EMPTY, SKIPPED_MOMENTS, SKIPPED_NONFINITE = 0, 1, 2, 3, 4
#: The warning of a skipped fold, by status (``None``: the layer already warned, counting the non-finite block).
SKIP_MESSAGES = {
    SKIPPED_EMPTY: "a block had no samples; the fold was skipped and the transform kept",
    SKIPPED_MOMENTS: "non-finite moments; the fold was skipped and the transform kept",
    SKIPPED_NONFINITE: None,
}


class FoldOutcome(NamedTuple):
    """What one layer's fold writes besides the mean, computed where the layer is folded (its owner rank)."""

    status: int  # FOLDED, FAILED (the transform failed: the previous one is kept) or a skip (nothing written)
    clamped: bool = False
    buffers: Dict[str, Tensor] = {}  # new buffer values as stored (the layer's dtypes): running_cov, T, Q_s, ...
    problem: Optional[str] = None  # FAILED: why the rule's result was refused (None: the rule's own failure)


class BlockSums(NamedTuple):
    """A block's shifted sums as a fold reads them: ``rows`` samples (times positions), the ``shift`` they are
    about (``None``: 0), ``s1 = sum (x - shift)`` and ``s2 = sum (x - shift)(x - shift)^T``."""

    rows: float
    shift: Optional[Tensor]
    s1: Tensor
    s2: Tensor


#: Fold strategies under torch.distributed (see :func:`fold_layers`).
STRATEGIES = ("auto", "replicated", "owner")


def check_strategy(strategy: str, name: str = "strategy") -> str:
    """``strategy`` if it is one of :data:`STRATEGIES`, else ``ValueError`` naming the argument ``name``.

    Args:
        strategy: the value to check.
        name: the argument's name in the message (default ``"strategy"``; ``convert_model``: ``"fold_strategy"``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"{name} must be one of {STRATEGIES}, but got {name}={strategy!r}")
    return strategy

#: ``"auto"`` spreads the transforms over ranks when the layers' summed ``M^3`` reaches this. Measured on
#: a 2-core CPU with gloo (per-rank CPU time of the fold, 2 and 4 ranks):
#: the owner strategy was as fast or faster than replicated for both ResNet-110 (108 layers, M <= 64,
#: summed M^3 ~1e7) and ResNet-50 (52 layers, M up to 2048). Below ~1e6 (a handful of narrow layers) the
#: models stay replicated, sparing the extra collective (a guard, not a measured crossover).
OWNER_MIN_COST = 1e6


#: Layers whose block was dropped for non-finite sums since the last warning (one warning per fold, not per layer).
_nonfinite_layers: List["WhiteningLayer"] = []


def note_nonfinite(layer: "WhiteningLayer") -> None:
    """A layer dropped a non-finite block: named in the fold's one warning (:func:`warn_nonfinite`; the layer
    notes itself once)."""
    _nonfinite_layers.append(layer)


def warn_nonfinite() -> None:
    """One warning for the layers :func:`note_nonfinite` noted: a non-finite batch reaches every layer after it."""
    if not _nonfinite_layers:
        return
    layers = list(_nonfinite_layers)
    _nonfinite_layers.clear()
    warnings.warn(
        f"{len(layers)} whitening layer(s) dropped a block with non-finite activations (or second moments that "
        f"overflow the input's precision): {_named(layers, 6)}; each skipped that fold, kept its transform and counts "
        "the block in nonfinite_blocks. A non-finite batch (a NaN in the input, an overflow) reaches every layer "
        "after it: check the data, or skip such a step before its backward (e.g. `if not torch.isfinite(loss): "
        "continue`). Said once per layer", RuntimeWarning, stacklevel=3)


@graph_break  # the fold (once per block, host logic, EVD) stays out of compiled graphs
def fold_layers(layers: Iterable["WhiteningLayer"], *, strategy: str = "auto",
                _coordinator: Optional["FoldCoordinator"] = None) -> None:
    """Fold the current block of each layer, statistics summed across ranks when distributed.

    All ranks must call this with the same layers in the same order (they do
    when they run the same number of training forwards, as DDP requires).

    ``strategy`` (only used under ``torch.distributed`` with several ranks):

    * ``"replicated"``: every rank computes every layer's transform (EVD or
      recursive step) from the same global statistics;
    * ``"owner"``: each layer is folded on one rank, layers assigned to
      balance their ``M^3`` cost (:func:`assign_owners`): its scatter is
      summed there only (one ``reduce`` per rank), the rank computes the
      moments, the transform and ``Q_s``, and one ``broadcast`` per rank sends
      its layers' new buffers (as stored) and flags to every rank, which
      writes them and the new mean (every rank has the global mean) and
      updates the counters and the bias compensation;
    * ``"auto"`` (default): ``"owner"`` when the layers' summed ``M^3`` is at
      least :data:`OWNER_MIN_COST`, else ``"replicated"``.

    Either way every rank ends with bit-identical ``mu``, ``Phi_x``, ``T``,
    ``Q_s`` (and the recursive state) and counters, equal to one process on the
    global batch up to float tolerance; a transform that fails on its owner
    leaves every rank with the previous transform and the same failure count.
    ``nonfinite_blocks`` counts the ranks whose block had non-finite sums
    (summed over ranks); such a block is dropped on every rank.

    Args:
        layers: the whitening layers to fold now, sharing one ``process_group``.
        strategy: ``"auto"`` (default), ``"replicated"`` or ``"owner"``, as above.
        _coordinator: internal (the :class:`~whitenlayers.coordinator.FoldCoordinator` calling this, which warns
            about non-finite blocks after its whole fold).
    """
    check_strategy(strategy)
    layers = list(layers)
    if not layers:
        return
    with no_autocast(layers[0].running_mean.device):
        group, world = _dist_group(layers)
        if world == 1:
            # One process: fold one batch of layers at a time, so that the float64 temporaries of a fold (block
            # summary, moments, new transform: several M x M matrices per layer) are held for that batch only,
            # not for every layer of the model at once (ConvNeXt-B / DenseNet-161 with targets="all": gigabytes).
            for chunk in _fold_chunks(layers):
                _fold_all(chunk, *_local_summaries(chunk))
        else:
            owners = _owners(layers, world, strategy)
            _fold_all(layers, *_global_summaries(layers, owners, group), owners, group)
    if _coordinator is None:  # the coordinator warns after its whole fold
        warn_nonfinite()


def fold_summary(layer: "WhiteningLayer", block: BlockSummary) -> None:
    """Fold ``block`` (a summary, e.g. :meth:`~whitenlayers.WhiteningLayer.block_statistics`) into ``layer`` as its
    block, summed across no ranks (``WhiteningLayer.fold(block)``); the layer starts an empty block."""
    nonfinite, firsts = _read_with_firsts(layer.fold_block.nonfinite().view(1), [layer])  # one host synchronisation
    _fold_all([layer], [block], [int(nonfinite[0])], firsts)
    warn_nonfinite()


#: At most this many matrix entries (``groups * M^2`` summed over the layers) are folded together in one process.
FOLD_CHUNK_ELEMENTS = 1 << 25


def _fold_chunks(layers: Sequence["WhiteningLayer"],
                 max_elements: Optional[int] = None) -> List[List["WhiteningLayer"]]:
    """The layers in batches that :func:`_fold_all` folds together, their moments as stacked tensors (one set of
    operations per batch, not per layer) and their transforms in one batched rule call where the rule batches
    (:meth:`~whitenlayers.rules.TransformRule.batch_key`): layers with one :func:`_stack_key`, in order of first
    appearance, split where their summed ``groups * M^2`` would pass ``max_elements`` (default
    :data:`FOLD_CHUNK_ELEMENTS`)."""
    if max_elements is None:
        max_elements = FOLD_CHUNK_ELEMENTS
    by_key: Dict[Any, List["WhiteningLayer"]] = {}  # each key's last chunk, and its summed size
    sizes: Dict[Any, int] = {}
    order: List[List["WhiteningLayer"]] = []
    for layer in layers:
        key = _stack_key(layer)
        n = layer.num_features * (layer.num_features // layer.groups)
        if key in by_key and sizes[key] + n <= max_elements:
            by_key[key].append(layer)
            sizes[key] += n
        else:
            by_key[key] = [layer]
            sizes[key] = n
            order.append(by_key[key])
    return order


def _stack_key(layer: "WhiteningLayer") -> Hashable:
    """Layers with equal keys fold as one stack: same block shape, dtype, device, buffers and config (so the same
    rule batch key, ``alpha`` and ``beta``)."""
    mean = layer.running_mean
    return (F_w.block_shape(layer.num_features, layer.groups), mean.dtype, mean.device, type(layer.rule), layer.config,
            hasattr(layer, "grad_transform"))


def assign_owners(costs: Sequence[float], world_size: int) -> List[int]:
    """Owner rank of each item: longest-processing-time-first greedy on ``costs`` (deterministic).

    Items in decreasing cost (ties: lower index first) go to the least loaded
    rank (ties: lower rank), which keeps the largest load within 4/3 of the
    optimum.

    Args:
        costs: one non-negative cost per item (a layer's ``M^3``).
        world_size: the number of ranks, >= 1.

    Example:
        >>> assign_owners([8.0, 1.0, 1.0, 8.0, 2.0], 2)
        [0, 1, 1, 1, 0]
    """
    load = [0.0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def _owners(layers: Sequence["WhiteningLayer"], world: int, strategy: str) -> Optional[List[int]]:
    """The rank that folds each layer (owner strategy), or ``None``: every rank folds every layer."""
    if strategy == "replicated" or len(layers) < 2:
        return None
    costs = [layer.rule.cost(layer.num_features, layer.groups) for layer in layers]
    if strategy == "auto" and sum(costs) < OWNER_MIN_COST:
        return None
    return assign_owners(costs, world)


def _global_summaries(layers: Sequence["WhiteningLayer"], owners: Optional[Sequence[int]], group
                      ) -> Tuple[List[BlockSummary], List[int], List[bool]]:
    """The global block of each layer (all ranks' samples), its non-finite batch count, summed over ranks, and
    whether it is the layer's first block (:func:`_read_with_firsts`: one host synchronisation for both).

    Phase 1, one ``all_reduce`` for all layers: counts, sums, powers and non-finite batch counts, so every
    rank has every layer's global count and mean. Phase 2: each rank's scatter about the global mean (which
    keeps the sum accurate when ``|mean| >> std``), computed in its accumulator (reset after the fold), summed
    where the layer is folded: ``reduce`` to its owner (owner strategy, :func:`_coalesced` per owner: a large
    scatter alone, small ones packed; here the ``scatter`` of the layers other ranks own is ``None``), or one
    ``all_reduce`` of all layers (replicated).
    """
    sums = [layer.fold_block.sums() for layer in layers]
    flat = torch.cat([torch.cat([n.view(1), n * shift + s1, F_w.block_power(n, shift, s1, s2),
                                 layer.fold_block.nonfinite().view(1)])
                      for layer, (n, shift, s1, s2) in zip(layers, sums)])
    dist.all_reduce(flat, group=group)
    parts = torch.split(flat, [size for layer in layers for size in (1, layer.num_features, layer.num_features, 1)])
    # no scatter yet (phase 2 fills it in where the layer is folded)
    summaries = [BlockSummary(n[0], total / torch.clamp(n[0], min=1.0), None, power)  # type: ignore[arg-type]
                 for n, total, power in zip(parts[0::4], parts[1::4], parts[2::4])]
    counts, firsts = _read_with_firsts(torch.cat(parts[3::4]), layers)
    nonfinite = [int(v) for v in counts]
    scatters = [F_w.scatter_about(*sums_i, s.mean, inplace=True) for sums_i, s in zip(sums, summaries)]
    if owners is None:
        flat2 = torch.cat([x.reshape(-1) for x in scatters])
        dist.all_reduce(flat2, group=group)
        scatters = list(torch.split(flat2, [x.numel() for x in scatters]))
        mine: Sequence[int] = range(len(layers))
    else:
        rank = dist.get_rank(group)
        mine = [i for i, owner in enumerate(owners) if owner == rank]
        works: list = []
        for owner in sorted(set(owners)):
            idx = [i for i in range(len(layers)) if owners[i] == owner]
            dst = _global_rank(group, owner)
            sent = _coalesced([scatters[i] for i in idx], works,
                              lambda t, dst=dst: dist.reduce(t, dst, group=group, async_op=True))
            for i, x in zip(idx, sent):
                scatters[i] = x
        for work in works:
            work.wait()
    for i in mine:
        _, _, _, s2 = sums[i]
        summaries[i] = summaries[i]._replace(scatter=F_w.symmetrize(scatters[i].view(s2.shape)))
    return summaries, nonfinite, firsts


def _local_summaries(layers: Sequence["WhiteningLayer"],
                     sums: Optional[Sequence[BlockSums]] = None
                     ) -> Tuple[List[BlockSummary], List[int], List[bool]]:
    """This process's block of each layer (layers of one :func:`_stack_key`), whether its sums are non-finite and
    whether it is the layer's first block: the summaries computed stacked (one set of operations for all the
    layers), the flags read in one host synchronisation. ``sums``: the blocks' sums
    (an asynchronous fold's copies, :func:`_taken_blocks`), default the
    layers' accumulators."""
    if sums is None:
        sums = [BlockSums(block.rows, block.shift, block.s1, block.s2)
                for block in (layer.fold_block for layer in layers)]
    count = torch.tensor([s.rows for s in sums], dtype=torch.float64, device=sums[0].s1.device)
    shift = torch.stack([s.shift if s.shift is not None else torch.zeros_like(s.s1) for s in sums])
    s1 = _stack64([s.s1 for s in sums])  # the block's sums, in float64 from here on
    s2 = _stack64([s.s2 for s in sums])
    finite = F_w.finite_each(s1, s2)  # (before summarize_block overwrites s2)
    block = F_w.summarize_block(count, shift, s1, s2, inplace=True)
    finite, firsts = _read_with_firsts(finite, layers)
    return _unstack(block, len(layers)), [int(not ok) for ok in finite], firsts


def _read_with_firsts(flags: Tensor, layers: Sequence["WhiteningLayer"]) -> Tuple[List[float], List[bool]]:
    """``flags`` (one value per layer) read to the host together with whether each layer folds its first block
    (``num_blocks == 0``): one host synchronisation for both."""
    blocks = torch.stack([layer.num_blocks for layer in layers]).to(device=flags.device, dtype=torch.float64)
    values, counted = torch.stack([flags.to(torch.float64), blocks]).tolist()
    return values, [n == 0 for n in counted]


def stored_like(items: Sequence[Tuple[Tensor, Tensor]]) -> List[Tensor]:
    """For each ``(buffer, value)``: ``value`` as ``buffer`` stores it (its device and dtype), a contiguous tensor
    of its own (never aliasing ``value``). A conversion already makes one; the rest are cloned together
    (:func:`_own_all`)."""
    out: List[Tensor] = []
    shared: List[int] = []  # those aliasing their value, or not contiguous
    for old, value in items:
        new = value.detach() if value.requires_grad else value  # a fold runs under no_grad: a call saved per item
        if new.dtype != old.dtype or new.device != old.device:
            new = new.to(device=old.device, dtype=old.dtype)
        if new.data_ptr() == value.data_ptr() or not new.is_contiguous():
            shared.append(len(out))
        out.append(new)
    for i, t in zip(shared, _own_all([out[i] for i in shared])):
        out[i] = t
    return out


@torch.no_grad()
def _start_next_blocks(layers: Sequence["WhiteningLayer"], nonfinite: Sequence[int], firsts: Sequence[bool]
                       ) -> List[bool]:
    """Every rank, once the blocks' sums were read and before a fold is computed: count the non-finite blocks and
    start each layer's next block, then write the folds the layers hold pending (an asynchronous fold, computed or
    loaded from a checkpoint: written at the end of the block after the one they were computed from, after that
    block's sums were read, for a fold decides how the next block sums). Returns ``firsts`` as they are once those
    are written (a layer whose pending fold counts no longer folds its first block)."""
    for layer, bad in zip(layers, nonfinite):  # (the block's sums were read before)
        layer.begin_next_block(bad)
    pending = [layer.take_pending_fold() for layer in layers]
    idx = [i for i, fold in enumerate(pending) if fold is not None]
    if not idx:  # (the common case: nothing pending)
        return list(firsts)
    counted = _finish_folds([layers[i] for i in idx], [cast(PendingFold, pending[i]) for i in idx])
    firsts = list(firsts)
    for i, c in zip(idx, counted):
        firsts[i] = firsts[i] and not c
    return firsts


def _new_means(layers: Sequence["WhiteningLayer"], blocks: Sequence[BlockSummary], firsts: Sequence[bool],
               states: Sequence[Dict[str, Tensor]]) -> Tuple[Tensor, Tensor, Tensor]:
    """Every rank, layers of one stack key: the new means ``mu(i)`` (float64, stacked), their change
    ``mu(i) - mu(i-1)`` and whether each layer may sum its next block unshifted (a bool tensor on the device,
    read later with other flags: no host synchronisation here). ``states``: the buffers read (the layers' own, or
    an asynchronous fold's copies, :func:`_fold_states`)."""
    block = BlockSummary(torch.stack([b.count for b in blocks]), torch.stack([b.mean for b in blocks]),
                         None, torch.stack([b.power for b in blocks]))  # type: ignore[arg-type]  # scatter unused
    prev = torch.stack([s["running_mean"] for s in states]).to(torch.float64)
    mu = F_w.fold_mean(prev, block, layers[0].config.alpha, list(firsts))
    unshifted = F_w.unshifted_accurate_each(block, UNSHIFTED_MAX_MEAN2_VAR)
    return mu, mu - prev, unshifted


#: A layer sums a block's products unshifted (no activation-sized subtraction per batch) when its previous block
#: had ``mean^2 <= UNSHIFTED_MAX_MEAN2_VAR * var`` for every feature: the product then loses at most
#: ``log2(1 + UNSHIFTED_MAX_MEAN2_VAR)`` = 2 bits to the cancellation (``functional.batch_sums``).
UNSHIFTED_MAX_MEAN2_VAR = 3.0


class _StackFlags(NamedTuple):
    """A stack's flags per layer, read to the host in one synchronisation (:func:`_outcomes`)."""

    finite: List[bool]  # the new moments are finite
    nonempty: List[bool]  # the block had samples
    unshifted: List[bool]  # the next block may sum unshifted (:func:`_new_means`)


def _outcomes(layers: Sequence["WhiteningLayer"], blocks: Sequence[BlockSummary], firsts: Sequence[bool],
              nonfinite: Sequence[int], mus: Tensor, unshifted: Tensor, owned: bool,
              states: Sequence[Dict[str, Tensor]]) -> Tuple[List[FoldOutcome], List[bool]]:
    """The outcomes of layers of one stack key (on the rank that folds them): their moments stacked, the
    transforms in one batched rule call where the rule batches, ``Q_s`` smoothed stacked; and ``unshifted``
    (:func:`_new_means`' flags of these layers) read in the same host synchronisation as the moments'
    finiteness. Changes nothing. The outcomes' buffers are views of the stacks, copied into the layers' buffers
    by :meth:`~whitenlayers.WhiteningLayer.write_buffers`; ``owned``: tensors of their own as the buffers
    store them (one multi-tensor clone), for a broadcast to other ranks. ``states``: the buffers read."""
    lead = layers[0]
    config, rule = lead.config, lead.rule
    block = _stack(blocks)
    cov_prev = _stack64([s["running_cov"] for s in states])
    block_cov = F_w.block_covariance(block, mus)
    cov = F_w.recursive_average(cov_prev, block_cov, config.alpha, list(firsts), inplace=True)
    finite = F_w.finite_each(mus, cov)
    flags = _StackFlags(*torch.stack([finite, block.count > 0, unshifted.to(finite.device)]).tolist())
    status: List[Optional[int]] = []
    for k, bad in enumerate(nonfinite):
        if bad:
            status.append(SKIPPED_NONFINITE)  # a batch with non-finite values, on this rank or another: dropped
        elif not flags.nonempty[k]:
            status.append(SKIPPED_EMPTY)
        elif not flags.finite[k]:
            status.append(SKIPPED_MOMENTS)
        else:
            status.append(None)
    todo = [k for k, st in enumerate(status) if st is None]
    stacked = Fold(block, mus, cov, block_cov, list(firsts))
    if len(todo) < len(layers):
        stacked = Fold(BlockSummary(*(t[todo] for t in block)), mus[todo], cov[todo], block_cov[todo],
                       [firsts[k] for k in todo])
    results, problems = _transforms([layers[k] for k in todo], stacked, [states[k] for k in todo])
    stored_dtype = lead.running_cov.dtype
    covs_stored = cov.to(stored_dtype).unbind(0)
    done = [(k, r) for k, r in zip(todo, results) if r is not None]
    items: List[Tuple[int, str, Tensor]] = []
    if done and hasattr(lead, "grad_transform"):
        gram = _restack([r.gram for _, r in done]).to(rule.gram_dtype(stored_dtype))
        prev = _restack([states[k]["grad_transform"] for k, _ in done])  # (read only: smoothing makes a new tensor)
        beta = cast("Union[EVDConfig, RecursiveConfig]", config).beta  # the configs of layers with a Q_s
        qs = F_w.smooth_grad_transform(prev, gram, beta).to(lead.grad_transform.dtype)
        items += [(k, "grad_transform", q) for q, (k, _) in zip(qs.unbind(0), done)]
    for k, result in zip(todo, results):
        items.append((k, "running_cov", covs_stored[k]))
        if result is not None:
            items.append((k, "whitening_matrix", result.transform))
            items += [(k, name, value) for name, value in result.buffers.items()]
    new: Dict[int, Dict[str, Tensor]] = {k: {} for k in todo}
    values = (stored_like([(layers[k].fold_buffers()[name], value) for k, name, value in items]) if owned
              else [v for _, _, v in items])
    for (k, name, _), value in zip(items, values):
        new[k][name] = value
    out = [FoldOutcome(cast(int, st)) for st in status]  # st None: a placeholder, replaced below
    for k, result, problem in zip(todo, results, problems):
        out[k] = FoldOutcome(FAILED if result is None else FOLDED, result is not None and bool(result.clamped), new[k],
                             problem)
    return out, flags.unshifted


def _transforms(layers: Sequence["WhiteningLayer"], stacked: Fold, states: Sequence[Dict[str, Tensor]]
                ) -> Tuple[List[Optional[RuleResult]], List[Optional[str]]]:
    """The rule's new transform of each layer (``None``: it failed) and, for a result refused, the problem found
    (else ``None``), layers of one stack key with their folds ``stacked``: one batched rule call when the rule
    batches them, else one call per layer. ``states``: the buffers read."""
    if not layers:
        return [], []
    lead = layers[0]
    # Each layer's buffers by name (its ``_buffers``, read as ``named_buffers(recurse=False)`` reads them, without
    # that generator's bookkeeping: this runs per layer per fold).
    states = [{k: v for k, v in state.items() if v is not None} for state in states]
    mean = lead.running_mean
    if len(layers) > 1 and batch_key_of(lead.rule, lead.num_features, mean.dtype, mean.device, lead.groups) is not None:
        pre = lead.rule.compute_batched(stacked, states, lead.running_mean.dtype)
    else:
        pre = [NOT_COMPUTED] * len(layers)
    folds = [Fold(block, mean, cov, block_cov, first) for block, mean, cov, block_cov, first in
             zip(_unstack(stacked.block, len(layers)), stacked.mean.unbind(0), stacked.cov.unbind(0),
                 stacked.block_cov.unbind(0), cast(List[bool], stacked.first))]
    results = [lead.rule.update(fold, state, p) for fold, state, p in zip(folds, states, pre)]
    if type(lead.rule) in _BUILT_IN:  # they check their own results (finite; shapes by construction)
        return results, [None] * len(results)
    # Another rule's results are checked (shapes, dtypes, finite, Q symmetric): a bad one keeps the previous transform
    # (counted in transform_failures) and its layer warns once, naming the rule and the problem (fold_writes).
    problems = check_results(results, [F_w.block_shape(layer.num_features, layer.groups) for layer in layers],
                             [{n: layer.fold_buffers()[n] for n in layer.rule_buffer_names()} for layer in layers])
    for k, problem in enumerate(problems):
        if problem is not None:
            results[k] = None
    return results, problems


def _broadcast_outcomes(layers: Sequence["WhiteningLayer"], outcomes: Sequence[Optional[FoldOutcome]],
                        src: int, group) -> List[FoldOutcome]:
    """The outcomes of the layers rank ``src`` folded, on every rank: broadcasts from ``src`` of their status
    and clamp flags and of each buffer as stored (:func:`_coalesced`: a large buffer alone, received straight
    into its new tensor; small ones packed). A buffer the outcome lacks (failed or skipped fold) is sent as the
    layer's current one."""
    mine = dist.get_rank(group) == src
    dev = layers[0].running_mean.device
    if mine:  # src computed every outcome (other ranks: None)
        heads = torch.tensor([[float(o.status), float(o.clamped)] for o in cast("Sequence[FoldOutcome]", outcomes)],
                             device=dev)
    else:
        heads = torch.empty(len(layers), 2, device=dev)
    tensors = [heads]
    for layer, outcome in zip(layers, outcomes):
        for name, shape in layer.outcome_layout():
            current = getattr(layer, name)
            tensors.append(cast(FoldOutcome, outcome).buffers.get(name, current) if mine else
                           torch.empty(shape, dtype=current.dtype, device=current.device))
    works: list = []
    source = _global_rank(group, src)
    tensors = _coalesced(tensors, works, lambda t: dist.broadcast(t, source, group=group, async_op=True))
    for work in works:
        work.wait()
    if mine:
        return list(cast("Sequence[FoldOutcome]", outcomes))
    out, pos = [], 1
    for layer, (status, clamped) in zip(layers, tensors[0].tolist()):
        layout = layer.outcome_layout()
        keep = {FOLDED: len(layout), FAILED: 1}.get(int(status), 0)  # a failed transform: running_cov only
        # small buffers arrived in a packed buffer: copied out, so that no buffer holds on to it
        buffers = {name: t.clone() if t._base is not None else t
                   for (name, _), t in zip(layout[:keep], tensors[pos : pos + keep])}
        out.append(FoldOutcome(int(status), bool(clamped), buffers))
        pos += len(layout)
    return out


#: Tensors with fewer elements than this travel in one flat buffer per collective and dtype (a gloo call costs
#: about half a millisecond of CPU: ResNet-110's 108 small layers each alone cost more than their transforms);
#: larger ones travel alone, without a packed copy.
COALESCE_NUMEL = 1 << 16


def _coalesced(tensors: Sequence[Tensor], works: list, collective) -> List[Tensor]:
    """Start ``collective(t)`` (asynchronous, returns a work, appended to ``works``) for each of ``tensors``: the
    large ones alone, the small ones together in one flat buffer per dtype. Returns the tensors that hold the
    results once the works are done: the large ones themselves, views of the flat buffers for the small ones."""
    out = list(tensors)
    small: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() >= COALESCE_NUMEL:
            works.append(collective(t))
        else:
            small.setdefault(t.dtype, []).append(i)
    for idx in small.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        works.append(collective(flat))
        for i, part in zip(idx, torch.split(flat, [tensors[i].numel() for i in idx])):
            out[i] = part.view(tensors[i].shape)
    return out


class PendingFold(NamedTuple):
    """A layer's fold computed but not written yet (:func:`_compute_folds`), what
    :meth:`~whitenlayers.WhiteningLayer.fold_writes` writes: the outcome (``None``: computed on another rank,
    broadcast before it is written), the new mean as the buffer stores it, its change (float64) and whether the
    next block sums unshifted."""

    outcome: Optional[FoldOutcome]
    mean: Tensor
    delta: Tensor
    unshifted: bool
    nonfinite: int = 0  # the ranks whose block had non-finite sums, counted when it is written (asynchronous)


@torch.no_grad()
def _fold_all(layers: Sequence["WhiteningLayer"], summaries: Sequence[BlockSummary], nonfinite: Sequence[int],
              firsts: Sequence[bool], owners: Optional[Sequence[int]] = None, group=None) -> None:
    """Fold each layer from its global block (its summary, read: ``summaries``), in this order:

    1. :func:`_start_next_blocks`: every layer starts its next block and writes a fold it holds pending (an
       asynchronous fold's, or one loaded from a checkpoint);
    2. :func:`_compute_folds`: each layer's fold from its summary and buffers, computed on every rank (``owners``
       ``None``) or on its owner rank; writes nothing;
    3. :func:`_finish_folds`: every rank writes every fold (the owners' outcomes broadcast first).

    Layers of one :func:`_stack_key` fold as one stack: their moments in one set of tensor operations, their
    transforms in one :meth:`~whitenlayers.rules.TransformRule.compute_batched` call where the rule batches
    (EVD: one batched ``eigh`` per width, dtype, device, ``eps``, ``gmax``, ``gains``; same results as one call
    per layer to float tolerance, with the same per-layer fallbacks and failure counts). The moments are the same
    to the last bit stacked or alone (elementwise operations only). Host synchronisations per stack: the
    summaries' (before this), the moments' flags (:func:`_outcomes`) and the rule's own.
    """
    firsts = _start_next_blocks(layers, nonfinite, firsts)
    folds = _compute_folds(layers, summaries, nonfinite, firsts, [layer.fold_buffers() for layer in layers], owners,
                           group)
    _finish_folds(layers, folds, owners, group)


def _compute_folds(layers: Sequence["WhiteningLayer"], summaries: Sequence[BlockSummary], nonfinite: Sequence[int],
                   firsts: Sequence[bool], states: Sequence[Dict[str, Tensor]],
                   owners: Optional[Sequence[int]] = None, group=None) -> List[PendingFold]:
    """Each layer's :class:`PendingFold`, computed from its block's summary and ``states``, the buffers the fold
    reads (its previous mean, covariance, transform, ``Q_s``, the rule's state: the layer's own, or an asynchronous
    fold's copies, :func:`_fold_states`); writes nothing. Layers in the stacks of :func:`_fold_chunks`; with
    ``owners``, the outcomes of this rank's layers only (the others: ``None``)."""
    index = {id(layer): i for i, layer in enumerate(layers)}
    out: List[Optional[PendingFold]] = [None] * len(layers)
    rank = 0 if owners is None else dist.get_rank(group)
    for idx in ([index[id(layer)] for layer in chunk] for chunk in _fold_chunks(layers)):
        chunk, firsts_c, states_c = [layers[i] for i in idx], [firsts[i] for i in idx], [states[i] for i in idx]
        mu, delta, flags_t = _new_means(chunk, [summaries[i] for i in idx], firsts_c, states_c)
        means = mu.to(chunk[0].running_mean.dtype).unbind(0)  # one conversion per stack; copied in later
        mine = [j for j, i in enumerate(idx) if owners is None or owners[i] == rank]
        flags: List[bool] = []
        computed: Dict[int, FoldOutcome] = {}
        if mine:
            outcomes, flags = _outcomes([chunk[j] for j in mine], [summaries[idx[j]] for j in mine],
                                        [firsts_c[j] for j in mine], [nonfinite[idx[j]] for j in mine],
                                        mu if len(mine) == len(idx) else mu[mine],
                                        flags_t if len(mine) == len(idx) else flags_t[mine], owners is not None,
                                        [states_c[j] for j in mine])
            computed.update(zip(mine, outcomes))
        if len(mine) < len(idx):  # layers other ranks fold (owner strategy): their flags read here
            flags = flags_t.tolist()
        for j, (i, d) in enumerate(zip(idx, delta.unbind(0))):
            out[i] = PendingFold(computed.get(j), means[j], d, bool(flags[j]))
    return cast(List[PendingFold], out)


def _finish_folds(layers: Sequence["WhiteningLayer"], folds: Sequence[PendingFold],
                  owners: Optional[Sequence[int]] = None, group=None) -> List[bool]:
    """The fold's apply: each layer's writes (:meth:`~whitenlayers.WhiteningLayer.fold_writes`; the outcomes of the
    layers other ranks folded received first, owner strategy: one broadcast per rank), written for all the layers
    at once (:meth:`~whitenlayers.WhiteningLayer.write_buffers`). Returns whether each layer's fold counted (in
    ``num_blocks``)."""
    writes = []
    counted = [False] * len(layers)
    for src in ([None] if owners is None else range(dist.get_world_size(group))):
        idx = [i for i in range(len(layers)) if src is None or cast("Sequence[int]", owners)[i] == src]
        if not idx:
            continue
        outs: Sequence[Optional[FoldOutcome]] = [folds[i].outcome for i in idx]
        if src is not None:
            outs = _broadcast_outcomes([layers[i] for i in idx], outs, src, group)
        for i, outcome in zip(idx, outs):  # every outcome computed here (replicated) or received from src
            values = layers[i].fold_writes(folds[i], cast(FoldOutcome, outcome))
            if values is not None:
                writes.append((layers[i], values))
                counted[i] = True
    if writes:
        writes[0][0].write_buffers(writes)
    return counted


def _fold_states(layers: Sequence["WhiteningLayer"]) -> List[Dict[str, Tensor]]:
    """Copies of the buffers a fold of each layer reads (its previous mean, covariance, transform, ``Q_s``, the
    rule's state), all made in one call (:func:`_own_all`): what an asynchronous fold computes from while training
    goes on."""
    names = [["running_mean"] + [name for name, _ in layer.outcome_layout()] for layer in layers]
    copies = iter(_own_all([layer.fold_buffers()[name] for layer, group in zip(layers, names) for name in group]))
    return [{name: next(copies) for name in group} for group in names]


def _taken_blocks(layers: Sequence["WhiteningLayer"]) -> List[BlockSums]:
    """Copies of the layers' block sums as :func:`_local_summaries` reads them (the shift too: the next fold writes
    the next block's shift into it), all made in one call (:func:`_own_all`): for an asynchronous fold to summarise
    while the next block accumulates."""
    parts = [layer.fold_block.parts_to_copy() for layer in layers]
    copies = iter(_own_all([t for _, shift, sums in parts for t in (shift, *sums) if t is not None]))
    taken: List[BlockSums] = []
    for count, shift, sums in parts:
        shift_copy = None if shift is None else next(copies)
        first = next(copies)
        if len(sums) == 1:  # the augmented accumulator: s1 and s2 are its views
            taken.append(BlockSums(count, shift_copy, first[:-1, -1], first[:-1, :-1]))
        else:
            taken.append(BlockSums(count, shift_copy, first, next(copies)))
    return taken


def _named(layers: Sequence["WhiteningLayer"], most: int) -> str:
    """The first ``most`` layers' names for a message (``'layer1.0.conv1', ... and 12 more``)."""
    names = ", ".join(repr(layer.layer_name or type(layer).__name__) for layer in layers[:most])
    return names + (f" and {len(layers) - most} more" if len(layers) > most else "")


def _warn_uncalled(layers: Sequence["WhiteningLayer"]) -> None:
    """Warn about training-mode layers that have seen no input although a block of the model has ended."""
    uncalled = [layer for layer in layers
                if layer.gathers_now() and not layer.fold_block.fold_pending and layer.batches_in_block == 0
                and int(layer.num_blocks) == 0]
    if uncalled:
        warnings.warn(
            f"{len(uncalled)} whitening layer(s) saw no input during the model's first block of training forwards: "
            f"{_named(uncalled, 8)}. The model probably uses their weights without calling them as modules (e.g. "
            "torchvision's Swin attention passes qkv.weight to a function), so they do not whiten: convert the "
            "model without them (a predicate, or conversion_report to see the targets)", RuntimeWarning,
            stacklevel=3,
        )

