"""Pure tensor maths of feature whitening: no module state, no side effects.

Every function here takes tensors and returns tensors. The layers in
:mod:`whitenlayers.layers` own the state and call into this module, so each
formula of the paper lives in exactly one place and is tested on its own.

Conventions
-----------
* ``M`` is the number of input features (channels); covariances are ``(M, M)``.
* Grouped (block-diagonal) matrices, for ``G > 1`` groups of ``k = M / G``
  features, are stored as their ``(G, k, k)`` stack of diagonal blocks
  (group ``g`` holds features ``g k .. g k + k - 1``); vectors stay ``(M,)``.
  The functions that take a covariance or transform accept either form, and
  the ``(M, M)`` path is unchanged (section "Grouped features" below).
* Eigenvalues are sorted in **decreasing** order, as in the paper.
* ``docs/PAPER.md`` maps each equation of the paper to the function here.
  Formulas follow its list of departures from the printed paper where a
  printed formula contradicts a property the paper states (cited in the
  docstrings as "ERRATA n", the item number in that list).
"""
from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "BlockSummary",
    "symmetrize",
    "all_finite",
    "batch_moments",
    "batch_sums",
    "unshifted_accurate",
    "unshifted_accurate_each",
    "finite_each",
    "stats_samples",
    "summarize_block",
    "scatter_about",
    "block_power",
    "fold_mean",
    "block_covariance",
    "recursive_average",
    "fold_moments",
    "effective_rank",
    "normalized_rank",
    "whiteness",
    "whitening_gains",
    "evd_transform",
    "evd_transform_batched",
    "robust_eigh",
    "principal_subspace",
    "RecursiveStep",
    "recursive_step",
    "recursive_step_blocks",
    "whitened_covariance",
    "whitened_covariance_update",
    "smooth_grad_transform",
    "weight_mean_product",
    "transform_weight_grad",
    "block_shape",
    "block_identity",
    "block_diagonal",
    "grouped_batch_moments",
    "block_outer",
    "grouped_whitening_gains",
    "evd_transform_grouped",
    "evd_transform_grouped_batched",
    "principal_subspace_grouped",
    "recursive_step_grouped",
    "grouped_normalized_rank",
    "grouped_whiteness",
]


# --------------------------------------------------------------------------
# Moments
# --------------------------------------------------------------------------
class BlockSummary(NamedTuple):
    """The statistics of one block of samples, as needed by the fold.

    ``count`` samples (all batch elements and spatial positions), their
    ``mean`` ``(M,)``, the *centred* scatter ``scatter = sum (x - mean)(x - mean)^T``
    ``(M, M)`` and the uncentred power ``power = sum x**2`` ``(M,)``. All float64.
    """

    count: Tensor  # type: ignore[assignment]  # the field shadows tuple.count (a public name)
    mean: Tensor
    scatter: Tensor
    power: Tensor


def symmetrize(a: Tensor) -> Tensor:
    """``(a + a^T) / 2``: removes the rounding asymmetry before ``eigh``."""
    return torch.add(a, a.mT).mul_(0.5)  # 3x faster than 0.5 * (a + a.mT) for float32 on CPU


def all_finite(*tensors: Tensor) -> bool:
    """``True`` when every element of every tensor is finite.

    Fast path: a finite sum implies finite elements (NaN and Inf propagate
    through a sum), so the sums of all the tensors are added and checked once
    (``2 k + 2`` small ops and one host synchronisation for ``k`` tensors); only
    a sum that overflows although its terms are finite falls back to the
    elementwise check. One pass over memory in the common case.
    """
    total = None
    for t in tensors:
        total = t.sum() if total is None else total + t.sum()
    if total is None or bool(total * 0 == 0):  # x * 0 is NaN exactly for NaN and +-Inf
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def finite_each(*stacks: Tensor) -> Tensor:
    """:func:`all_finite` per stacked layer (a leading dimension ``L`` on every tensor), as a bool tensor ``(L,)``
    on the device: the sum of each layer's elements, NaN or Inf exactly when one is (or when the sum overflows,
    which counts as not finite). No host synchronisation."""
    total = stacks[0].flatten(1).sum(-1)
    for t in stacks[1:]:
        total = total + t.flatten(1).sum(-1)
    return total * 0 == 0  # x * 0 is NaN exactly for NaN and +-Inf


def _as_rows(x: Tensor) -> Optional[Tensor]:
    """``x`` as a ``(P, M)`` view (features last) when that needs no copy."""
    if x.dim() == 2:
        return x
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    return None


# CPU statistics: inputs of at least this many values take the unshifted product
# (see batch_moments), accepted when it loses at most log2(_UNSHIFTED_MAX_LOSS) bits.
_CPU_UNSHIFTED_MIN_ELEMENTS = 1 << 16
_UNSHIFTED_MAX_LOSS = 8.0


#: Sub-sampled statistics (``stats_fraction < 1``) keep at least this many rows (samples x positions) per
#: feature in every batch: the fraction thins out batches with rows to spare (a conv's many positions), never
#: the few rows of a linear layer or a small batch.
STATS_MIN_ROWS_PER_FEATURE = 16


def stats_samples(batch: int, positions: int, features: int, fraction: float) -> int:
    """How many leading samples of a batch the statistics use with ``stats_fraction=fraction``.

    ``ceil(fraction * batch)``, raised to the samples needed for
    ``STATS_MIN_ROWS_PER_FEATURE * features`` rows of ``positions`` each, at most ``batch``.

    Example:
        >>> stats_samples(128, 32 * 32, 16, 0.25)   # a 16-channel conv at 32x32: a quarter of the batch
        32
        >>> stats_samples(128, 8 * 8, 64, 0.25)     # 64 channels at 8x8: still a quarter
        32
        >>> stats_samples(128, 1, 512, 0.25)        # a 512-wide linear layer: every sample
        128
    """
    keep = max(math.ceil(fraction * batch), math.ceil(STATS_MIN_ROWS_PER_FEATURE * features / max(positions, 1)))
    return max(1, min(batch, keep))


