"""The recursive transform (paper section 4): principal subspace, the rank-one step, ``Phi_y`` tracking,
the smoothing of ``Q``; dense, grouped and batched. Part of :mod:`whitenlayers.functional`."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Tuple, Union

import torch
from torch import Tensor

from .moments import _first_or, symmetrize

__all__ = ["principal_subspace", "RecursiveStep", "recursive_step", "recursive_step_blocks", "whitened_covariance",
           "whitened_covariance_update", "smooth_grad_transform", "principal_subspace_grouped"]


# --------------------------------------------------------------------------
# Recursive transform (paper section 4)
# --------------------------------------------------------------------------
def principal_subspace(phi_y: Tensor, *, c_rel: float, c_abs: float) -> Tensor:
    """High-power direction ``v_e`` of ``phi_y`` by column alignment (paper section 4.2).

    Column norms ``xi``; the strongest column ``m'``; inner products
    ``c = Phi^T Phi e_m'`` (one matrix-vector product); the coherent set
    ``|c_m| >= max(c_rel xi_m' xi_m, c_abs)``; the columns of that set
    weighted by ``c_m / c_m'`` (which aligns their signs), averaged and
    normalised. Cost: ``O(M^2)`` (a norm per column and one matrix-vector
    product). ``m'`` itself always belongs to the set (``c_m' = xi_m'^2``)
    unless ``phi_y`` is zero, in which case ``e_0`` is returned.

    The paper divides each column by ``c_m`` instead (eq. ``tve``). Both give
    the exact direction of a rank-one ``phi_y``; they differ in how a column
    whose coherent part is weak counts. Divided by ``c_m`` it counts up to
    ``1 / c_rel = 40`` times the strongest column, mostly as noise, and a
    relative change of ``phi_y`` moves ``v_e`` 13 to 24 times as much (medians
    over the folds of recursive layers with 4 to 64 post-ReLU input features;
    up to 86). The recursion feeds ``v_e`` back through ``T`` and
    ``Phi_y``, so any difference in the last bits (float32 against float64,
    another BLAS) grew 2 to 3 times per fold until the layers' ``Q`` disagreed
    by 10-30 %. Weighted by ``c_m / c_m'`` (``|c_m / c_m'| <= 1``) a weak
    column counts little, ``v_e`` moves 2 to 4 times the change of ``phi_y``,
    and a difference does not grow (``benchmarks/recursive_drift.py``).
    Measured on ``ratio * u u^T + I`` with ``M = 24`` and 50 random ``u``:
    worst ``|cos(v_e, u)|`` 0.9992 at ratio 3, 0.999998 at ratio 10 and 1 to
    six digits from ratio 100 (the printed weights: 0.46, 0.46, 0.84, 0.89 at
    ratios 3, 10, 100, 1000). A wrong direction costs one step; the leakage
    undoes it.

    Computed as :func:`principal_subspace_grouped` of a stack of one (the search the layers run).

    Args:
        phi_y: a symmetric matrix ``(M, M)`` (the whitened covariance ``Phi_y``).
        c_rel, c_abs: the :class:`~whitenlayers.RecursiveConfig` fields of those names.

    Returns:
        A unit vector ``(M,)``.
    """
    return principal_subspace_grouped(phi_y.unsqueeze(0), c_rel=c_rel, c_abs=c_abs)[0]


class RecursiveStep(NamedTuple):
    """Result of :func:`recursive_step`: new ``T``, new unsmoothed ``Q`` and the step's quantities.

    Args:
        transform: ``T(i)``.
        gram: the unsmoothed ``Q(i) = T(i)^T T(i)``.
        direction: ``v_e``, the unit direction reduced (per group: ``(G, k)``).
        power: ``lambda_e = v_e^T Phi_y v_e``.
        gain: ``g_e`` after the clamp to at most 1.
        clamped: whether the gain was clamped (the rank-one step was the identity).
    """

    transform: Tensor
    gram: Tensor
    direction: Tensor
    power: Tensor  # lambda_e
    gain: Tensor  # g_e after the clamp
    clamped: bool


def recursive_step(
    t_prev: Tensor,
    q_prev: Tensor,
    phi_y: Tensor,
    mean_power: Tensor,
    *,
    gamma: float,
    delta: float,
    eps: float,
    c_rel: float,
    c_abs: float,
) -> RecursiveStep:
    """One recursive transform update, eqs. ``lambda``..``vQ_rec`` with ERRATA 3 and 6. ``O(M^2)``.

    * ``v_e`` = :func:`principal_subspace` of ``phi_y``; ``lambda_e = v_e^T Phi_y v_e``.
    * ``g_e = delta * mean_power / max(lambda_e, eps)`` where ``mean_power`` is
      the average uncentred input power ``mean_m phi_x,m`` (ERRATA 6).
      **Clamp**: when the subspace holds less power than the target
      (``g_e > 1``) the gain is clamped to 1, so the rank-one step becomes the
      identity and never amplifies; the leakage below still acts, which pulls
      ``T`` back toward ``I`` once the data no longer needs whitening.
    * ``a_e = sqrt(g_e) - 1``, ``t_e = T(i-1)^T v_e`` (ERRATA 3),
      ``T(i) = gamma (T(i-1) + a_e v_e t_e^T) + (1 - gamma) I``.
    * ``Q(i) = T(i)^T T(i)`` by eq. ``vQ_rec`` from the unsmoothed ``Q(i-1)``:
      ``gamma^2 (Q + a(a+2) t t^T) + (1-gamma)^2 I + gamma(1-gamma)(a (v t^T + t v^T) + T + T^T)``.

    Only matrix-vector products and outer products: no EVD, no ``M^3`` product. Computed by
    :func:`recursive_step_blocks` (the step the layers run), ``(M, M)`` matrices as a stack of one.

    A grouped layer's diagonal blocks ``(G, k, k)`` take one step per block at once: each group ``g`` its own
    rank-one power reduction along its own :func:`principal_subspace_grouped` direction ``v_g``, with the target
    power ``delta * mean_power`` (``mean_power`` is the whole layer's mean uncentred input power, as for an
    ungrouped layer), the clamp ``g_e <= 1`` per group and the leakage ``gamma``; ``direction``, ``power`` and
    ``gain`` are then per group, and ``clamped`` is ``True`` when any group's gain was clamped. ``O(G k^2) = O(M k)``
    work in a few batched operations, no Python loop.

    Args:
        t_prev: ``T(i-1)``, ``(M, M)`` (grouped: its diagonal blocks ``(G, k, k)``).
        q_prev: the unsmoothed ``Q(i-1) = T(i-1)^T T(i-1)``, shaped as ``t_prev``.
        phi_y: ``Phi_y(i)``, the covariance of the whitened features (:func:`whitened_covariance_update`), shaped
            as ``t_prev``.
        mean_power: ``mean_m phi_x,m``, the (whole layer's) mean uncentred input power, a 0-dim tensor.
        gamma, delta, eps, c_rel, c_abs: the :class:`~whitenlayers.RecursiveConfig` fields of those
            names.

    Returns:
        A :class:`RecursiveStep`: ``T(i)``, ``Q(i)`` and the step's direction, power, gain and clamp.
    """
    one = t_prev.dim() == 2
    if one:  # one matrix: a stack of one
        t_prev, q_prev, phi_y = t_prev.unsqueeze(0), q_prev.unsqueeze(0), phi_y.unsqueeze(0)
    step, over = recursive_step_blocks(t_prev, q_prev, phi_y, mean_power, gamma=gamma, delta=delta, eps=eps,
                                       c_rel=c_rel, c_abs=c_abs)
    if one:
        step = RecursiveStep(step.transform[0], step.gram[0], step.direction[0], step.power[0], step.gain[0], False)
    return step._replace(clamped=bool(over.any()))


def whitened_covariance(t: Tensor, cov: Tensor) -> Tensor:
    """``T C T^T``: the covariance of the whitened features ``y = T x`` when ``x`` has covariance ``C``.

    Computed in the dtype of its arguments (no symmetrisation: callers that
    need the last bit of symmetry call :func:`symmetrize`).

    Args:
        t: the transform ``T``, ``(M, M)`` (or stacked ``(..., M, M)``).
        cov: the covariance ``C`` of the features, same shape.
    """
    return t @ cov @ t.transpose(-1, -2)


def whitened_covariance_update(
    phi_y_prev: Tensor, t_prev: Tensor, block_cov: Tensor, alpha: float, first: Union[bool, Sequence[bool]]
) -> Tensor:
    """``Phi_y(i)``: eq. ``vPhixi`` applied to the whitened features ``y = T(i-1) x`` of block ``i``.

    ``Phi_y(i) = alpha Phi_y(i-1) + (1 - alpha) T(i-1) C_block T(i-1)^T`` with
    ``C_block`` the block's covariance about the new mean (the new term of eq.
    ``vPhixi``); ``T(i-1) C_block T(i-1)^T`` alone for the first block.
    Two ``M x M x M`` products: the recursive rule's only ``O(M^3)`` cost,
    paid once per block, never per batch. In ``t_prev``'s dtype; symmetric.
    Stacked layers (a leading dimension): ``first`` one flag per layer.

    Args:
        phi_y_prev: ``Phi_y(i-1)``, ``(M, M)`` (ignored for a first block).
        t_prev: ``T(i-1)``, the transform in force during block ``i``.
        block_cov: the block's covariance about the new mean, ``(M, M)``.
        alpha: the :class:`~whitenlayers.RecursiveConfig` field ``alpha``, in ``[0, 1)``.
        first: ``True`` for the first folded block (no recursion); one flag per layer when stacked.
    """
    new = whitened_covariance(t_prev, block_cov.to(t_prev.dtype))
    return symmetrize(_first_or(first, new, lambda: new * (1.0 - alpha) + alpha * phi_y_prev.to(t_prev.dtype)))


def smooth_grad_transform(qs_prev: Tensor, q: Tensor, beta: float) -> Tensor:
    """``Q_s(i) = beta Q_s(i-1) + (1 - beta) Q(i)`` (paper section 3), in ``q``'s dtype.

    Symmetric to the last bit when ``Q_s(i-1)`` and ``Q(i)`` are: entries
    ``(i, j)`` and ``(j, i)`` are computed alike.

    Args:
        qs_prev: ``Q_s(i-1)``.
        q: ``Q(i)``, same shape.
        beta: the config field ``beta``, in ``[0, 1)`` (0: no smoothing).
    """
    return (qs_prev.to(q.dtype) * beta).add_(q, alpha=1.0 - beta)


def principal_subspace_grouped(phi_y: Tensor, *, c_rel: float, c_abs: float) -> Tensor:
    """:func:`principal_subspace` of each block of ``phi_y`` ``(G, k, k)``, all at once: ``(G, k)`` unit vectors.

    The column-alignment procedure of :func:`principal_subspace` (weights ``c_m / c_m'``) per block, vectorised
    over the groups (no loop, no host synchronisation); a block with no coherent set or a zero (or non-finite)
    result gives ``e_m'``.

    Args:
        phi_y: the diagonal blocks ``(G, k, k)`` of ``Phi_y``.
        c_rel, c_abs: the :class:`~whitenlayers.RecursiveConfig` fields of those names.
    """
    k = phi_y.shape[-1]
    # Few operations (a fold runs this once per stack of layers, each operation a dispatch of host time on a GPU)
    xi = torch.linalg.vector_norm(phi_y, dim=-2)  # column norms (G, k)
    mp = torch.argmax(xi, dim=-1, keepdim=True)  # (G, 1)
    col = torch.gather(phi_y, 2, mp.unsqueeze(-1).expand(-1, k, 1))  # phi[:, :, m'] as a column (G, k, 1)
    c = (phi_y.transpose(-1, -2) @ col).squeeze(-1)
    thresh = torch.clamp(torch.gather(xi, 1, mp) * c_rel * xi, min=c_abs)
    sel = c.abs() >= thresh
    count = sel.sum(-1, keepdim=True)
    # weights c_m / c_m' (c_m' = xi_m'^2 >= |c_m|); c_m' = 0 selects nothing unless c_abs = 0, and 0 / 0 = NaN then
    # gives a non-finite v: e_m' below
    w = torch.where(sel, c / torch.gather(c, 1, mp), 0.0)
    v = (phi_y @ w.unsqueeze(-1)).squeeze(-1) / torch.clamp(count, min=1)
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    # no coherent set: v = 0, so norm = 0; a non-finite phi_y: norm NaN or inf (isfinite would be four operations)
    ok = (norm > 0) & (norm < math.inf)
    # e_m' as a comparison (one_hot checks its indices' range on the host: two synchronisations per call)
    e = (torch.arange(k, device=mp.device) == mp).to(phi_y.dtype)
    return torch.where(ok, v / norm, e)  # where() takes e wherever v / norm is not a unit vector


def recursive_step_blocks(
    t_prev: Tensor,
    q_prev: Tensor,
    phi_y: Tensor,
    mean_power: Tensor,
    *,
    gamma: float,
    delta: float,
    eps: float,
    c_rel: float,
    c_abs: float,
) -> Tuple[RecursiveStep, Tensor]:
    """:func:`recursive_step` of each matrix of ``(B, k, k)`` stacks (the blocks of grouped layers, or whole
    layers stacked), with ``mean_power`` one value for all or one per matrix ``(B,)``; no host synchronisation.

    Returns the step (its ``clamped`` is ``False``: not read here) and which matrices' gains were clamped
    ``(B,)``, a bool tensor.

    Args:
        t_prev, q_prev, phi_y: stacks ``(B, k, k)`` of :func:`recursive_step`'s arguments.
        mean_power: one value ``()`` for all matrices, or one per matrix ``(B,)``.
        gamma, delta, eps, c_rel, c_abs: the :class:`~whitenlayers.RecursiveConfig` fields of those
            names.
    """
    v = principal_subspace_grouped(phi_y, c_rel=c_rel, c_abs=c_abs)  # (G, k)
    vv = v.unsqueeze(-1)  # columns (G, k, 1)
    lam_e = (vv.transpose(-1, -2) @ (phi_y @ vv)).view(-1)  # v^T Phi_y v, (G,)
    g = delta * mean_power / torch.clamp(lam_e, min=eps)
    over = g > 1.0
    g = torch.clamp(g, max=1.0)
    a = (torch.sqrt(g) - 1.0).view(-1, 1, 1)
    tt = t_prev.transpose(-1, -2) @ vv  # t_e = T^T v, (G, k, 1)
    # The formulas of recursive_step as batched rank-one updates (baddbmm of a column by a row) and in-place
    # diagonal adds: few operations per stack, no identity matrix.
    mix = gamma * (1.0 - gamma)
    av = vv * a
    t_new = torch.baddbmm(t_prev, av, tt.transpose(-1, -2), beta=gamma, alpha=gamma)
    t_new.diagonal(dim1=-2, dim2=-1).add_(1.0 - gamma)
    c2v = av * mix  # c2 v, c2 = gamma (1 - gamma) a
    c1 = (a + 2.0) * a * (gamma * gamma)
    q_new = q_prev * (gamma * gamma)
    q_new.add_(t_prev, alpha=mix).add_(t_prev.transpose(-1, -2), alpha=mix)
    q_new.baddbmm_(tt, torch.addcmul(c2v, c1, tt).transpose(-1, -2))  # c1 t t^T + c2 t v^T
    q_new.baddbmm_(c2v, tt.transpose(-1, -2))  # c2 v t^T
    q_new.diagonal(dim1=-2, dim2=-1).add_((1.0 - gamma) ** 2)
    return RecursiveStep(t_new, symmetrize(q_new), v, lam_e, g, False), over
