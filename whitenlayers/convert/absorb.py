"""Which BatchNorm absorbs a layer's centring: a ``torch.fx`` trace of the enclosing block."""
from __future__ import annotations

import collections
import copy
import functools
import itertools
import warnings
from typing import (
    Dict,
    Optional,
    Sequence,
    Tuple,
    cast,
)

import torch
import torch.fx
from torch import nn

from ..layers import DirectWhitenWrapper
from ..layers._checks import BATCH_NORMS, CONVS
from ._common import _is_whitening


# --------------------------------------------------------------------------
# Centring absorbed by a following BatchNorm: which targets feed only a BatchNorm
# --------------------------------------------------------------------------
class _DataflowTracer(torch.fx.Tracer):
    """torch.fx tracer that keeps the targets (and whitening layers) as leaves, so their calls show as nodes."""

    def __init__(self, leaves: set) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A BatchNorm subclass with a forward of its own (timm's BatchNormAct2d) is a leaf too: whether it may
        # absorb is decided by _absorbing_batchnorm_ok, not by tracing into it. So is a module that holds neither
        # a target nor a BatchNorm: its inside cannot matter here, and its forward may not be traceable (timm's
        # Conv2dSame pads by a data-dependent rule), which would leave the whole enclosing block centred.
        if id(m) in self._leaves or _is_whitening(m) or isinstance(m, BATCH_NORMS):
            return True
        return (not any(id(s) in self._leaves or isinstance(s, BATCH_NORMS) for s in m.modules())
                or super().is_leaf_module(m, module_qualified_name))


def _absorbing_batchnorm_ok(layer: nn.Module, bn: nn.Module) -> bool:
    if isinstance(layer, DirectWhitenWrapper):  # a direct layer's output is its wrapped layer's
        layer = layer.layer
    if isinstance(layer, CONVS):
        batchnorm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(layer.kernel_size)]
        kinds: Tuple[type, ...] = (batchnorm, nn.SyncBatchNorm)
        features = layer.out_channels
    else:
        kinds = (nn.BatchNorm1d, nn.SyncBatchNorm)
        features = cast(nn.Linear, layer).out_features
    return (isinstance(bn, kinds) and isinstance(bn, BATCH_NORMS) and bn.num_features == features
            and not bn._forward_pre_hooks and _removes_batch_mean(bn, len(getattr(layer, "kernel_size", ()))))


#: The forwards PyTorch's BatchNorms run: they normalise with the batch mean in training mode.
_TORCH_FORWARDS = (nn.BatchNorm2d.forward, nn.SyncBatchNorm.forward)


@torch.no_grad()
def _removes_batch_mean(bn: nn.Module, spatial_dims: int) -> bool:
    """Whether ``bn``'s forward may absorb a layer's centring: PyTorch's own BatchNorm forwards, or one of a
    subclass (timm's ``BatchNormAct2d``: the normalisation, then dropout / an activation) that passes a probe.

    The probe runs a float64 copy of ``bn`` on the CPU (a copy on the meta device is materialised first), with
    random affine parameters, in training mode, on a small random input ``x`` and on ``x + c`` for a random
    per-channel constant ``c``: the outputs must agree to 1e-9 (the forward removes the batch mean, so the centring
    offset drops out and the input gradient sums to zero per channel), and the running mean must move by the
    BatchNorm's factor times ``c`` (what the layer's ``absorbed_offset`` assumes). Anything else (a stochastic
    forward, one that ignores the batch mean, one that raises) is left centred.
    """
    if type(bn).forward in _TORCH_FORWARDS:
        return True
    f64 = torch.float64
    try:
        probe = copy.deepcopy(bn)
        if any(t.is_meta for t in itertools.chain(probe.parameters(), probe.buffers())):
            probe = probe.to_empty(device="cpu")
        probe = probe.to(device="cpu", dtype=f64).train()
        gen = torch.Generator().manual_seed(0)
        c = cast(nn.BatchNorm2d, probe).num_features
        for name, value in (("weight", torch.rand(c, generator=gen, dtype=f64) + 0.5),
                            ("bias", torch.randn(c, generator=gen, dtype=f64))):
            if getattr(probe, name, None) is not None:
                getattr(probe, name).copy_(value)
        cast(nn.BatchNorm2d, probe).reset_running_stats()
        other = copy.deepcopy(probe)
        view = (1, c) + (1,) * spatial_dims
        x = torch.randn((4, c) + (3,) * spatial_dims, generator=gen, dtype=f64)
        shift = torch.randn(c, generator=gen, dtype=f64) * 4
        same = torch.allclose(probe(x), other(x + shift.view(view)), rtol=1e-9, atol=1e-9)
        rm_a, rm_b = getattr(probe, "running_mean", None), getattr(other, "running_mean", None)
        if same and rm_a is not None and rm_b is not None:
            momentum = cast(nn.BatchNorm2d, probe).momentum
            factor = 1.0 if momentum is None else momentum  # cumulative average: 1 / 1 after the first batch
            same = torch.allclose(rm_b - rm_a, factor * shift, rtol=1e-9, atol=1e-9)
        return bool(same)
    except Exception:  # a forward that cannot run on this probe: nothing absorbed
        return False


