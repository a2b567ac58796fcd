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

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Sequence

import torch
import torch.distributed as dist

from . import functional as F_w
from .functional import BlockSummary

if TYPE_CHECKING:  # pragma: no cover
    from .stats import WhiteningStatistics

__all__ = ["FoldCoordinator", "fold_layers"]


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
        local = s.scatter + s.count * torch.outer(d, d)
        parts.append(torch.cat([local.reshape(-1), s.power]))
    flat2 = torch.cat(parts)
    dist.all_reduce(flat2, group=group)
    result, pos = [], 0
    for s, (n, mean) in zip(summaries, out_mean):
        m = s.mean.numel()
        scatter = flat2[pos : pos + m * m].view(m, m)
        power = flat2[pos + m * m : pos + m * m + m]
        pos += m * m + m
        result.append(BlockSummary(n, mean, F_w.symmetrize(scatter), power))
    return result


@torch.compiler.disable  # the fold (once per block, host logic, EVD) stays out of compiled graphs
def fold_layers(layers: Iterable["WhiteningStatistics"]) -> None:
    """Fold the current block of each layer, statistics summed across ranks when distributed.

    All ranks must call this with the same layers in the same order (they do
    when they run the same number of training forwards, as DDP requires).
    """
    layers = list(layers)
    if not layers:
        return
    with _no_autocast(layers[0].running_mean.device):
        summaries = [layer._block_summary() for layer in layers]
        group, world = _dist_group(layers)
        if world > 1:
            summaries = _all_reduce_summaries(summaries, group)
        _fold_all(layers, summaries)


@torch.no_grad()
def _fold_all(layers: Sequence["WhiteningStatistics"], summaries: Sequence[BlockSummary]) -> None:
    """Fold each layer; layers whose rules give equal :meth:`~whitenlayers.rules.TransformRule.batch_key` share
    one :meth:`~whitenlayers.rules.TransformRule.compute_batched` call (EVD: one batched ``eigh`` per width,
    dtype, device, ``eps``, ``gmax``, ``gains``; same results as one call per layer to float tolerance, with
    the same per-layer fallbacks and failure counts). The moments, bias compensation and the rules without a
    key run per layer.
    """
    groups: Dict[Any, list] = {}
    for layer, summary in zip(layers, summaries):
        fold = layer._fold_start(summary)
        if fold is None:
            continue
        key = layer._rule_batch_key() if len(layers) > 1 else None
        if key is None:
            layer._fold_finish(fold)
        else:
            groups.setdefault(key, []).append((layer, fold))
    for items in groups.values():
        if len(items) == 1:
            layer, fold = items[0]
            layer._fold_finish(fold)
            continue
        first = items[0][0]
        results = first.rule.compute_batched([f for _, f in items], first.running_mean.dtype)
        for (layer, fold), res in zip(items, results):
            layer._fold_finish(fold, precomputed=res)


class FoldCoordinator:
    """Folds all pending layers of a model together after the model's forward.

    Installed as a forward hook on the root module by
    :func:`whitenlayers.convert_model`: layers whose block ends during a
    forward ask to be folded, and the hook folds them in one
    :func:`fold_layers` call (one pair of collectives per block for the whole
    model instead of one per layer). Folding after the model's forward instead
    of right after each layer's forward changes nothing: a block's statistics
    and the transform in force for that batch's backward are the same.
    """

    def __init__(self) -> None:
        self.pending: List["WhiteningStatistics"] = []
        self.handle = None

    def request(self, layer: "WhiteningStatistics") -> None:
        if not any(p is layer for p in self.pending):
            self.pending.append(layer)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        fold_layers([p for p in pending if p._fold_pending])

    def __call__(self, module, inputs, output) -> None:
        if self.pending:
            self.flush()

    def __getstate__(self) -> Dict[str, Any]:
        return {"pending": list(self.pending), "handle": None}


