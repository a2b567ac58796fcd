"""The fold: when and how the layers' block statistics become new transforms.

:func:`fold_layers` folds the current block of any number of layers. Under
``torch.distributed`` it first sums their block statistics across ranks in two
coalesced ``all_reduce`` calls (first counts and means, then the scatter about
the global mean, which keeps the sum accurate when ``|mean| >> std``), so all
ranks fold identical numbers. Layers whose rule computes alike (EVD layers of
one width, dtype and device) share one batched eigendecomposition.

:class:`FoldCoordinator` is the forward hook :func:`~whitenlayers.convert_model`
installs on a converted model: layers whose block ends during a forward fold
together after the model's forward. Both are plumbing: users reach them through
``convert_model`` and :meth:`~whitenlayers.stats.WhiteningStatistics.fold`.
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import functional as F_w
from .functional import BlockSummary
from .rules import RuleResult

if TYPE_CHECKING:  # pragma: no cover
    from .stats import WhiteningStatistics

__all__ = ["FoldCoordinator", "fold_layers", "assign_owners", "STRATEGIES"]


def _no_autocast(device: torch.device):
    """Statistics and transforms are computed in their own dtype, never in autocast's lower precision."""
    return torch.autocast(device_type=device.type, enabled=False)


def _dist_group(layers: Sequence["WhiteningStatistics"]):
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = layers[0].process_group
    if not all(layer.process_group is group for layer in layers):
        raise ValueError("fold_layers: all layers folded together must share one process_group")
    if dist.get_world_size(group) == 1:
        return None, 1
    return group, dist.get_world_size(group)


def _all_reduce_summaries(summaries: List[BlockSummary], group) -> List[BlockSummary]:
    """Global block statistics across ranks: two coalesced all_reduce calls for all layers."""
    # Phase 1: counts and count-weighted means -> global count and mean.
    flat = torch.cat([torch.cat([s.count.view(1), s.count * s.mean]) for s in summaries])
    dist.all_reduce(flat, group=group)
    out_mean, pos = [], 0
    for s in summaries:
        m = s.mean.numel()
        n = flat[pos]
        out_mean.append((n, flat[pos + 1 : pos + 1 + m] / torch.clamp(n, min=1.0)))
        pos += 1 + m
    # Phase 2: each rank's scatter about the global mean, and the powers.
    parts = []
    for s, (n, mean) in zip(summaries, out_mean):
        d = s.mean - mean
        if s.scatter.dim() == 3:  # grouped layer: (G, k, k) blocks
            local = s.scatter + s.count * F_w.block_outer(d, d, s.scatter.shape[0])
        else:
            local = s.scatter + s.count * torch.outer(d, d)
        parts.append(torch.cat([local.reshape(-1), s.power]))
    flat2 = torch.cat(parts)
    dist.all_reduce(flat2, group=group)
    result, pos = [], 0
    for s, (n, mean) in zip(summaries, out_mean):
        m, mm = s.mean.numel(), s.scatter.numel()
        scatter = flat2[pos : pos + mm].view(s.scatter.shape)
        power = flat2[pos + mm : pos + mm + m]
        pos += mm + m
        result.append(BlockSummary(n, mean, F_w.symmetrize(scatter), power))
    return result


#: Fold strategies under torch.distributed (see :func:`fold_layers`).
STRATEGIES = ("auto", "replicated", "owner")

#: ``"auto"`` spreads the transforms over ranks when the layers' summed ``M^3`` reaches this. Measured on
#: a 2-core CPU with gloo (``benchmarks/fold_scale.py``, per-rank CPU time of the fold, 2 and 4 ranks):
#: the owner strategy was as fast or faster than replicated for both ResNet-110 (108 layers, M <= 64,
#: summed M^3 ~1e7) and ResNet-50 (52 layers, M up to 2048). Below ~1e6 (a handful of narrow layers) the
#: models stay replicated, sparing the extra collective (a guard, not a measured crossover).
OWNER_MIN_COST = 1e6