def absorbing_batchnorms(
    model: nn.Module, targets: Sequence[Tuple[str, nn.Module]]
) -> Dict[int, Tuple[nn.Module, nn.Module]]:
    """For each target whose output feeds one BatchNorm and nothing else: ``id(target) -> (BatchNorm, its parent)``.

    The rule (conservative; anything else is left centred): the dataflow of
    the forward of the target's parent module is traced with ``torch.fx``
    (the targets kept as leaf modules; if the parent returns the target's
    output unchanged, the grandparent's forward is traced, and so on). The
    target must be called exactly once there, and its output's only user must
    be one call of a ``BatchNorm2d`` (``BatchNorm1d`` for a linear target) or
    ``SyncBatchNorm`` module with as many features, taking that output as its
    only argument and called once in that forward. The target and the
    BatchNorm must each sit at one place in the model, the target must have
    no forward hooks (they could change its output) and the BatchNorm no
    forward pre-hooks; a BatchNorm absorbs at most one target. A forward that
    ``torch.fx`` cannot trace (data-dependent control flow) absorbs nothing.
    Whether the BatchNorm is in training mode is checked at every forward by
    the layer itself, not here. A target may be a
    :class:`~whitenlayers.DirectWhitenWrapper` (the export of a bias-free
    ``direct`` layer asks): its wrapped layer's kind and features count.
    """
    places = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    leaves = {id(m) for _, m in targets}

    @functools.lru_cache(maxsize=None)
    def graph_of(path: str) -> Optional[torch.fx.Graph]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _DataflowTracer(leaves).trace(model.get_submodule(path))
        except Exception:  # untraceable forward: nothing absorbed there
            return None

    found: Dict[int, Tuple[nn.Module, nn.Module]] = {}
    for name, layer in targets:
        if not name or places[id(layer)] != 1 or layer._forward_hooks:  # (every forward hook is in _forward_hooks)
            continue
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            anc, rel = ".".join(parts[:depth]), ".".join(parts[depth:])
            graph = graph_of(anc)
            if graph is None:
                break
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == rel]
            if not calls:
                continue  # called from further up, or not at all
            node = calls[0]
            if len(calls) > 1 or len(node.users) != 1:
                break
            user = next(iter(node.users))
            if user.op == "output" and user.args == (node,):
                continue  # returned unchanged: its consumer is in the caller's forward
            if user.op != "call_module" or user.args != (node,) or user.kwargs:
                break
            if sum(1 for n in graph.nodes if n.op == "call_module" and n.target == user.target) != 1:
                break
            path = f"{anc}.{user.target}" if anc else str(user.target)
            bn = model.get_submodule(path)
            if places[id(bn)] == 1 and _absorbing_batchnorm_ok(layer, bn):
                found[id(layer)] = (bn, model.get_submodule(path.rpartition(".")[0]))
            break
    claims = collections.Counter(id(bn) for bn, _ in found.values())
    return {k: v for k, v in found.items() if claims[id(v[0])] == 1}
