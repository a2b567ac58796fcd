"""A transform rule of one's own: SOAP's eigenbasis refresh, the example of docs/writing-a-rule.md.

Instead of an eigendecomposition at every fold, the rule keeps an estimate of the covariance's eigenbasis in a
buffer of its own and refreshes it with a few power iterations and a QR factorisation, started from the previous
block's basis (as SOAP refreshes its preconditioner's basis); the gains are the practical gains' mean
normalisation and cap, on the Rayleigh quotients. Written from the docs page alone: nothing in the package is
edited. tests/test_rules.py trains with it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import torch
from torch import Tensor

import whitenlayers as wl


@dataclasses.dataclass(frozen=True)
class EigenbasisConfig(wl.EVDConfig):
    """The EVD hyper-parameters (``eps``, ``gmax``, ``beta``, ``block_size``, ...) and one of the rule's own."""

    power_iterations: int = 1  # power iterations per fold, from the previous basis

    def __post_init__(self) -> None:
        super().__post_init__()  # the inherited fields' checks
        if not (isinstance(self.power_iterations, int) and self.power_iterations >= 1):
            raise ValueError(f"{type(self).__name__}: power_iterations (power iterations per fold) must be an "
                             f"integer >= 1, but got power_iterations={self.power_iterations!r}")


class EigenbasisRule(wl.TransformRule):
    """``T = V diag(g)^(1/2) V^T``, ``Q = V diag(g) V^T`` with ``V`` refreshed by power iteration + QR."""

    name = "eigenbasis"  # saved in checkpoints: a checkpoint of another rule does not load
    config_class = EigenbasisConfig

    def initial_buffers(self, m: int, factory_kwargs: Dict[str, Any], groups: int = 1) -> Dict[str, Tensor]:
        # The basis in force: the identity at first; (G, k, k) blocks for a grouped layer, as every matrix.
        return {"eigenbasis": wl.functional.block_identity(m, groups, **factory_kwargs)}

    def update(self, fold: wl.Fold, state: Dict[str, Tensor], precomputed: Any = wl.rules.NOT_COMPUTED
               ) -> wl.RuleResult:
        cov = fold.cov  # Phi_x after this block: float64, (M, M) or (G, k, k)
        basis = state["eigenbasis"].to(cov.dtype)
        for _ in range(self.config.power_iterations):
            basis, _ = torch.linalg.qr(cov @ basis)  # one subspace iteration from the previous basis
        lam = torch.clamp((basis * (cov @ basis)).sum(-2), min=0.0)  # Rayleigh quotient of each basis vector
        gains = torch.clamp(lam.mean() / torch.clamp(lam, min=self.config.eps), max=self.config.gmax)
        t = (basis * gains.sqrt().unsqueeze(-2)) @ basis.mT
        q = (basis * gains.unsqueeze(-2)) @ basis.mT
        q = (q + q.mT) / 2  # symmetric to the last bit: the layer checks Q's symmetry
        dtype = state["whitening_matrix"].dtype  # results as the layer stores them
        return wl.RuleResult(t.to(dtype), q.to(dtype), {"eigenbasis": basis.to(dtype)})
