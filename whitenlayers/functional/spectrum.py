"""Diagnostics of a covariance: normalised rank ``kappa`` and whiteness ``rho``, dense and grouped.
Part of :mod:`whitenlayers.functional`."""
from __future__ import annotations

import torch
from torch import Tensor

from .moments import symmetrize

__all__ = ["effective_rank", "normalized_rank", "whiteness", "grouped_normalized_rank", "grouped_whiteness"]


# --------------------------------------------------------------------------
# Diagnostics: rank and whiteness
# --------------------------------------------------------------------------
def effective_rank(eigenvalues: Tensor) -> Tensor:
    """Effective rank ``M_s = exp(-sum lam_m log lam_m)`` of a spectrum (ERRATA 1).

    ``lam_m = lambda_m / sum(lambda)`` after clamping negative eigenvalues at 0,
    with ``0 log 0 := 0``. Equal eigenvalues give ``M``, a single non-zero one
    gives 1. An all-zero spectrum gives 1 by convention (nothing to whiten).
    Works on batches of spectra (last dim).

    Args:
        eigenvalues: a spectrum ``(..., M)`` (any order; negative values count as 0), floating point.

    Returns:
        ``M_s`` in ``[1, M]``, shape ``(...)``.

    >>> float(effective_rank(torch.ones(8)))
    8.0
    >>> float(effective_rank(torch.tensor([3.0, 0.0, 0.0])))
    1.0
    """
    # Few operations: a fold computes this once per stack of layers, each operation a dispatch of host time on a
    # GPU. lam / sum(lam) is 0 / 0 = NaN for an all-zero spectrum (and NaN where the spectrum is not finite): taken
    # as 0, whose entropy is 0 (xlogy: 0 log 0 := 0), so the rank is exp(0) = 1, the convention.
    lam = torch.clamp(eigenvalues.to(torch.float64), min=0.0)
    p = torch.nan_to_num(lam / lam.sum(-1, keepdim=True), nan=0.0)
    return torch.exp(-torch.xlogy(p, p).sum(-1)).to(eigenvalues.dtype)


def normalized_rank(cov: Tensor) -> Tensor:
    """``kappa = M_s / M`` of a covariance matrix (unrounded ``M_s``, ERRATA 1).

    Args:
        cov: a symmetric covariance ``(M, M)`` (positive semi-definite up to rounding).

    Returns:
        ``kappa`` in ``[1/M, 1]``, a 0-dim tensor.

    >>> round(float(normalized_rank(torch.eye(4))), 6)
    1.0
    """
    lam = torch.linalg.eigvalsh(symmetrize(cov.to(torch.float64)))
    return (effective_rank(lam) / cov.shape[-1]).to(cov.dtype)


def whiteness(cov: Tensor) -> Tensor:
    """Whiteness ``rho = M / sum_{m,m'} Phi[m,m']^2 / (Phi[m,m] Phi[m',m'])`` (ERRATA 2).

    A diagonal covariance gives 1; fully correlated features give ``1/M``.
    Zero-variance guard: a feature whose variance is not positive is
    uncorrelated with everything and contributes only its own diagonal term
    (1), i.e. it is treated as white; an all-zero covariance gives 1.

    Args:
        cov: a covariance ``(M, M)``.

    Returns:
        ``rho`` in ``[1/M, 1]``, a 0-dim tensor.

    >>> float(whiteness(torch.diag(torch.tensor([1.0, 5.0, 2.0]))))
    1.0
    >>> round(float(whiteness(torch.ones(4, 4))), 6)
    0.25
    """
    return (cov.shape[-1] / _squared_correlations(cov).sum((-1, -2))).to(cov.dtype)


def _squared_correlations(cov: Tensor) -> Tensor:
    """The squared correlations ``Phi[m,m']^2 / (Phi[m,m] Phi[m',m'])`` in float64 (of each matrix of a stack), 1 on
    the diagonal and 0 off it for a feature whose variance is not positive (:func:`whiteness`' guard)."""
    c = cov.to(torch.float64)
    d = torch.diagonal(c, dim1=-2, dim2=-1)
    pos = d > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, d, torch.ones_like(d)), torch.zeros_like(d))
    corr2 = c * c * inv.unsqueeze(-1) * inv.unsqueeze(-2)
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device).bool()
    return torch.where(eye, torch.ones_like(corr2), corr2)


def grouped_normalized_rank(cov: Tensor) -> Tensor:
    """``kappa`` of the block-diagonal covariance with blocks ``cov`` ``(G, k, k)``.

    ``M_s / M`` of the union of the blocks' spectra (ERRATA 1), i.e. of what a
    grouped layer's weights can see: for a depthwise layer, the effective rank
    of the channel variances divided by the number of channels.

    Args:
        cov: the diagonal blocks ``(G, k, k)`` of a block-diagonal covariance.
    """
    lam = torch.linalg.eigvalsh(symmetrize(cov.to(torch.float64)))
    return (effective_rank(lam.reshape(-1)) / lam.numel()).to(cov.dtype)


def grouped_whiteness(cov: Tensor) -> Tensor:
    """``rho`` of the block-diagonal covariance with blocks ``cov`` ``(G, k, k)`` (ERRATA 2, same zero guard).

    Only correlations within a group count (a grouped layer's weights never
    combine channels of different groups); a depthwise layer's ``rho`` is 1.

    Args:
        cov: the diagonal blocks ``(G, k, k)`` of a block-diagonal covariance.
    """
    return (cov.shape[0] * cov.shape[-1] / _squared_correlations(cov).sum()).to(cov.dtype)
