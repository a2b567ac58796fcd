"""Transform rules: how a layer's ``T`` and ``Q`` are computed from its statistics at a fold.

A rule is stateless apart from its hyper-parameters (a frozen config of
:mod:`whitenlayers.config`); the state (running statistics, buffers, counters,
checkpoints) is :class:`~whitenlayers.WhiteningLayer`'s. At a fold
the state hands the rule a :class:`Fold` (the block's statistics and the new
moments) and writes back what the rule returns. Adding a rule means adding a
class here and its config class, not editing branches elsewhere.

* :class:`EVDRule` (paper section 3): ZCA ``T = V diag(g)^(1/2) V^T`` from an
  eigendecomposition of ``Phi_x``, ``Q = T^T T``. Layers folding together
  share one batched ``eigh`` per width (``EVDRule.batch_key``).
* :class:`RecursiveRule` (paper section 4): ``Phi_y`` tracked on the whitened
  features, then one ``O(M^2)`` rank-one power reduction plus leakage.

Grouped layers (``groups > 1``) hand in their statistics as ``(G, k, k)``
diagonal blocks (:mod:`whitenlayers.functional`, "Grouped features"): the EVD
rule decomposes all blocks in one batched ``eigh`` (layers whose blocks have
one size share it) with layer-wide gains; the recursive rule takes one step per
group, vectorised over the groups.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Sequence, Type, Union, cast

import torch
from torch import Tensor

from . import functional as F_w
from .config import EVDConfig, RecursiveConfig, WhiteningConfig
from .functional import BlockSummary

__all__ = ["Fold", "RuleResult", "TransformRule", "EVDRule", "RecursiveRule", "rule_for", "NOT_COMPUTED"]

#: ``update``'s default for ``precomputed``: nothing was computed for this layer in a batched call.
NOT_COMPUTED: Any = object()


class Fold(NamedTuple):
    """What a rule gets at a fold: the block (summed over ranks) and the moments after it."""

    block: BlockSummary
    mean: Tensor  # mu(i), float64
    cov: Tensor  # Phi_x(i), float64
    block_cov: Tensor  # the block's covariance about mu(i): the new term of eq. vPhixi, float64
    first: Union[bool, List[bool]]  # block 0: no recursion (a stacked fold: one flag per layer)


class RuleResult(NamedTuple):
    """What a rule returns: the new ``T``, the unsmoothed ``Q`` and the rule's own buffers."""

    transform: Tensor
    gram: Tensor
    buffers: Dict[str, Tensor]
    clamped: bool = False


class TransformRule:
    """Base class: one instance per layer, holding the layer's config."""

    name: str = ""
    config_class: Type[WhiteningConfig] = WhiteningConfig
    #: The failure the state warns about when :meth:`update` returns ``None``.
    failure_message: str = "the transform update failed; the previous transform is kept"

    def __init__(self, config: WhiteningConfig) -> None:
        if type(config) is not self.config_class:
            raise TypeError(f"{type(self).__name__} expects a {self.config_class.__name__}, "
                            f"but got {type(config).__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # Buffers of the rule's own, registered on the layer beside the contract buffers.
    def initial_buffers(self, m: int, factory_kwargs: Dict[str, Any], groups: int = 1) -> Dict[str, Tensor]:
        return {}

    def work_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """Transforms are computed in float32, or float64 for float64 layers."""
        return torch.float64 if state_dtype == torch.float64 else torch.float32

    def gram_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """The dtype of :attr:`RuleResult.gram` (``Q_s`` is smoothed in it)."""
        return self.work_dtype(state_dtype)

    def cost(self, num_features: int, groups: int = 1) -> float:
        """Relative cost of one :meth:`update` (for spreading layers over ranks): ``M^3``, or ``G (M/G)^3`` for
        ``groups=G`` (one ``M/G x M/G`` block per group)."""
        return float(groups) * float(num_features // groups) ** 3

    # Batching across layers (one call for many layers that fold together).
    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        """Layers with equal keys may share :meth:`compute_batched`; ``None``: fold this layer alone."""
        return None

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]], state_dtype: torch.dtype) -> List[Any]:
        """The precomputed part of :meth:`update` for stacked layers, one item per layer: ``fold`` holds their
        folds stacked (a leading layer dimension on every tensor, ``first`` one flag per layer), ``states`` their
        buffers."""
        raise NotImplementedError

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        """The new transform from ``fold`` and the layer's current ``state`` (its buffers); ``None`` on failure.

        ``precomputed`` is this layer's item of a :meth:`compute_batched` result, when there was one.
        """
        raise NotImplementedError