@torch.compiler.disable  # the fold (once per block, host logic, EVD) stays out of compiled graphs
def fold_layers(layers: Iterable["WhiteningStatistics"], *, strategy: str = "auto",
                _coordinator: "FoldCoordinator" = None) -> None:
    """Fold the current block of each layer, statistics summed across ranks when distributed.

    All ranks must call this with the same layers in the same order (they do
    when they run the same number of training forwards, as DDP requires).

    ``strategy`` (only used under ``torch.distributed`` with several ranks):

    * ``"replicated"``: every rank computes every layer's transform (EVD or
      recursive step) from the same global statistics;
    * ``"owner"``: each layer's transform is computed on one rank, layers
      assigned to balance their ``M^3`` cost (:func:`assign_owners`), and one
      coalesced ``all_reduce`` sends the results to every rank;
    * ``"auto"`` (default): ``"owner"`` when the layers' summed ``M^3`` is at
      least :data:`OWNER_MIN_COST`, else ``"replicated"``.

    Either way every rank ends with bit-identical ``mu``, ``Phi_x``, ``T``,
    ``Q_s`` (and the recursive state), equal to one process on the global batch
    up to float tolerance; a transform that fails on its owner leaves every
    rank with the previous transform and the same failure count.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, but got strategy={strategy!r}")
    if _coordinator is not None and not _coordinator.checked:  # the first fold after a conversion
        _coordinator.checked = True
        _warn_uncalled(_coordinator.layers)
    layers = list(layers)
    if not layers:
        return
    with _no_autocast(layers[0].running_mean.device):
        group, world = _dist_group(layers)
        if world > 1:
            summaries = _all_reduce_summaries([layer._block_summary() for layer in layers], group)
            _fold_all(layers, summaries, group, world, strategy)
            return
        # One process: fold one batch of layers at a time, so that the float64 temporaries of a fold (block
        # summary, moments, new transform: several M x M matrices per layer) are held for that batch only, not
        # for every layer of the model at once (ConvNeXt-B / DenseNet-161 with targets="all": gigabytes).
        for chunk in _fold_chunks(layers):
            _fold_all(chunk, [layer._block_summary() for layer in chunk])


#: At most this many matrix entries (``groups * M^2`` summed over the layers) are folded together in one process.
FOLD_CHUNK_ELEMENTS = 1 << 25


def _fold_chunks(layers: Sequence["WhiteningStatistics"],
                 max_elements: Optional[int] = None) -> List[List["WhiteningStatistics"]]:
    """The layers in batches that :func:`_fold_all` folds together: those with one rule batch key (one batched
    transform call), in order of first appearance, split where their summed ``groups * M^2`` would pass
    ``max_elements`` (default :data:`FOLD_CHUNK_ELEMENTS`); a layer whose rule does not batch is a batch of its
    own."""
    if max_elements is None:
        max_elements = FOLD_CHUNK_ELEMENTS
    by_key: Dict[Any, List[List["WhiteningStatistics"]]] = {}
    order: List[List["WhiteningStatistics"]] = []
    sizes: Dict[int, int] = {}
    for layer in layers:
        key = layer._rule_batch_key()
        n = layer.num_features * (layer.num_features // layer.groups)
        chunks = by_key.setdefault(key, []) if key is not None else None
        if chunks and sizes[id(chunks[-1])] + n <= max_elements:
            chunks[-1].append(layer)
            sizes[id(chunks[-1])] += n
            continue
        chunk = [layer]
        sizes[id(chunk)] = n
        order.append(chunk)
        if chunks is not None:
            chunks.append(chunk)
    return order


def assign_owners(costs: Sequence[float], world_size: int) -> List[int]:
    """Owner rank of each item: longest-processing-time-first greedy on ``costs`` (deterministic).

    Items in decreasing cost (ties: lower index first) go to the least loaded
    rank (ties: lower rank), which keeps the largest load within 4/3 of the
    optimum.

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


def _use_owner(layers: Sequence["WhiteningStatistics"], world: int, strategy: str) -> bool:
    if world <= 1 or strategy == "replicated" or len(layers) < 2:
        return False
    if strategy == "owner":
        return True
    return sum(layer.rule.cost(layer.num_features, layer.groups) for layer in layers) >= OWNER_MIN_COST


