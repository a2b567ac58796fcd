"""The EVD transform (paper sections 2-3): robust eigendecomposition, gains, ZCA ``T`` and ``Q = T^T T``,
dense, grouped and batched over layers. Part of :mod:`whitenlayers.functional`."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .moments import all_finite, finite_each, symmetrize
from .spectrum import effective_rank

__all__ = ["whitening_gains", "evd_transform", "evd_transform_batched", "damped_transform",
           "damped_transform_batched", "cholesky_dtype", "robust_eigh", "eigh_dtype", "grouped_whitening_gains",
           "evd_transform_grouped", "evd_transform_grouped_batched"]


# --------------------------------------------------------------------------
# EVD transform
# --------------------------------------------------------------------------
def eigh_dtype(cov: Tensor) -> torch.dtype:
    """The dtype ``eigh`` works in for ``cov``: float64 on CUDA (cuSOLVER's float64 ``syevd`` took 245 ms for
    ResNet-50's 52 covariances where float32 took 318 ms, on an H100 with torch 2.11, a probe since retired;
    and it is the more accurate), else :func:`cholesky_dtype`: ``cov``'s dtype when float32 / float64, else float32."""
    return torch.float64 if cov.is_cuda else cholesky_dtype(cov)


def robust_eigh(cov: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """``eigh`` of a symmetrised ``cov`` with eigenvalues in decreasing order.

    Returns ``None`` when ``cov`` is not finite or when the decomposition fails
    or returns non-finite values in both the working precision (at least
    float32) and float64. Never raises for numerical reasons.

    Args:
        cov: a square matrix ``(M, M)`` (symmetrised before the decomposition).

    Returns:
        ``(eigenvalues, eigenvectors)`` in decreasing order of the eigenvalues, or ``None``.
    """
    if not all_finite(cov):
        return None
    work = eigh_dtype(cov)
    for dtype in dict.fromkeys((work, torch.float64)):
        try:
            lam, vec = torch.linalg.eigh(symmetrize(cov.to(dtype)))
        except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
            continue
        if all_finite(lam, vec):
            return lam.flip(-1), vec.flip(-1)
    return None


def whitening_gains(
    eigenvalues: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> Tensor:
    """Per-eigenvalue gains ``g`` (``T = V diag(g)^(1/2) V^T``) for decreasing ``eigenvalues``.

    ``gains="practical"`` (ERRATA 5): ``g_m = min(mean(lambda) / max(lambda_m, eps), gmax)``
    for the ``round(M_s)`` largest eigenvalues (``M_s`` per ERRATA 1, clamped to
    ``[1, M]``) and ``1`` for the rest: the signal subspace is whitened to the
    average input power, gains are capped, the noise subspace is left alone.

    ``gains="zca"`` (eq. ``vg``): ``g_m = 1 / max(lambda_m, eps)``, no rank cut, no cap.

    Works on a batch of spectra (last dim), each with its own rank; no host
    synchronisation (``round`` is half-to-even, as Python's).

    Args:
        eigenvalues: spectra ``(..., M)`` in decreasing order (:func:`robust_eigh`'s).
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).

    Returns:
        The gains, ``eigenvalues``' shape.
    """
    lam = torch.clamp(eigenvalues, min=0.0)
    if gains == "zca":
        return 1.0 / torch.clamp(lam, min=eps)
    if gains != "practical":
        raise ValueError(f"gains must be 'practical' or 'zca', but got gains={gains!r}")
    m = lam.shape[-1]
    ms = torch.clamp(torch.round(effective_rank(lam)), 1, m)
    g = torch.clamp(lam.mean(-1, keepdim=True) / torch.clamp(lam, min=eps), max=gmax)
    keep = torch.arange(m, device=lam.device) < ms.unsqueeze(-1)
    return torch.where(keep, g, torch.ones_like(g))


def _zca_from_eig(lam: Tensor, vec: Tensor, eps: float, gmax: float, gains: str,
                  grouped: bool = False) -> Tuple[Tensor, Tensor]:
    """``T = V diag(g)^(1/2) V^T`` and ``Q = V diag(g) V^T`` from decreasing eigenpairs (batched on leading dims).
    ``grouped``: the blocks ``(G, k)``, ``(G, k, k)`` of one layer, ``T_g`` and ``Q_g`` per block with the layer-wide
    gains (:func:`grouped_whitening_gains`)."""
    gains_of = grouped_whitening_gains if grouped else whitening_gains
    g = gains_of(lam, eps=eps, gmax=gmax, gains=gains)
    if grouped and lam.shape[-1] == 1:  # depthwise: the gains themselves
        return g.sqrt().unsqueeze(-1), g.unsqueeze(-1)
    g, vt = g.unsqueeze(-2), vec.transpose(-1, -2)
    return symmetrize((vec * g.sqrt()) @ vt), symmetrize((vec * g) @ vt)


def _finite_in(t: Tensor, q: Tensor, dtype: torch.dtype) -> Optional[Tuple[Tensor, Tensor]]:
    """``(T, Q)`` converted to ``dtype``, or ``None`` when either is not finite."""
    return (t.to(dtype), q.to(dtype)) if all_finite(t, q) else None


def evd_transform(
    cov: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> Optional[Tuple[Tensor, Tensor]]:
    """ZCA whitening matrix ``T = V diag(g)^(1/2) V^T`` and ``Q = T^T T = V diag(g) V^T``.

    Returns ``None`` when the eigendecomposition fails (see :func:`robust_eigh`);
    the caller then keeps its previous transform. Results are in ``cov.dtype``.

    Args:
        cov: a symmetric covariance ``(M, M)``, floating point.
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).

    Returns:
        ``(T, Q)``, both ``(M, M)``, or ``None``.
    """
    dec = robust_eigh(cov)
    return None if dec is None else _finite_in(*_zca_from_eig(*dec, eps, gmax, gains), cov.dtype)


def evd_transform_batched(
    covs: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """:func:`evd_transform` of each matrix of a ``(k, M, M)`` stack, with one batched ``eigh``.

    Same results as ``[evd_transform(c, ...) for c in covs]`` (the batched
    kernels compute each matrix as the single-matrix ones do), at a fraction
    of the per-call overhead when many small layers fold together (the fold of
    a whole ResNet, ``benchmarks/fold_cost.py``). Robust per matrix: a
    non-finite matrix gives ``None``; when the batched ``eigh`` raises, or
    gives non-finite eigenpairs or transforms for some matrices, those
    matrices go through :func:`evd_transform` one by one (working precision,
    then float64). A non-finite matrix never reaches ``eigh``: the batched
    call decomposes the identity in its place. One host synchronisation
    besides the ``eigh``'s own status check: the finiteness of the inputs and
    that of the results, read together.

    Args:
        covs: covariances ``(k, M, M)``.
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).

    Returns:
        One ``(T, Q)`` or ``None`` per matrix.
    """
    if covs.shape[0] == 0:
        return []
    work = eigh_dtype(covs)
    finite_in = torch.isfinite(covs).flatten(1).all(1)  # on the device: read below with the results' check
    eye = torch.eye(covs.shape[-1], dtype=covs.dtype, device=covs.device)
    try:
        lam, vec = torch.linalg.eigh(symmetrize(torch.where(finite_in.view(-1, 1, 1), covs, eye).to(work)))
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        # each alone: None for a non-finite matrix, else working precision, then float64
        return [evd_transform(c, eps=eps, gmax=gmax, gains=gains) for c in covs]
    t, q = _zca_from_eig(lam.flip(-1), vec.flip(-1), eps, gmax, gains)
    # One host synchronisation for the inputs, the decomposition and the transforms: a finite matrix whose
    # eigenpairs or transforms are not finite goes through evd_transform alone (working precision, float64).
    ok_in, ok = torch.stack([finite_in, finite_each(lam, vec, t, q)]).tolist()
    t, q = t.to(covs.dtype), q.to(covs.dtype)  # one conversion per stack; views of it below
    # one unbind each, not an index per layer
    out = [tq if ok_in[j] and ok[j] else None for j, tq in enumerate(zip(t.unbind(0), q.unbind(0)))]
    for j in range(len(out)):
        if ok_in[j] and not ok[j]:
            out[j] = evd_transform(covs[j], eps=eps, gmax=gmax, gains=gains)
    return out


def grouped_whitening_gains(eigenvalues: Tensor, *, eps: float, gmax: float, gains: str = "practical") -> Tensor:
    """:func:`whitening_gains` of a block-diagonal matrix from its blocks' spectra ``(G, k)``.

    The gains are those of the union of the spectra (the dense
    block-diagonal matrix's spectrum): ``"practical"`` gains are normalised by
    the mean eigenvalue over all ``M = G k`` eigenvalues, capped at ``gmax``,
    and given to the ``round(M_s)`` largest eigenvalues of the whole layer
    (``M_s`` the effective rank of the union); the others get 1. ``"zca"``:
    ``1 / max(lambda, eps)``. For ``k = 1`` (depthwise) the eigenvalues are the
    channel variances: ``g_c = min(mean_c' var_c' / var_c, gmax)`` for the
    ``round(M_s)`` highest-variance channels, 1 for the rest.

    Args:
        eigenvalues: the blocks' spectra ``(G, k)``, each in decreasing order.
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).
    """
    if gains != "practical":  # elementwise ('zca'), or the error naming the choices
        return whitening_gains(eigenvalues, eps=eps, gmax=gmax, gains=gains)
    flat = torch.clamp(eigenvalues, min=0.0).reshape(-1)
    m = flat.shape[0]
    ms = torch.clamp(torch.round(effective_rank(flat)), 1, m)
    g = torch.clamp(flat.mean() / torch.clamp(flat, min=eps), max=gmax)
    order = torch.argsort(flat, descending=True, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(m, device=flat.device)
    keep = position < ms
    return torch.where(keep, g, torch.ones_like(g)).view_as(eigenvalues)


def _blocks_eigh(blocks: Tensor) -> Tuple[Tensor, Tensor, List[bool]]:
    """Batched ``eigh`` of finite ``(B, k, k)`` blocks, decreasing eigenvalues, and whether each block has its
    eigenpairs: blocks whose batched result is not finite (all of them when the batched call raises) are retried
    one by one (:func:`robust_eigh`: working precision, then float64); ``False`` where that fails too."""
    if blocks.shape[-1] == 1:  # depthwise: the eigenvalue is the variance, the eigenvector 1
        return blocks[:, :, 0], torch.ones_like(blocks), [True] * blocks.shape[0]
    try:
        lam, vec = torch.linalg.eigh(symmetrize(blocks))
        bad = (~(torch.isfinite(lam).all(-1) & torch.isfinite(vec).flatten(1).all(1))).nonzero().flatten().tolist()
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        lam, vec = blocks.new_empty(blocks.shape[:2]), torch.empty_like(blocks)
        bad = list(range(blocks.shape[0]))
    lam, vec = lam.flip(-1), vec.flip(-1)
    ok = [True] * blocks.shape[0]
    for i in bad:
        dec = robust_eigh(blocks[i])
        if dec is None:
            ok[i] = False
        else:
            lam[i], vec[i] = dec[0].to(blocks.dtype), dec[1].to(blocks.dtype)
    return lam, vec, ok


def evd_transform_grouped(
    covs: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> Optional[Tuple[Tensor, Tensor]]:
    """:func:`evd_transform` of the block-diagonal matrix with blocks ``covs`` ``(G, k, k)``: ``T`` and ``Q`` as blocks.

    Equal (to float tolerance) to the diagonal blocks of
    ``evd_transform(block_diagonal(covs))``, from one batched ``eigh`` of the
    ``k x k`` blocks (none at all for ``k = 1``): :func:`evd_transform_grouped_batched` of this one layer.
    ``None`` when ``covs`` is not finite, or a block's eigendecomposition fails in float64 too. Results in
    ``covs.dtype``.

    Args:
        covs: the diagonal blocks ``(G, k, k)`` of a block-diagonal covariance.
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).
    """
    return evd_transform_grouped_batched([covs], eps=eps, gmax=gmax, gains=gains)[0]


def evd_transform_grouped_batched(
    covs: Sequence[Tensor], *, eps: float, gmax: float, gains: str = "practical"
) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """:func:`evd_transform_grouped` of several layers whose blocks have one size, with one batched ``eigh``.

    ``covs`` holds one ``(G_i, k, k)`` stack per layer (``k`` shared, ``G_i``
    free). The gains are computed per layer (each layer's own mean eigenvalue
    and rank). A layer with non-finite blocks gives ``None`` (its blocks are not
    decomposed); a block whose batched ``eigh`` is not finite is decomposed
    alone (working precision, then float64), and a layer with a block that
    fails in float64 too, or with a non-finite transform, gives ``None``.

    Args:
        covs: one ``(G_i, k, k)`` stack per layer, ``k`` shared.
        eps, gmax, gains: the :class:`~whitenlayers.EVDConfig` fields of those names (``gmax`` unused with
            ``gains="zca"``).

    Returns:
        One ``(T, Q)`` (as blocks) or ``None`` per layer.
    """
    out: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(covs)
    finite = [i for i, c in enumerate(covs) if all_finite(c)]
    if not finite:
        return out
    work = eigh_dtype(covs[finite[0]])
    lam, vec, ok = _blocks_eigh(torch.cat([covs[i].to(work) for i in finite]))
    pos = 0
    for i in finite:
        g = covs[i].shape[0]
        if all(ok[pos : pos + g]):
            tq = _zca_from_eig(lam[pos : pos + g], vec[pos : pos + g], eps, gmax, gains, grouped=True)
            out[i] = _finite_in(*tq, covs[i].dtype)
        pos += g
    return out


# --------------------------------------------------------------------------
# Damped gains: a Cholesky factorisation instead of an eigendecomposition
# --------------------------------------------------------------------------
def cholesky_dtype(cov: Tensor) -> torch.dtype:
    """The dtype a damped transform is factorised in first: ``cov``'s when float32 / float64, else float32 (also on
    CUDA, where a float32 Cholesky factorisation is the fast one; a failed one is retried in float64)."""
    return cov.dtype if cov.dtype in (torch.float32, torch.float64) else torch.float32


#: Below this size :func:`_tril_inverse` solves ``L X = I`` in one call.
_TRIL_INVERSE_LEAF = 128


def _tril_inverse(lower: Tensor) -> Tensor:
    """``L^-1`` of lower triangular matrices ``(..., k, k)``, by halves: ``[[A, 0], [B, C]]^-1 =
    [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``, down to blocks of :data:`_TRIL_INVERSE_LEAF` solved with
    ``solve_triangular``. About a third of the flops of ``solve_triangular(L, I)`` (which treats the identity as
    dense): measured 2.3x faster at M = 768 and 2.7x at M = 2048 (1 thread, float32), with the same error."""
    k = lower.shape[-1]
    if k <= _TRIL_INVERSE_LEAF:
        eye = torch.eye(k, dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False)
    h = k // 2
    a_inv, c_inv = _tril_inverse(lower[..., :h, :h]), _tril_inverse(lower[..., h:, h:])
    out = torch.zeros_like(lower)
    out[..., :h, :h] = a_inv
    out[..., h:, h:] = c_inv
    out[..., h:, :h] = c_inv @ (lower[..., h:, :h] @ a_inv)
    out[..., h:, :h].neg_()
    return out


def _tril_gram(lower: Tensor) -> Tensor:
    """``T^T T`` of lower triangular matrices ``T`` ``(..., k, k)``, by halves: for ``T = [[A, 0], [B, C]]``,
    ``T^T T = [[A^T A + B^T B, B^T C], [C^T B, C^T C]]``, the diagonal blocks recursively, down to
    :data:`_TRIL_INVERSE_LEAF`. Symmetric to the last bit (each diagonal block symmetrised, the off-diagonal
    blocks mirrors). What ``cholesky_inverse`` computes once it has inverted the factor (LAPACK's ``lauum``),
    from the inverse already at hand: measured 1.3x faster than ``cholesky_inverse`` at M = 768 (3.6 against 4.7 ms)
    and 1.25x at 2048 (63 against 79 ms; 1 thread, float32, interleaved), with a relative error of a few float32
    ulps (5e-7 against 2.4e-7)."""
    k = lower.shape[-1]
    if k <= _TRIL_INVERSE_LEAF:
        return symmetrize(lower.mT @ lower)
    h = k // 2
    b = lower[..., h:, :h]
    out = torch.empty_like(lower)
    out[..., :h, :h] = symmetrize(_tril_gram(lower[..., :h, :h]).add_(b.mT @ b))
    out[..., h:, h:] = _tril_gram(lower[..., h:, h:])
    bc = b.mT @ lower[..., h:, h:]
    out[..., :h, h:] = bc
    out[..., h:, :h] = bc.mT
    return out


def _damped_stack(covs: Tensor, eps: float, gmax: float, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """``(T, Q, ok)`` of the damped gains for ``L`` layers of ``G`` blocks each, ``covs`` ``(L, G, k, k)``, in
    ``dtype``: one batched ``cholesky_ex`` (no host synchronisation), ``ok`` ``(L,)`` a bool tensor on the device
    (every block factorised, ``T`` and ``Q`` finite). The factorisation reads the lower triangle only (no
    symmetrisation); ``Q = T^T T`` exactly symmetric (:func:`_tril_gram`)."""
    a = covs.to(dtype, copy=True)  # (a copy of its own: Phi + d I is made in place; one conversion)
    n_layers, groups, k = a.shape[0], a.shape[1], a.shape[-1]
    diag = torch.diagonal(a, dim1=-2, dim2=-1)
    c = torch.clamp(diag.sum((-1, -2)) / (groups * k), min=eps)  # the mean eigenvalue, at least eps
    diag.add_((c / gmax).view(-1, 1, 1))  # Phi + d I, d = c / gmax
    chol, info = torch.linalg.cholesky_ex(a)
    t = _tril_inverse(chol).mul_(c.sqrt().view(-1, 1, 1, 1))
    q = _tril_gram(t)  # T^T T = c (L L^T)^-1
    # Q finite implies T finite (Q's diagonal sums the squares of T's columns: a NaN or Inf in T makes one NaN or
    # Inf there), and a non-finite covariance gives a non-finite Q (or a failed factorisation): one check.
    ok = (info == 0).view(n_layers, groups).all(-1) & finite_each(q)
    return t, q, ok


def damped_transform_batched(
    covs: Tensor, *, eps: float, gmax: float, dtype: Optional[torch.dtype] = None
) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """:func:`damped_transform` of each layer of a stack, with one batched Cholesky factorisation.

    Each layer gets ``Q = c (Phi + d I)^-1`` with ``c = max(tr(Phi) / M, eps)`` (its mean eigenvalue) and
    ``d = c / gmax``, so its gains are ``c / (lambda + d)``: the practical gains' normalisation to the mean
    eigenvalue and their cap ``gmax``, smooth, without the rank cut; and ``T = sqrt(c) L^-1`` for the Cholesky
    factor ``Phi + d I = L L^T``, so that ``T^T T = Q`` (``T`` is lower triangular, not symmetric: a
    whitening, not the ZCA one). No eigendecomposition and, on CUDA, no host synchronisation but the one
    that reads which factorisations succeeded: a Cholesky factorisation, then ``L^-1`` and ``T^T T`` by halves
    (:func:`_tril_inverse`, :func:`_tril_gram`: matrix products). A layer whose factorisation fails (or gives
    non-finite values) is factorised again alone in float64; ``None`` when that fails too (a non-finite
    covariance among them: the fold never hands one to its rule, whose inputs it checks first).

    Args:
        covs: covariances ``(L, M, M)``, or grouped layers' diagonal blocks ``(L, G, k, k)`` (``M = G k``: the
            mean eigenvalue ``c`` is the layer's, over all ``M``, as for the practical gains). Only their lower
            triangles are read.
        eps: floor on ``c`` (a layer of zero features gets ``Q = gmax I``).
        gmax: the largest gain, ``c / d``.
        dtype: the working dtype, also the results' (default :func:`cholesky_dtype` of ``covs``).

    Returns:
        One ``(T, Q)`` (each the shape of one layer's ``covs``) or ``None`` per layer.
    """
    grouped = covs.dim() == 4
    stack = covs if grouped else covs.unsqueeze(1)
    out: List[Optional[Tuple[Tensor, Tensor]]] = [None] * stack.shape[0]
    if stack.shape[0] == 0:
        return out
    work = cholesky_dtype(covs) if dtype is None else dtype
    t, q, ok = _damped_stack(stack, eps, gmax, work)
    ok_out = ok.tolist()  # one host synchronisation
    for j, (tj, qj) in enumerate(zip(t.unbind(0), q.unbind(0))):
        if not ok_out[j] and work != torch.float64:  # retried alone, in float64
            t64, q64, ok64 = _damped_stack(stack[j : j + 1], eps, gmax, torch.float64)
            ok_out[j], tj, qj = bool(ok64[0]), t64[0].to(work), q64[0].to(work)
        if ok_out[j]:
            out[j] = (tj, qj) if grouped else (tj[0], qj[0])
    return out


def damped_transform(cov: Tensor, *, eps: float, gmax: float,
                     dtype: Optional[torch.dtype] = None) -> Optional[Tuple[Tensor, Tensor]]:
    """The damped whitening of one layer: ``Q = c (Phi + d I)^-1``, ``T = sqrt(c) L^-1`` (``Phi + d I = L L^T``).

    ``c = max(tr(Phi) / M, eps)`` is the mean eigenvalue and ``d = c / gmax``: the gains ``c / (lambda + d)``
    are at most ``gmax`` and keep the mean power (for ``lambda >> d``, ``c / lambda`` as the practical
    gains), without an eigendecomposition (:func:`damped_transform_batched`, of which this is the stack of one).
    ``None`` when the factorisation fails in float64 too, or ``cov`` is not finite.

    Args:
        cov: a covariance ``(M, M)``, or a grouped layer's diagonal blocks ``(G, k, k)``.
        eps: floor on ``c``.
        gmax: the largest gain.
        dtype: the working dtype, also the results' (default :func:`cholesky_dtype` of ``cov``).

    Returns:
        ``(T, Q)`` in ``cov``'s shape, or ``None``.

    Example:
        >>> phi = torch.tensor([[4.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> t, q = damped_transform(phi, eps=1e-5, gmax=10.0)  # c = 2.5, d = 0.25
        >>> q.diagonal()
        tensor([0.5882, 2.0000], dtype=torch.float64)
        >>> torch.allclose(t.T @ t, q)
        True
    """
    return damped_transform_batched(cov.unsqueeze(0), eps=eps, gmax=gmax, dtype=dtype)[0]