class EVDRule(TransformRule):
    """ZCA from an eigendecomposition of ``Phi_x`` (paper section 3, gains per ERRATA 5 of ``docs/PAPER.md``)."""

    name = "evd"
    config_class = EVDConfig
    config: EVDConfig
    failure_message = "eigendecomposition failed (also in float64); the previous transform is kept"

    def gram_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        return torch.float64

    #: Widest ``M`` whose eigendecompositions are batched across layers on the CPU. Measured (1 thread, MKL,
    #: process CPU time, median of 5; ``batched / looped``): M=16 0.31, 32 0.45, 64 0.65, 128 1.15,
    #: 256 1.23, 512 1.23, 1024 1.14: the batched call saves per-call overhead for small matrices and costs
    #: more than one call per matrix from M = 128 on. Grouped layers: the same bound on the block size ``M/G``
    #: for batching across layers (a grouped layer's own blocks always share one batched call: no Python loop
    #: over groups). Other devices (CUDA) batch every width (:meth:`batch_key`).
    BATCH_MAX_M = 64
    #: Off the CPU, at most this many matrix entries go into one batched ``eigh`` (and its float64
    #: temporaries): one 2048 x 2048 matrix, four of 1024, ... A fold runs after the model's forward, while
    #: its activations are alive, so its transient memory adds to the step's peak: this keeps it at what one
    #: call per layer needs for the widest layers of a ResNet-50.
    EIGH_BATCH_ELEMENTS = 1 << 22

    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        """Layers of one width (or one block size, grouped), dtype, device, ``eps``, ``gmax`` and ``gains`` share
        one batched ``eigh``: at every width on a GPU, up to :attr:`BATCH_MAX_M` on the CPU.

        On CUDA a call per layer costs more than its decomposition's own time: torch decomposes the matrices of
        a batched call one by one above 32 (pytorch#175585) but in C++, with one status check (a host
        synchronisation) per call; a call per layer adds its Python, its finiteness checks (three host
        synchronisations) and its launches of the gains and products, each a stall of the GPU (a ResNet-50
        fold: 45 calls, 159 host synchronisations one by one, 3 stacked). The CPU keeps a call per wide layer,
        where it is the faster (measured above; :func:`~whitenlayers.functional.fused_moments` takes the GPU's
        choice on a CPU, for counting)."""
        if num_features // groups > self.BATCH_MAX_M and not F_w.fused_moments_on(device):
            return None
        c = self.config
        if groups != 1:  # grouped layers with blocks of one size share one batched eigh
            return ("evd-grouped", num_features // groups, self.work_dtype(state_dtype), device, c.eps, c.gmax, c.gains)
        return ("evd", num_features, self.work_dtype(state_dtype), device, c.eps, c.gmax, c.gains)

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]], state_dtype: torch.dtype) -> List[Any]:
        work = self.work_dtype(state_dtype)
        c = self.config
        covs = fold.cov.to(work)
        if covs.dim() == 4:  # grouped layers: (L, G, k, k)
            return F_w.evd_transform_grouped_batched(list(covs), eps=c.eps, gmax=c.gmax, gains=c.gains)
        per_call = max(1, self.EIGH_BATCH_ELEMENTS // (covs.shape[-1] ** 2)) if covs.shape[-1] > self.BATCH_MAX_M \
            else covs.shape[0]
        out: List[Any] = []
        for start in range(0, covs.shape[0], per_call):
            out += F_w.evd_transform_batched(covs[start : start + per_call], eps=c.eps, gmax=c.gmax, gains=c.gains)
        return out

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        c = self.config
        res = precomputed
        if res is NOT_COMPUTED:
            work = self.work_dtype(state["whitening_matrix"].dtype)
            evd = F_w.evd_transform_grouped if fold.cov.dim() == 3 else F_w.evd_transform
            res = evd(fold.cov.to(work), eps=c.eps, gmax=c.gmax, gains=c.gains)
        if res is None:
            return None
        t, q = res
        # Q_s is smoothed in float64 (gram_dtype; its buffer keeps the layer's statistics dtype).
        return RuleResult(t, q, {})


class RecursiveRule(TransformRule):
    """Recursive ``O(M^2)`` update (paper section 4, ERRATA 3 and 6)."""

    name = "recursive"
    config_class = RecursiveConfig
    config: RecursiveConfig
    failure_message = "non-finite recursive step; the previous transform is kept"

    def initial_buffers(self, m: int, factory_kwargs: Dict[str, Any], groups: int = 1) -> Dict[str, Tensor]:
        return {
            "running_cov_whitened": torch.zeros(F_w.block_shape(m, groups), **factory_kwargs),  # Phi_y
            "running_power": torch.zeros(m, **factory_kwargs),  # phi_x,m (uncentred)
            "whitening_gram": F_w.block_identity(m, groups, **factory_kwargs),  # unsmoothed Q = T^T T
        }

    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        # O(M^2) state per layer: layers of one shape always batch (the config is compared by the caller's stacks)
        return ("recursive", num_features, groups, self.work_dtype(state_dtype), device)

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]],
                        state_dtype: torch.dtype) -> List[Optional[RuleResult]]:
        c = self.config
        # Working precision float32 (float64 for float64 layers): the recursion is contractive (gamma < 1),
        # so its round-off stays at the working precision instead of accumulating.
        wd = self.work_dtype(state_dtype)
        first = list(cast(List[bool], fold.first))  # stacked: one flag per layer
        t_prev = torch.stack([s["whitening_matrix"] for s in states]).to(wd)
        phi_y = F_w.whitened_covariance_update(torch.stack([s["running_cov_whitened"] for s in states]), t_prev,
                                               fold.block_cov, c.alpha, first)
        power_prev = torch.stack([s["running_power"] for s in states])
        n = torch.clamp(fold.block.count, min=1.0).unsqueeze(-1)
        power = F_w.recursive_average(power_prev, fold.block.power / n, c.alpha, first)
        mean_power = power.mean(-1).to(wd)
        k = t_prev.shape[-1]
        groups = t_prev.shape[1] if t_prev.dim() == 4 else 1
        if groups > 1:  # each group of a layer: the layer's mean power (as for an ungrouped layer)
            mean_power = mean_power.repeat_interleave(groups)
        step, over = F_w.recursive_step_blocks(
            t_prev.reshape(-1, k, k),
            torch.stack([s["whitening_gram"] for s in states]).to(wd).reshape(-1, k, k),
            phi_y.reshape(-1, k, k),
            mean_power,
            gamma=c.gamma,
            delta=c.delta,
            eps=c.eps,
            c_rel=c.c_rel,
            c_abs=c.c_abs,
        )
        t_new, gram = step.transform.reshape(t_prev.shape), step.gram.reshape(t_prev.shape)
        finite = F_w.finite_each(t_new, gram)
        flags = torch.stack([finite, over.view(len(states), groups).any(-1)]).tolist()
        power = power.to(state_dtype)  # as its buffer stores it: one conversion per stack, not one per layer
        # one unbind per stacked result (a call each, not one indexing call per layer and result)
        return [RuleResult(t, q, {"running_cov_whitened": y, "running_power": p, "whitening_gram": q}, bool(over))
                if ok else None
                for t, q, y, p, ok, over in zip(t_new.unbind(0), gram.unbind(0), phi_y.unbind(0), power.unbind(0),
                                                flags[0], flags[1])]

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        if precomputed is NOT_COMPUTED:  # one layer: a stack of one
            stacked = Fold(F_w.BlockSummary(*(t.unsqueeze(0) for t in fold.block)), fold.mean.unsqueeze(0),
                           fold.cov.unsqueeze(0), fold.block_cov.unsqueeze(0), [cast(bool, fold.first)])
            precomputed = self.compute_batched(stacked, [state], state["whitening_matrix"].dtype)[0]
        return precomputed


_RULES: Dict[str, Type[TransformRule]] = {r.name: r for r in (EVDRule, RecursiveRule)}


def rule_for(config: WhiteningConfig) -> TransformRule:
    """The rule instance for a config (``EVDConfig`` -> :class:`EVDRule`, ...)."""
    for rule in _RULES.values():
        if type(config) is rule.config_class:
            return rule(config)
    raise TypeError(f"no transform rule takes a {type(config).__name__}")