def _unshifted_moments(x: Tensor, shift: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """Shifted sums from the *unshifted* product ``sum x x^T``, or ``None`` when that would be inaccurate.

    ``s2 = sum x x^T - k s^T - s k^T + n k k^T`` (``s = sum x``, ``k`` the shift),
    corrected in float64. Rounding in ``sum x x^T`` scales with ``sum x_m^2``
    instead of ``sum (x_m - k_m)^2``: the result is accepted only when every
    feature has ``sum x_m^2 <= _UNSHIFTED_MAX_LOSS * sum (x_m - k_m)^2``, i.e.
    the rounding error is at most that factor above the shifted product's (an
    error relative to ``sqrt(s2_ii s2_jj)``, off-diagonal entries included).
    Checking costs one host synchronisation, free on the CPU.
    """
    b = x.flatten(2)  # (B, M, H*W): a view for contiguous NC... inputs
    n = b.shape[0] * b.shape[2]
    g = torch.bmm(b, b.transpose(1, 2)).sum(0).to(torch.float64)
    s = b.sum(2).to(torch.float64).sum(0)  # float64 across samples (a float64-accumulating sum of x is 10x slower)
    k = shift.to(x.dtype).to(torch.float64)
    ks = torch.outer(k, s)
    s2 = g - ks - ks.t() + n * torch.outer(k, k)
    ok = torch.diagonal(g) <= _UNSHIFTED_MAX_LOSS * torch.diagonal(s2)
    if not bool(ok.all()) and bool(torch.isfinite(s2).all()):
        return None
    return (s - n * k).to(x.dtype), s2.to(x.dtype)


def batch_sums(x: Tensor, shift: Optional[Tensor] = None, groups: int = 1) -> Tuple[Tensor, Tensor]:
    """A batch's sums about ``shift``: ``s1 = sum (x - shift)`` ``(M,)`` and ``s2 = sum (x - shift)(x - shift)^T``.

    The layers' hot path (one call per training forward that gathers statistics): a subtraction (none when
    ``shift`` is ``None``: sums about 0), one product and two reductions, in ``x``'s dtype, no check and no host
    synchronisation. ``x`` is ``(B, M)`` or ``(B, M, *spatial)`` (features on dim 1); ``shift`` is shaped to
    broadcast against it (``(1, M, 1, ...)``). ``groups > 1``: the diagonal blocks ``(G, k, k)`` of ``s2`` only.

    About 0 the product's rounding scales with ``sum x_m^2`` instead of ``sum (x_m - mean_m)^2``: a layer sums
    unshifted only when its statistics allow it (:func:`unshifted_accurate`).
    """
    xs = x if shift is None else x - shift
    m = x.shape[1]
    rows = _as_rows(xs)
    if groups == 1:
        if rows is not None:  # (P, M): 2-D input or channels_last
            return rows.sum(0), rows.t() @ rows
        b = xs.flatten(2)  # (B, M, H*W): a view for contiguous NC... inputs; also valid for an empty batch
        return b.sum((0, 2)), torch.bmm(b, b.transpose(1, 2)).sum(0)
    k = m // groups
    if rows is not None:
        r = rows.reshape(-1, groups, k).transpose(0, 1)  # (G, P, k)
        return rows.sum(0), torch.matmul(r.transpose(1, 2), r)
    b = xs.reshape(xs.shape[0], groups, k, math.prod(xs.shape[2:]))  # (B, G, k, P); also for an empty batch
    return b.sum((0, 3)).reshape(m), torch.matmul(b, b.transpose(-1, -2)).sum(0)


def unshifted_accurate(block: "BlockSummary", max_mean2_var: float) -> bool:
    """Whether ``block``'s statistics allow summing the next block about 0: ``mean^2 <= max_mean2_var * var`` for
    every feature (then :func:`batch_sums` without a shift loses at most ``log2(1 + max_mean2_var)`` bits to the
    cancellation). From the count, mean and power alone (every rank has them after the fold's first collective,
    so every rank decides alike). One host synchronisation, once per block; :func:`unshifted_accurate_each` for
    stacked layers."""
    return bool(unshifted_accurate_each(block, max_mean2_var).all())


def unshifted_accurate_each(block: "BlockSummary", max_mean2_var: float) -> Tensor:
    """:func:`unshifted_accurate` of stacked blocks (a leading layer dimension): one flag per layer, on the
    device (no host synchronisation)."""
    # mean^2 <= r var  <=>  (1 + r) n mean^2 <= r power  (var = power / n - mean^2); False for NaN
    lhs = block.mean.square() * ((1.0 + max_mean2_var) * _per_layer(block.count, block.mean))
    return (lhs <= max_mean2_var * block.power).all(-1)


def batch_moments(x: Tensor, shift: Tensor, groups: int = 1) -> Tuple[Tensor, Tensor]:
    """Shifted first and second moments of one batch, summed over samples and positions.

    ``x`` is ``(B, M)`` or ``(B, M, *spatial)`` (features on dim 1). Returns
    ``s1 = sum (x - shift)`` ``(M,)`` and ``s2 = sum (x - shift)(x - shift)^T``
    ``(M, M)`` in ``x``'s dtype. Subtracting a ``shift`` close to the mean
    before the product keeps the covariance accurate when ``|mean| >> std``
    (the naive ``sum x x^T - n mu mu^T`` cancels catastrophically there).

    The ``(B, M, H*W)`` layout is used as is (a batched product, no permuted
    copy of the activation); a channels-last input is read as ``(B*H*W, M)``.

    On the CPU a large ``(B, M, *spatial)`` input first tries the unshifted
    product (``_unshifted_moments``): no shifted copy of the activation
    (on a CPU that copy, a fresh activation-sized allocation, costs as much as
    the product itself), and the shift applied to the ``M x M`` result; it is
    accepted when the cancellation costs at most 3 bits (``mean^2 <= 7 var``
    per feature, which post-ReLU activations satisfy), otherwise the shifted
    product below is computed. Measured in ``benchmarks/RESULTS.md``.

    ``groups > 1``: the block-diagonal second moments ``(G, k, k)`` only
    (:func:`grouped_batch_moments`), never the ``M x M`` product.
    """
    if groups != 1:
        return grouped_batch_moments(x, shift, groups)
    m = x.shape[1]
    if (x.device.type == "cpu" and x.dim() > 2 and x.numel() >= _CPU_UNSHIFTED_MIN_ELEMENTS
            and _as_rows(x) is None and not (torch.is_grad_enabled() and x.requires_grad)):
        res = _unshifted_moments(x, shift)
        if res is not None:
            return res
    return batch_sums(x, shift.to(x.dtype).view((1, m) + (1,) * (x.dim() - 2)))


def _per_layer(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (one value per stacked layer, shape ``(L,)``, or a scalar) shaped to broadcast against ``like``
    (``(L, ...)``, or unstacked)."""
    return t.reshape(tuple(t.shape) + (1,) * (like.dim() - t.dim()))


def _outer(a: Tensor, b: Tensor, like: Tensor) -> Tensor:
    """``outer(a, b)`` as ``like`` holds matrices: ``(..., M, M)``, or the diagonal blocks ``(..., G, k, k)`` of a
    grouped one. Elementwise products: entry ``(i, j)`` is ``a_i b_j`` whatever the stacking, so a stack of layers
    and each layer alone round alike."""
    a, b = a.reshape(like.shape[:-1]), b.reshape(like.shape[:-1])
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def _first_or(first: Union[bool, Sequence[bool]], new: Tensor, recursed: Callable[[], Tensor]) -> Tensor:
    """``new`` where ``first`` (no recursion: the first block), else ``recursed()``; ``first`` is one flag or one per
    stacked layer."""
    if isinstance(first, bool):
        return new if first else recursed()
    if all(first):
        return new
    out = recursed()
    if not any(first):
        return out
    mask = torch.tensor(list(first), dtype=torch.bool, device=new.device)
    return torch.where(_per_layer(mask, new), new, out)


def summarize_block(count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor) -> BlockSummary:
    """Turn shifted sums into a :class:`BlockSummary` (mean and centred scatter).

    The scatter about the block's own mean (:func:`scatter_about`) is exact
    algebra; it is accurate because ``s1`` is small when ``shift`` is close to
    the block mean. A grouped ``s2`` ``(G, k, k)`` gives a grouped ``scatter``.
    Stacked blocks (a leading layer dimension ``L`` on every argument, ``count``
    ``(L,)``) give stacked summaries, each equal to its block's alone.
    """
    n = count.to(torch.float64)
    shift = shift.to(torch.float64)
    mean = shift + s1.to(torch.float64) / _per_layer(torch.clamp(n, min=1.0), s1)
    scatter = scatter_about(count, shift, s1, s2, mean)
    return BlockSummary(n, mean, symmetrize(scatter), block_power(count, shift, s1, s2))


def block_power(count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor) -> Tensor:
    """``sum x**2`` per feature from the shifted sums (see :func:`scatter_about`). float64."""
    n, shift, s1 = count.to(torch.float64), shift.to(torch.float64), s1.to(torch.float64)
    # sum x^2 = sum (x - K)^2 + 2 K s1 + n K^2
    diag = torch.diagonal(s2, dim1=-2, dim2=-1).reshape(shift.shape).to(torch.float64)
    return diag + 2.0 * shift * s1 + _per_layer(n, shift) * shift * shift


def scatter_about(count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor, center: Tensor, *,
                  inplace: bool = False) -> Tensor:
    """The scatter ``sum (x - center)(x - center)^T`` of a block's samples. float64.

    From the shifted sums ``s1 = sum (x - shift)``, ``s2 = sum (x - shift)(x - shift)^T``
    over ``count`` samples: with ``e = center - shift`` and ``u = s1 - count e / 2``,
    ``scatter = s2 - (u e^T + e u^T)`` (symmetric up to the rounding of ``s2``:
    :func:`symmetrize` it). A grouped ``s2`` ``(G, k, k)`` gives the grouped
    scatter; stacked layers (a leading dimension ``L``, ``count`` ``(L,)``) give
    stacked scatters. ``inplace``: written into ``s2`` (float64), which is
    returned. Under ``torch.distributed`` the ranks' scatters about the *global*
    mean sum to the global batch's.
    """
    n = _per_layer(count.to(torch.float64), s1)
    e = center.to(torch.float64) - shift.to(torch.float64)
    u = s1.to(torch.float64) - (0.5 * n) * e
    ue = _outer(u, e, s2)
    both = ue + ue.mT  # u e^T + e u^T, symmetric to the last bit
    if inplace:
        return s2.sub_(both)
    return s2.to(torch.float64) - both


def fold_mean(mean_prev: Tensor, block: BlockSummary, alpha: float, first: Union[bool, Sequence[bool]]) -> Tensor:
    """Eq. ``vmuxi``: ``mu(i) = alpha mu(i-1) + (1 - alpha) mean_block``; eq. ``vmuxnz`` when ``first``.

    Stacked layers: ``first`` one flag per layer."""
    mean = block.mean.to(torch.float64)
    return _first_or(first, mean, lambda: alpha * mean_prev.to(torch.float64) + (1.0 - alpha) * mean)


def block_covariance(block: BlockSummary, mu: Tensor) -> Tensor:
    """``1/n sum (x - mu)(x - mu)^T`` over the block's samples, centred on ``mu`` (not the block mean).

    From the block's own centred scatter by the parallel-axis identity
    ``sum (x - mu)(x - mu)^T = scatter + n (mean - mu)(mean - mu)^T``. float64.
    Symmetric to the last bit when ``scatter`` is (as :func:`summarize_block` makes it):
    every operation here treats entries ``(i, j)`` and ``(j, i)`` alike. Stacked layers alike.
    """
    scatter = block.scatter.to(torch.float64)
    n = _per_layer(torch.clamp(block.count.to(torch.float64), min=1.0), scatter)
    d = block.mean.to(torch.float64) - mu.to(torch.float64)
    return scatter / n + _outer(d, d, scatter)


def recursive_average(prev: Tensor, new: Tensor, alpha: float, first: Union[bool, Sequence[bool]]) -> Tensor:
    """``alpha prev + (1 - alpha) new``, or ``new`` for the first block (no recursion). float64.

    Stacked layers: ``first`` one flag per layer."""
    new = new.to(torch.float64)
    return _first_or(first, new, lambda: alpha * prev.to(torch.float64) + (1.0 - alpha) * new)


def fold_moments(
    mean_prev: Tensor,
    cov_prev: Tensor,
    block: BlockSummary,
    alpha: float,
    first: Union[bool, Sequence[bool]],
    *,
    return_block_cov: bool = False,
) -> Union[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]]:
    """One block of the moment recursion: eqs. ``vmuxi``/``vPhixi`` (``vmuxnz``/``vPhixnz`` when ``first``).

    ``mu(i) = alpha mu(i-1) + (1 - alpha) mean_block`` and
    ``Phi(i) = alpha Phi(i-1) + (1 - alpha) / n * sum (x - mu(i))(x - mu(i))^T``,
    the block's samples centred on the *new* mean ``mu(i)`` (ERRATA 7). For the
    first block there is no recursion (``alpha`` is ignored). float64.
    Symmetric to the last bit when ``cov_prev`` and the block's scatter are.
    With ``return_block_cov`` also returns the block's covariance about ``mu(i)``
    (the new term of eq. ``vPhixi``), which the recursive rule needs.

    Stacked layers (a leading dimension ``L`` on every tensor, ``first`` one
    flag per layer): the fold of many layers of one shape at once, each equal to
    its own fold to the last bit (elementwise operations only).
    """
    mu = fold_mean(mean_prev, block, alpha, first)
    block_cov = block_covariance(block, mu)
    cov = recursive_average(cov_prev, block_cov, alpha, first)
    return (mu, cov, block_cov) if return_block_cov else (mu, cov)


# --------------------------------------------------------------------------
# Diagnostics: rank and whiteness
# --------------------------------------------------------------------------
def _normalized_spectrum(eigenvalues: Tensor) -> Tensor:
    lam = torch.clamp(eigenvalues, min=0.0)
    total = lam.sum(-1, keepdim=True)
    return torch.where(total > 0, lam / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(lam))


def effective_rank(eigenvalues: Tensor) -> Tensor:
    """Effective rank ``M_s = exp(-sum lam_m log lam_m)`` of a spectrum (ERRATA 1).

    ``lam_m = lambda_m / sum(lambda)`` after clamping negative eigenvalues at 0,
    with ``0 log 0 := 0``. Equal eigenvalues give ``M``, a single non-zero one
    gives 1. An all-zero spectrum gives 1 by convention (nothing to whiten).
    Works on batches of spectra (last dim).

    >>> float(effective_rank(torch.ones(8)))
    8.0
    >>> float(effective_rank(torch.tensor([3.0, 0.0, 0.0])))
    1.0
    """
    p = _normalized_spectrum(eigenvalues.to(torch.float64))
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))
    ent = -plogp.sum(-1)
    rank = torch.exp(ent)
    allzero = p.sum(-1) == 0
    return torch.where(allzero, torch.ones_like(rank), rank).to(eigenvalues.dtype)


def normalized_rank(cov: Tensor) -> Tensor:
    """``kappa = M_s / M`` of a covariance matrix (unrounded ``M_s``, ERRATA 1).

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

    >>> float(whiteness(torch.diag(torch.tensor([1.0, 5.0, 2.0]))))
    1.0
    >>> round(float(whiteness(torch.ones(4, 4))), 6)
    0.25
    """
    c = cov.to(torch.float64)
    m = c.shape[-1]
    d = torch.diagonal(c, dim1=-2, dim2=-1)
    pos = d > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, d, torch.ones_like(d)), torch.zeros_like(d))
    corr2 = c * c * inv.unsqueeze(-1) * inv.unsqueeze(-2)
    eye = torch.eye(m, dtype=c.dtype, device=c.device)
    corr2 = torch.where(eye.bool(), eye.expand_as(corr2), corr2)
    return (m / corr2.sum((-1, -2))).to(cov.dtype)


# --------------------------------------------------------------------------
# EVD transform
# --------------------------------------------------------------------------
def robust_eigh(cov: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """``eigh`` of a symmetrised ``cov`` with eigenvalues in decreasing order.

    Returns ``None`` when ``cov`` is not finite or when the decomposition fails
    or returns non-finite values in both the working precision (at least
    float32) and float64. Never raises for numerical reasons.
    """
    if not all_finite(cov):
        return None
    work = cov.dtype if cov.dtype in (torch.float32, torch.float64) else torch.float32
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


def _zca_from_eig(lam: Tensor, vec: Tensor, eps: float, gmax: float, gains: str) -> Tuple[Tensor, Tensor]:
    """``T = V diag(g)^(1/2) V^T`` and ``Q = V diag(g) V^T`` from decreasing eigenpairs (batched on leading dims)."""
    g = whitening_gains(lam, eps=eps, gmax=gmax, gains=gains).unsqueeze(-2)
    vt = vec.transpose(-1, -2)
    return symmetrize((vec * g.sqrt()) @ vt), symmetrize((vec * g) @ vt)


def evd_transform(
    cov: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> Optional[Tuple[Tensor, Tensor]]:
    """ZCA whitening matrix ``T = V diag(g)^(1/2) V^T`` and ``Q = T^T T = V diag(g) V^T``.

    Returns ``None`` when the eigendecomposition fails (see :func:`robust_eigh`);
    the caller then keeps its previous transform. Results are in ``cov.dtype``.
    """
    dec = robust_eigh(cov)
    if dec is None:
        return None
    t, q = _zca_from_eig(*dec, eps, gmax, gains)
    if not all_finite(t, q):
        return None
    return t.to(cov.dtype), q.to(cov.dtype)


def evd_transform_batched(
    covs: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """:func:`evd_transform` of each matrix of a ``(k, M, M)`` stack, with one batched ``eigh``.

    Same results as ``[evd_transform(c, ...) for c in covs]`` (the batched
    kernels compute each matrix as the single-matrix ones do), at a fraction
    of the per-call overhead when many small layers fold together (the fold of
    a whole ResNet, ``benchmarks/fold_cost.py``). Robust per matrix: a
    non-finite matrix gives ``None``; when the batched ``eigh`` raises, or
    returns non-finite values for some matrices, those matrices go through
    :func:`evd_transform` one by one (working precision, then float64).
    """
    k = covs.shape[0]
    out: List[Optional[Tuple[Tensor, Tensor]]] = [None] * k
    if k == 0:
        return out
    work = covs.dtype if covs.dtype in (torch.float32, torch.float64) else torch.float32
    idx = [i for i, ok in enumerate(torch.isfinite(covs).flatten(1).all(1).tolist()) if ok]
    retry: List[int] = []
    if idx:
        sub = covs[idx] if len(idx) < k else covs
        try:
            lam, vec = torch.linalg.eigh(symmetrize(sub.to(work)))
        except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
            lam = vec = None
        if lam is None:
            retry = idx
        else:
            assert vec is not None  # set with lam
            ok = (torch.isfinite(lam).all(-1) & torch.isfinite(vec).flatten(1).all(1)).tolist()
            good = [j for j, o in enumerate(ok) if o]
            retry = [idx[j] for j, o in enumerate(ok) if not o]
            if good:
                if len(good) < len(idx):
                    lam, vec = lam[good], vec[good]
                t, q = _zca_from_eig(lam.flip(-1), vec.flip(-1), eps, gmax, gains)
                fin = (torch.isfinite(t).flatten(1).all(1) & torch.isfinite(q).flatten(1).all(1)).tolist()
                for pos, (j, f) in enumerate(zip(good, fin)):
                    if f:
                        out[idx[j]] = (t[pos].to(covs.dtype), q[pos].to(covs.dtype))
    for i in retry:
        out[i] = evd_transform(covs[i], eps=eps, gmax=gmax, gains=gains)
    return out


# --------------------------------------------------------------------------
# Recursive transform (paper section 4)
# --------------------------------------------------------------------------
def principal_subspace(phi_y: Tensor, *, c_rel: float, c_abs: float) -> Tensor:
    """High-power direction ``v_e`` of ``phi_y`` by column alignment (paper section 4.2).

    Column norms ``xi``; the strongest column ``m'``; inner products
    ``c = Phi^T Phi e_m'`` (one matrix-vector product); the coherent set
    ``|c_m| >= max(c_rel xi_m' xi_m, c_abs)``; the columns of that set divided
    by ``c_m`` (which aligns their signs), averaged and normalised.
    Cost: ``O(M^2)`` (a norm per column and one matrix-vector product).
    ``m'`` itself always belongs to the set (``c_m' = xi_m'^2``) unless
    ``phi_y`` is zero, in which case ``e_0`` is returned.

    This is the printed procedure, meant for the high signal-to-noise case:
    the ``1 / c_m`` weights make a column whose coherent part is weak (a
    dominant direction with a near-zero entry ``u_m``) contribute mostly
    noise. Measured on ``ratio * u u^T + I`` with ``M = 24`` and 50 random
    ``u``: median ``|cos(v_e, u)|`` 0.995 at ratio 100 and 0.99994 at ratio
    1000, but the worst case stays near 0.6 for both. A wrong direction costs
    one step; the leakage undoes it.
    """
    xi = torch.linalg.vector_norm(phi_y, dim=0)
    mp = int(torch.argmax(xi))
    col = phi_y[:, mp]
    c = phi_y.t() @ col
    thresh = torch.clamp(c_rel * xi[mp] * xi, min=c_abs)
    sel = c.abs() >= thresh
    if not bool(sel.any()):
        v = torch.zeros_like(col)
        v[mp] = 1.0
        return v
    cs = torch.where(sel, c, torch.ones_like(c))
    w = torch.where(sel, 1.0 / cs, torch.zeros_like(c))
    v = phi_y @ w / sel.sum()
    norm = torch.linalg.vector_norm(v)
    if not bool(norm > 0) or not bool(torch.isfinite(norm)):
        v = torch.zeros_like(col)
        v[mp] = 1.0
        return v
    return v / norm


class RecursiveStep(NamedTuple):
    """Result of :func:`recursive_step`: new ``T``, new unsmoothed ``Q`` and the step's quantities."""

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

    Only matrix-vector products and outer products: no EVD, no ``M^3`` product.
    """
    v = principal_subspace(phi_y, c_rel=c_rel, c_abs=c_abs)
    lam_e = v @ (phi_y @ v)
    g = delta * mean_power / torch.clamp(lam_e, min=eps)
    clamped = bool(g > 1.0)
    g = torch.clamp(g, max=1.0)
    a = torch.sqrt(g) - 1.0
    t_vec = t_prev.t() @ v
    a_f = float(a)
    # The same formulas as in the docstring, written as fused rank-one updates (torch.addr) and in-place
    # diagonal adds: a handful of passes over M x M memory and no M x M identity.
    t_new = torch.addr(t_prev, v, t_vec, beta=gamma, alpha=gamma * a_f)
    t_new.diagonal().add_(1.0 - gamma)
    c1 = gamma * gamma * a_f * (a_f + 2.0)
    c2 = gamma * (1.0 - gamma) * a_f
    mix = gamma * (1.0 - gamma)
    q_new = q_prev.mul(gamma * gamma).add_(t_prev, alpha=mix).add_(t_prev.t(), alpha=mix)
    q_new.addr_(t_vec, c1 * t_vec + c2 * v).addr_(v, t_vec, alpha=c2)
    q_new.diagonal().add_((1.0 - gamma) ** 2)
    return RecursiveStep(t_new, symmetrize(q_new), v, lam_e, g, clamped)


def whitened_covariance(t: Tensor, cov: Tensor) -> Tensor:
    """``T C T^T``: the covariance of the whitened features ``y = T x`` when ``x`` has covariance ``C``.

    Computed in the dtype of its arguments (no symmetrisation: callers that
    need the last bit of symmetry call :func:`symmetrize`).
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
    """
    new = whitened_covariance(t_prev, block_cov.to(t_prev.dtype))
    return symmetrize(_first_or(first, new, lambda: new * (1.0 - alpha) + alpha * phi_y_prev.to(t_prev.dtype)))


def smooth_grad_transform(qs_prev: Tensor, q: Tensor, beta: float) -> Tensor:
    """``Q_s(i) = beta Q_s(i-1) + (1 - beta) Q(i)`` (paper section 3), in ``q``'s dtype.

    Symmetric to the last bit when ``Q_s(i-1)`` and ``Q(i)`` are: entries
    ``(i, j)`` and ``(j, i)`` are computed alike.
    """
    return (qs_prev.to(q.dtype) * beta).add_(q, alpha=1.0 - beta)


def weight_mean_product(weight: Tensor, mean: Tensor) -> Tensor:
    """``sum_k W_k mean`` per output feature: kernel taps and input features summed.

    ``weight`` is ``(S, M)`` or ``(S, M, *kernel)``, ``mean`` ``(M,)``. It is the
    centring offset of a layer that centres on ``mean``, and, applied to a change
    of the mean, the bias compensation of eq. ``vtb_corr`` (ERRATA 8).

    A grouped convolution's weight ``(S, M/G, *kernel)`` (fewer input features
    than ``mean`` has) is read group by group: the ``S/G`` outputs of group
    ``g`` see its ``M/G`` features of ``mean``.
    """
    w = weight if weight.dim() == 2 else weight.reshape(weight.shape[0], weight.shape[1], -1).sum(-1)
    if w.shape[1] != mean.shape[0]:  # grouped convolution
        s, k = w.shape
        g = mean.shape[0] // k
        return (w.view(g, s // g, k) @ mean.to(w.dtype).view(g, k, 1)).reshape(s)
    return w @ mean.to(w.dtype)


# --------------------------------------------------------------------------
# Gradient transform
# --------------------------------------------------------------------------
#: On a CPU a kernel's weight gradient is transformed by one batched product up to this many input features, by
#: one transposed product above (2-core Xeon, 3x3 kernels, min of 3 rounds: batched/transposed 0.63x at 16, 0.57x
#: at 32, 0.85x at 64, 1.18x at 128, 1.44x at 256 features). On a GPU always the batched product (one kernel).
_CPU_BMM_MAX_FEATURES = 64


def transform_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """Right-multiply a weight gradient by ``Q`` on the input-feature axis (dim 1).

    ``grad`` is ``(S, M)`` (linear) or ``(S, M, *kernel)`` (convolution, one
    ``S x M`` matrix per kernel tap): ``out[s, j, k] = sum_i grad[s, i, k] Q[i, j]``.
    A grouped ``Q`` ``(G, k, k)`` goes with a grouped convolution's gradient
    ``(S, k, *kernel)``: the ``S/G`` output channels of group ``g`` are
    right-multiplied by ``Q_g`` (``_grouped_weight_grad``).
    """
    if q.dim() == 3:
        return _grouped_weight_grad(grad, q)
    q = q.to(grad.dtype)
    if grad.dim() == 2:
        return grad @ q
    s, m = grad.shape[:2]
    if grad[0, 0].numel() == 1 and grad.is_contiguous():  # a 1x1 kernel: one (S x M) @ (M x M) product
        return (grad.view(s, m) @ q).view(grad.shape)
    if grad.is_contiguous() and (grad.device.type != "cpu" or m <= _CPU_BMM_MAX_FEATURES):
        # One batched product, Q^T @ grad[s] for each output feature s (Q^T broadcast, not copied): one kernel,
        # the result in the gradient's own layout.
        return torch.bmm(q.t().expand(s, m, m), grad.view(s, m, -1)).view(grad.shape)
    # One (M x M) @ (M x S*K) product on the input-feature axis moved first (a copy of the small weight gradient),
    # written back in the gradient's layout: three ops, but on a CPU faster than the batched product for wide
    # layers.
    g = grad.transpose(0, 1).contiguous().view(m, -1)
    out = (q.t() @ g).view((m, s) + tuple(grad.shape[2:])).transpose(0, 1)
    if grad.is_contiguous():
        return out.contiguous()
    return torch.empty_like(grad).copy_(out)  # the gradient's own layout (channels_last)


# --------------------------------------------------------------------------
# Grouped features: block-diagonal statistics and transforms
# --------------------------------------------------------------------------
# A convolution with ``groups=G`` sees its ``M`` input channels as ``G`` groups
# of ``k = M / G``, each group feeding only its own ``S / G`` outputs. Its
# whitening is block-diagonal: one ``k x k`` block per group, stored as a
# ``(G, k, k)`` stack (group ``g`` holds features ``g k .. g k + k - 1``), so a
# depthwise layer (``k = 1``) keeps ``G`` numbers instead of an ``M x M`` matrix.
# ``T`` is defined as the ungrouped rule applied to the block-diagonal part of
# ``Phi_x``: the EVD gains (ERRATA 5) are normalised by the mean eigenvalue of
# the whole layer and the rank cut uses the layer's effective rank (ERRATA 1),
# exactly as :func:`evd_transform` of the dense block-diagonal matrix would
# (whose spectrum is the union of the blocks' spectra); the eigendecomposition
# itself is batched over the groups. The recursive rule takes one rank-one step
# per group, all groups at once.
def block_shape(m: int, groups: int = 1) -> Tuple[int, ...]:
    """Shape of an ``M x M`` matrix kept per group: ``(M, M)`` for one group, else ``(G, M/G, M/G)``."""
    if groups == 1:
        return (m, m)
    return (groups, m // groups, m // groups)


def block_identity(m: int, groups: int = 1, *, device=None, dtype=None) -> Tensor:
    """The identity in the storage of :func:`block_shape`."""
    if groups == 1:
        return torch.eye(m, device=device, dtype=dtype)
    k = m // groups
    return torch.eye(k, device=device, dtype=dtype).expand(groups, k, k).clone()


def block_diagonal(mat: Tensor) -> Tensor:
    """The dense ``(M, M)`` matrix of a ``(G, k, k)`` stack of blocks (an ``(M, M)`` matrix is returned as is)."""
    if mat.dim() == 2:
        return mat
    return torch.block_diag(*mat.unbind(0))


def block_outer(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """The diagonal blocks of ``outer(a, b)`` for ``(M,)`` vectors: ``(G, k, k)``."""
    k = a.shape[0] // groups
    return a.view(groups, k, 1) * b.view(groups, 1, k)


def _grouped_unshifted_moments(x: Tensor, shift: Tensor, groups: int) -> Optional[Tuple[Tensor, Tensor]]:
    """:func:`_unshifted_moments` per group (same acceptance test), or ``None``."""
    m = x.shape[1]
    k = m // groups
    b = x.reshape(x.shape[0], groups, k, -1)  # (B, G, k, P): a view for contiguous NC... inputs
    n = b.shape[0] * b.shape[3]
    g = torch.matmul(b, b.transpose(-1, -2)).sum(0).to(torch.float64)
    s = b.sum(3).to(torch.float64).sum(0).reshape(m)
    kk = shift.to(x.dtype).to(torch.float64)
    ks = block_outer(kk, s, groups)
    s2 = g - ks - ks.transpose(-1, -2) + n * block_outer(kk, kk, groups)
    diag_g = torch.diagonal(g, dim1=-2, dim2=-1)
    ok = diag_g <= _UNSHIFTED_MAX_LOSS * torch.diagonal(s2, dim1=-2, dim2=-1)
    if not bool(ok.all()) and bool(torch.isfinite(s2).all()):
        return None
    return (s - n * kk).to(x.dtype), s2.to(x.dtype)


def grouped_batch_moments(x: Tensor, shift: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """:func:`batch_moments` of a grouped layer: ``s1`` ``(M,)`` and the diagonal blocks of ``s2``, ``(G, k, k)``.

    Costs ``M k`` multiply-adds per sample and position (``1/G`` of the
    ungrouped product): a batched product over the ``B x G`` ``(k, H*W)``
    slices (for depthwise, ``k = 1``, one dot product per sample and channel),
    unshifted on the CPU when that loses at most 3 bits (as
    :func:`batch_moments`; measured on a ``(64, 192, 32, 32)`` depthwise input,
    one thread: 4.6 ms, against 31 ms with the shifted copy, 90 ms for
    ``torch.var_mean`` and 84 ms for the depthwise convolution's forward).
    """
    m = x.shape[1]
    if (x.device.type == "cpu" and x.dim() > 2 and x.numel() >= _CPU_UNSHIFTED_MIN_ELEMENTS
            and _as_rows(x) is None and not (torch.is_grad_enabled() and x.requires_grad)):
        res = _grouped_unshifted_moments(x, shift, groups)
        if res is not None:
            return res
    return batch_sums(x, shift.to(x.dtype).view((1, m) + (1,) * (x.dim() - 2)), groups)


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
    """
    lam = torch.clamp(eigenvalues, min=0.0)
    if gains == "zca":
        return 1.0 / torch.clamp(lam, min=eps)
    if gains != "practical":
        raise ValueError(f"gains must be 'practical' or 'zca', but got gains={gains!r}")
    flat = lam.reshape(-1)
    m = flat.shape[0]
    ms = torch.clamp(torch.round(effective_rank(flat)), 1, m)
    g = torch.clamp(flat.mean() / torch.clamp(flat, min=eps), max=gmax)
    order = torch.argsort(flat, descending=True, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(m, device=flat.device)
    keep = position < ms
    return torch.where(keep, g, torch.ones_like(g)).view_as(lam)


def _grouped_eigh(covs: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """Batched ``eigh`` of ``(G, k, k)`` blocks, decreasing eigenvalues; failed blocks retried one by one
    (:func:`robust_eigh`: working precision, then float64). ``None`` when some block fails for good."""
    if not all_finite(covs):
        return None
    work = covs.dtype if covs.dtype in (torch.float32, torch.float64) else torch.float32
    k = covs.shape[-1]
    if k == 1:  # depthwise: the eigenvalue is the variance, the eigenvector 1
        c = covs.to(work)
        return c[:, :, 0], torch.ones_like(c)
    try:
        lam, vec = torch.linalg.eigh(symmetrize(covs.to(work)))
        bad = (~(torch.isfinite(lam).all(-1) & torch.isfinite(vec).flatten(1).all(1))).nonzero().flatten().tolist()
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        lam = torch.empty(covs.shape[:2], dtype=work, device=covs.device)
        vec = torch.empty(covs.shape, dtype=work, device=covs.device)
        bad = list(range(covs.shape[0]))
    lam, vec = lam.flip(-1), vec.flip(-1)
    for i in bad:
        dec = robust_eigh(covs[i])
        if dec is None:
            return None
        lam[i], vec[i] = dec[0].to(work), dec[1].to(work)
    return lam, vec


def _zca_grouped(lam: Tensor, vec: Tensor, eps: float, gmax: float, gains: str) -> Tuple[Tensor, Tensor]:
    """``T_g = V_g diag(g_g)^(1/2) V_g^T`` and ``Q_g = V_g diag(g_g) V_g^T`` per block, layer-wide gains."""
    g = grouped_whitening_gains(lam, eps=eps, gmax=gmax, gains=gains)
    if lam.shape[-1] == 1:
        return g.sqrt().unsqueeze(-1), g.unsqueeze(-1)
    gg = g.unsqueeze(-2)
    vt = vec.transpose(-1, -2)
    return symmetrize((vec * gg.sqrt()) @ vt), symmetrize((vec * gg) @ vt)


def evd_transform_grouped(
    covs: Tensor, *, eps: float, gmax: float, gains: str = "practical"
) -> Optional[Tuple[Tensor, Tensor]]:
    """:func:`evd_transform` of the block-diagonal matrix with blocks ``covs`` ``(G, k, k)``: ``T`` and ``Q`` as blocks.

    Equal (to float tolerance) to the diagonal blocks of
    ``evd_transform(block_diagonal(covs))``, from one batched ``eigh`` of the
    ``k x k`` blocks (none at all for ``k = 1``). ``None`` when a block's
    eigendecomposition fails in float64 too. Results in ``covs.dtype``.
    """
    dec = _grouped_eigh(covs)
    if dec is None:
        return None
    t, q = _zca_grouped(*dec, eps, gmax, gains)
    if not all_finite(t, q):
        return None
    return t.to(covs.dtype), q.to(covs.dtype)


def evd_transform_grouped_batched(
    covs: Sequence[Tensor], *, eps: float, gmax: float, gains: str = "practical"
) -> List[Optional[Tuple[Tensor, Tensor]]]:
    """:func:`evd_transform_grouped` of several layers whose blocks have one size, with one batched ``eigh``.

    ``covs`` holds one ``(G_i, k, k)`` stack per layer (``k`` shared, ``G_i``
    free). The gains are computed per layer (each layer's own mean eigenvalue
    and rank). A layer with non-finite blocks gives ``None``; a layer whose
    blocks the batched ``eigh`` got wrong goes through
    :func:`evd_transform_grouped` alone.
    """
    out: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(covs)
    if not covs:
        return out
    k = covs[0].shape[-1]
    finite = [i for i, c in enumerate(covs) if all_finite(c)]
    if k == 1 or len(finite) < 2:
        return [evd_transform_grouped(c, eps=eps, gmax=gmax, gains=gains) if i in finite else None
                for i, c in enumerate(covs)]
    dtype = covs[finite[0]].dtype
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    try:
        lam, vec = torch.linalg.eigh(symmetrize(torch.cat([covs[i].to(work) for i in finite])))
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        lam = vec = None
    pos = 0
    for i in finite:
        g = covs[i].shape[0]
        res = None
        if lam is not None:
            assert vec is not None  # set with lam
            li, vi = lam[pos:pos + g].flip(-1), vec[pos:pos + g].flip(-1)
            if all_finite(li, vi):
                t, q = _zca_grouped(li, vi, eps, gmax, gains)
                if all_finite(t, q):
                    res = (t.to(covs[i].dtype), q.to(covs[i].dtype))
        pos += g
        out[i] = res if res is not None else evd_transform_grouped(covs[i], eps=eps, gmax=gmax, gains=gains)
    return out


def principal_subspace_grouped(phi_y: Tensor, *, c_rel: float, c_abs: float) -> Tensor:
    """:func:`principal_subspace` of each block of ``phi_y`` ``(G, k, k)``, all at once: ``(G, k)`` unit vectors.

    The same column-alignment procedure per block, vectorised over the groups
    (no loop, no host synchronisation); a block with no coherent set or a zero
    result gives ``e_m'`` as in the single-matrix version.
    """
    g, k = phi_y.shape[0], phi_y.shape[-1]
    xi = torch.linalg.vector_norm(phi_y, dim=-2)  # column norms (G, k)
    mp = torch.argmax(xi, dim=-1)  # (G,)
    col = torch.gather(phi_y, 2, mp.view(g, 1, 1).expand(g, k, 1)).squeeze(-1)  # phi[:, :, m']
    c = (phi_y.transpose(-1, -2) @ col.unsqueeze(-1)).squeeze(-1)
    thresh = torch.clamp(c_rel * torch.gather(xi, 1, mp.view(g, 1)) * xi, min=c_abs)
    sel = c.abs() >= thresh
    w = torch.where(sel, 1.0 / torch.where(sel, c, torch.ones_like(c)), torch.zeros_like(c))
    count = sel.sum(-1, keepdim=True)
    v = (phi_y @ w.unsqueeze(-1)).squeeze(-1) / torch.clamp(count, min=1).to(phi_y.dtype)
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    ok = (count > 0) & (norm > 0) & torch.isfinite(norm)
    e = torch.nn.functional.one_hot(mp, k).to(phi_y.dtype)
    return torch.where(ok, v / torch.where(ok, norm, torch.ones_like(norm)), e)


def recursive_step_grouped(
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
    """:func:`recursive_step` of every block of a block-diagonal ``T`` at once (``(G, k, k)`` stacks).

    Each group ``g`` takes its own rank-one power reduction along its own
    :func:`principal_subspace_grouped` direction ``v_g``, with the target power
    ``delta * mean_power`` (``mean_power`` is the whole layer's mean uncentred
    input power, as for an ungrouped layer), the clamp ``g_e <= 1`` per group
    and the leakage ``gamma``. ``direction``, ``power`` and ``gain`` are per
    group; ``clamped`` is ``True`` when any group's gain was clamped.
    ``O(G k^2) = O(M k)`` work in a few batched operations, no Python loop.
    """
    step, over = recursive_step_blocks(t_prev, q_prev, phi_y, mean_power, gamma=gamma, delta=delta, eps=eps,
                                       c_rel=c_rel, c_abs=c_abs)
    return step._replace(clamped=bool(over.any()))


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
    """
    v = principal_subspace_grouped(phi_y, c_rel=c_rel, c_abs=c_abs)  # (G, k)
    lam_e = (v * (phi_y @ v.unsqueeze(-1)).squeeze(-1)).sum(-1)  # (G,)
    g = delta * mean_power / torch.clamp(lam_e, min=eps)
    over = g > 1.0
    g = torch.clamp(g, max=1.0)
    a = (torch.sqrt(g) - 1.0).view(-1, 1, 1)
    t_vec = (t_prev.transpose(-1, -2) @ v.unsqueeze(-1)).squeeze(-1)  # (G, k)
    vv, tt = v.unsqueeze(-1), t_vec.unsqueeze(-1)  # columns
    eye = torch.eye(t_prev.shape[-1], dtype=t_prev.dtype, device=t_prev.device)
    t_new = gamma * (t_prev + a * (vv * tt.transpose(-1, -2))) + (1.0 - gamma) * eye
    c1 = gamma * gamma * a * (a + 2.0)
    c2 = gamma * (1.0 - gamma) * a
    q_new = (gamma * gamma * q_prev + gamma * (1.0 - gamma) * (t_prev + t_prev.transpose(-1, -2))
             + tt * (c1 * tt + c2 * vv).transpose(-1, -2) + c2 * (vv * tt.transpose(-1, -2))
             + (1.0 - gamma) ** 2 * eye)
    return RecursiveStep(t_new, symmetrize(q_new), v, lam_e, g, False), over


def grouped_normalized_rank(cov: Tensor) -> Tensor:
    """``kappa`` of the block-diagonal covariance with blocks ``cov`` ``(G, k, k)``.

    ``M_s / M`` of the union of the blocks' spectra (ERRATA 1), i.e. of what a
    grouped layer's weights can see: for a depthwise layer, the effective rank
    of the channel variances divided by the number of channels.
    """
    lam = torch.linalg.eigvalsh(symmetrize(cov.to(torch.float64)))
    return (effective_rank(lam.reshape(-1)) / lam.numel()).to(cov.dtype)


def grouped_whiteness(cov: Tensor) -> Tensor:
    """``rho`` of the block-diagonal covariance with blocks ``cov`` ``(G, k, k)`` (ERRATA 2, same zero guard).

    Only correlations within a group count (a grouped layer's weights never
    combine channels of different groups); a depthwise layer's ``rho`` is 1.
    """
    c = cov.to(torch.float64)
    m = c.shape[0] * c.shape[-1]
    d = torch.diagonal(c, dim1=-2, dim2=-1)
    pos = d > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, d, torch.ones_like(d)), torch.zeros_like(d))
    corr2 = c * c * inv.unsqueeze(-1) * inv.unsqueeze(-2)
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device).bool()
    corr2 = torch.where(eye, torch.ones_like(corr2), corr2)
    return (m / corr2.sum()).to(cov.dtype)


def _grouped_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """:func:`transform_weight_grad` for a grouped weight ``(S, k, *kernel)`` and blocks ``q`` ``(G, k, k)``."""
    g, k = q.shape[0], q.shape[-1]
    s = grad.shape[0]
    q = q.to(grad.dtype)
    if k == 1:  # depthwise: a scale per group, in the gradient's own layout
        scale = q.reshape(g, 1).expand(g, s // g).reshape((s,) + (1,) * (grad.dim() - 1))
        return grad * scale
    gr = grad.reshape(g, s // g, k, -1)  # (G, S/G, k, K)
    out = torch.matmul(q.transpose(-1, -2).unsqueeze(1), gr)
    return torch.empty_like(grad).copy_(out.reshape(grad.shape))