def _compute(items: Sequence[tuple]) -> List[Optional[RuleResult]]:
    """The transforms of ``(layer, fold)`` pairs; those with equal rule batch keys in one batched call."""
    results: List[Optional[RuleResult]] = [None] * len(items)
    groups: Dict[Any, List[int]] = {}
    for i, (layer, fold) in enumerate(items):
        key = layer._rule_batch_key() if len(items) > 1 else None
        if key is None:
            results[i] = layer._transform(fold)
        else:
            groups.setdefault(key, []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            layer, fold = items[idx[0]]
            results[idx[0]] = layer._transform(fold)
            continue
        first = items[idx[0]][0]
        batched = first.rule.compute_batched([items[i][1] for i in idx], first.running_mean.dtype)
        for i, pre in zip(idx, batched):
            layer, fold = items[i]
            results[i] = layer._transform(fold, pre)
    return results


def _result_layout(layer: "WhiteningStatistics") -> List[tuple]:
    """``(name, shape)`` of what a layer's rule returns, from the layer's own buffers."""
    shape = tuple(layer.whitening_matrix.shape)
    layout = [("transform", shape), ("gram", shape)]
    fk = {"device": "meta", "dtype": layer.running_mean.dtype}
    for name in layer.rule.initial_buffers(layer.num_features, fk, groups=layer.groups):
        layout.append((name, tuple(getattr(layer, name).shape)))
    return layout


def _exchange(items: Sequence[tuple], owners: Sequence[int], mine: Dict[int, Optional[RuleResult]], group
              ) -> List[Optional[RuleResult]]:
    """Every rank gets every layer's result from its owner: one ``all_reduce`` (sum) of a buffer in which each
    owner writes its layers' results and every other rank zeros (``x + 0 == x`` exactly), in float32 when all
    results are float32 values, else float64 (float32 values survive that round trip bit for bit). A flag per
    layer says whether it succeeded."""
    layouts = [_result_layout(layer) for layer, _ in items]
    sizes = [2 + sum(math.prod(shape) for _, shape in lay) for lay in layouts]
    dev = items[0][0].running_mean.device
    # float32 layers compute every result in float32 (the EVD rule's float64 Q is a float32 Q cast up), so
    # float32 carries them exactly at half the volume; any float64 layer makes the buffer float64.
    exact32 = all(layer.rule.work_dtype(layer.running_mean.dtype) == torch.float32 for layer, _ in items)
    flat = torch.zeros(sum(sizes), dtype=torch.float32 if exact32 else torch.float64, device=dev)
    pos = 0
    for i, size in enumerate(sizes):
        if i in mine and mine[i] is not None:
            res = mine[i]
            parts = {"transform": res.transform, "gram": res.gram, **res.buffers}
            flat[pos] = 1.0
            flat[pos + 1] = float(res.clamped)
            p = pos + 2
            for name, shape in layouts[i]:
                n = math.prod(shape)
                flat[p : p + n] = parts[name].reshape(-1).to(flat.dtype)
                p += n
        pos += size
    dist.all_reduce(flat, group=group)
    out: List[Optional[RuleResult]] = []
    pos = 0
    for (layer, _), layout, size in zip(items, layouts, sizes):
        if float(flat[pos]) != 1.0:
            out.append(None)
        else:
            state_dtype = layer.running_mean.dtype
            work, gram_dtype = layer.rule.work_dtype(state_dtype), layer.rule.gram_dtype(state_dtype)
            p, parts = pos + 2, {}
            for name, shape in layout:
                n = math.prod(shape)
                parts[name] = flat[p : p + n].view(shape).to(gram_dtype if name == "gram" else work)
                p += n
            transform, gram = parts.pop("transform"), parts.pop("gram")
            out.append(RuleResult(transform, gram, parts, bool(float(flat[pos + 1]))))
        pos += size
    return out


@torch.no_grad()
def _fold_all(layers: Sequence["WhiteningStatistics"], summaries: Sequence[BlockSummary], group=None,
              world: int = 1, strategy: str = "replicated") -> None:
    """Fold each layer: moments on every rank, transforms per ``strategy`` (see :func:`fold_layers`).

    Layers whose rules give equal :meth:`~whitenlayers.rules.TransformRule.batch_key` share one
    :meth:`~whitenlayers.rules.TransformRule.compute_batched` call (EVD: one batched ``eigh`` per width,
    dtype, device, ``eps``, ``gmax``, ``gains``; same results as one call per layer to float tolerance, with
    the same per-layer fallbacks and failure counts).
    """
    items = []
    for layer, summary in zip(layers, summaries):
        fold = layer._fold_start(summary)
        if fold is not None:
            items.append((layer, fold))
    if not items:
        return
    if _use_owner([layer for layer, _ in items], world, strategy):
        owners = assign_owners([layer.rule.cost(layer.num_features, layer.groups) for layer, _ in items], world)
        rank = dist.get_rank(group)
        mine_idx = [i for i, o in enumerate(owners) if o == rank]
        computed = _compute([items[i] for i in mine_idx])
        results = _exchange(items, owners, dict(zip(mine_idx, computed)), group)
    else:
        results = _compute(items)
    for (layer, fold), result in zip(items, results):
        layer._apply_fold(fold, result)


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward.

    Installed as a forward hook on the root module by
    :func:`whitenlayers.convert_model`: layers whose block ends during a
    forward ask to be folded, and the hook folds them in one
    :func:`fold_layers` call (one pair of collectives per block for the whole
    model instead of one per layer). Folding after the model's forward instead
    of right after each layer's forward changes nothing: a block's statistics
    and the transform in force for that batch's backward are the same.
    ``strategy`` is :func:`fold_layers`'s (how transforms are spread over ranks).

    At the first fold after a conversion it checks that every whitening layer
    of the model (:attr:`layers`) in training mode was called: a layer whose
    weight the model uses without calling it as a module (e.g. torchvision's
    Swin attention passes ``qkv.weight`` to a function) never sees its input,
    so it cannot whiten; a ``RuntimeWarning`` names such layers.
    """

    #: Defaults for coordinators pickled before these attributes existed: nothing to check.
    layers: Sequence["WhiteningStatistics"] = ()
    checked: bool = True

    def __init__(self, strategy: str = "auto") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, but got strategy={strategy!r}")
        self.pending: List["WhiteningStatistics"] = []
        self.handle = None
        self.strategy = strategy
        self.layers = []
        self.checked = False

    def request(self, layer: "WhiteningStatistics") -> None:
        if not any(p is layer for p in self.pending):
            self.pending.append(layer)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        fold_layers([p for p in pending if p._fold_pending], strategy=self.strategy, _coordinator=self)

    def __call__(self, module, inputs, output) -> None:
        if self.pending:
            self.flush()

    def __getstate__(self) -> Dict[str, Any]:
        return {"pending": list(self.pending), "handle": None, "strategy": self.strategy, "layers": list(self.layers),
                "checked": self.checked}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update({"strategy": "auto", **state})  # coordinators pickled before strategies existed


def _warn_uncalled(layers: Sequence["WhiteningStatistics"]) -> None:
    """Warn about training-mode layers that have seen no input although a block of the model has ended."""
    uncalled = [layer for layer in layers
                if layer.training and not layer.frozen and not layer._fold_pending and layer.batches_in_block == 0
                and int(layer.num_blocks) == 0]
    if uncalled:
        names = ", ".join(repr(layer.layer_name or type(layer).__name__) for layer in uncalled[:8])
        more = f" and {len(uncalled) - 8} more" if len(uncalled) > 8 else ""
        warnings.warn(
            f"{len(uncalled)} whitening layer(s) saw no input during the model's first block of training forwards: "
            f"{names}{more}. The model probably uses their weights without calling them as modules (e.g. "
            "torchvision's Swin attention passes qkv.weight to a function), so they do not whiten: convert the "
            "model without them (a predicate, or conversion_report to see the targets)", RuntimeWarning,
            stacklevel=4,
        )


