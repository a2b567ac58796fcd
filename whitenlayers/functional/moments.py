"""Moments of blocks of batches: block summaries from their shifted sums, the recursive averages of mu and Phi_x,
and the block-diagonal (grouped) storage of per-group matrices (what a batch adds to a block is
:mod:`~whitenlayers.functional.batch`'s). Part of :mod:`whitenlayers.functional`."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import einops
import torch
from torch import Tensor

__all__ = ["BlockSummary", "symmetrize", "all_finite", "unshifted_accurate", "unshifted_accurate_each",
           "finite_each", "summarize_block", "scatter_about", "block_power", "fold_mean", "block_covariance",
           "recursive_average", "fold_moments", "block_shape", "block_identity", "block_diagonal", "block_outer",
           "stats_dtype"]


# --------------------------------------------------------------------------
# Moments
# --------------------------------------------------------------------------
class BlockSummary(NamedTuple):
    """The statistics of one block of samples, as needed by the fold.

    ``count`` samples (all batch elements and spatial positions), their
    ``mean`` ``(M,)``, the *centred* scatter ``scatter = sum (x - mean)(x - mean)^T``
    ``(M, M)`` and the uncentred power ``power = sum x**2`` ``(M,)``. All float64.

    Args:
        count: the number of samples (batch elements times positions), a 0-dim tensor (``(L,)`` stacked).
        mean: their mean ``(M,)``.
        scatter: ``sum (x - mean)(x - mean)^T``, ``(M, M)`` (grouped: ``(G, k, k)``).
        power: ``sum x**2`` per feature ``(M,)``.
    """

    count: Tensor  # type: ignore[assignment]  # the field shadows tuple.count (a public name)
    mean: Tensor
    scatter: Tensor
    power: Tensor


def symmetrize(a: Tensor) -> Tensor:
    """``(a + a^T) / 2``: removes the rounding asymmetry before ``eigh``.

    Args:
        a: a square matrix ``(..., M, M)`` (stacks allowed).
    """
    return torch.add(a, a.mT).mul_(0.5)  # 3x faster than 0.5 * (a + a.mT) for float32 on CPU


def all_finite(*tensors: Tensor) -> bool:
    """``True`` when every element of every tensor is finite.

    Fast path: a finite sum implies finite elements (NaN and Inf propagate
    through a sum), so the sums of all the tensors are added and checked once
    (``2 k + 2`` small ops and one host synchronisation for ``k`` tensors); only
    a sum that overflows although its terms are finite falls back to the
    elementwise check. One pass over memory in the common case.

    Args:
        *tensors: any floating tensors.
    """
    sums = [t.sum() for t in tensors]
    if not sums or bool(sum(sums[1:], sums[0]) * 0 == 0):  # x * 0 is NaN exactly for NaN and +-Inf
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def finite_each(*stacks: Tensor) -> Tensor:
    """:func:`all_finite` per stacked layer (a leading dimension ``L`` on every tensor), as a bool tensor ``(L,)``
    on the device: the sum of each layer's elements, NaN or Inf exactly when one is (or when the sum overflows,
    which counts as not finite). No host synchronisation.

    Args:
        *stacks: tensors sharing a leading layer dimension ``L``.
    """
    # a sum over the trailing dimensions: no copy of a non-contiguous stack, as flatten makes
    sums = [t.sum(tuple(range(1, t.dim()))) if t.dim() > 1 else t for t in stacks]
    return sum(sums[1:], sums[0]) * 0 == 0  # x * 0 is NaN exactly for NaN and +-Inf




def unshifted_accurate(block: "BlockSummary", max_mean2_var: float) -> bool:
    """Whether ``block``'s statistics allow summing the next block about 0: ``mean^2 <= max_mean2_var * var`` for
    every feature (then :func:`batch_sums` without a shift loses at most ``log2(1 + max_mean2_var)`` bits to the
    cancellation). From the count, mean and power alone (every rank has them after the fold's first collective,
    so every rank decides alike). One host synchronisation, once per block; :func:`unshifted_accurate_each` for
    stacked layers.

    Args:
        block: the folded block's :class:`BlockSummary`.
        max_mean2_var: the largest ``mean^2 / var`` accepted, >= 0 (7: at most 3 bits lost).
    """
    return bool(unshifted_accurate_each(block, max_mean2_var).all())


def unshifted_accurate_each(block: "BlockSummary", max_mean2_var: float) -> Tensor:
    """:func:`unshifted_accurate` of stacked blocks (a leading layer dimension): one flag per layer, on the
    device (no host synchronisation).

    Args:
        block: stacked :class:`BlockSummary` (a leading layer dimension).
        max_mean2_var: as for :func:`unshifted_accurate`.
    """
    # mean^2 <= r var  <=>  (1 + r) n mean^2 <= r power  (var = power / n - mean^2); False for NaN
    lhs = block.mean.square() * ((1.0 + max_mean2_var) * _per_layer(block.count, block.mean))
    return (lhs <= max_mean2_var * block.power).all(-1)




def _per_layer(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (one value per stacked layer, shape ``(L,)``, or a scalar) shaped to broadcast against ``like``
    (``(L, ...)``, or unstacked)."""
    return t.reshape(tuple(t.shape) + (1,) * (like.dim() - t.dim()))


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


def summarize_block(count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor, *, inplace: bool = False) -> BlockSummary:
    """Turn shifted sums into a :class:`BlockSummary` (mean and centred scatter).

    The scatter about the block's own mean (:func:`scatter_about`) is exact
    algebra; it is accurate because ``s1`` is small when ``shift`` is close to
    the block mean. A grouped ``s2`` ``(G, k, k)`` gives a grouped ``scatter``.
    Stacked blocks (a leading layer dimension ``L`` on every argument, ``count``
    ``(L,)``) give stacked summaries, each equal to its block's alone.

    Args:
        count, shift, s1, s2: the block's sample count, the shift, ``sum (x - shift)`` ``(M,)`` and
            ``sum (x - shift)(x - shift)^T`` ``(M, M)`` (grouped ``(G, k, k)``; stacked: a leading ``L``).
        inplace: ``s2`` (float64, a tensor of the caller's own) is used as work space and overwritten: two
            matrix-sized allocations instead of four (default ``False``). The result is the same either way.
    """
    n = count.to(torch.float64)
    shift = shift.to(torch.float64)
    mean = shift + s1.to(torch.float64) / _per_layer(torch.clamp(n, min=1.0), s1)
    power = block_power(count, shift, s1, s2)  # (from s2's diagonal: before s2 is overwritten)
    scatter = scatter_about(count, shift, s1, s2, mean, inplace=inplace and s2.dtype == torch.float64)
    return BlockSummary(n, mean, symmetrize(scatter), power)


def block_power(count: Tensor, shift: Tensor, s1: Tensor, s2: Tensor) -> Tensor:
    """``sum x**2`` per feature from the shifted sums (see :func:`scatter_about`). float64.

    Args:
        count, shift, s1, s2: the block's sample count, the shift, ``sum (x - shift)`` ``(M,)`` and
            ``sum (x - shift)(x - shift)^T`` ``(M, M)`` (grouped ``(G, k, k)``; stacked: a leading ``L``).
    """
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

    Args:
        count, shift, s1, s2: the block's sample count, the shift, ``sum (x - shift)`` ``(M,)`` and
            ``sum (x - shift)(x - shift)^T`` ``(M, M)`` (grouped ``(G, k, k)``; stacked: a leading ``L``).
        center: the point ``(M,)`` to centre on (e.g. the block's or the global mean).
        inplace: write into ``s2`` (float64) instead of a new tensor (default ``False``).
    """
    n = _per_layer(count.to(torch.float64), s1)
    e = center.to(torch.float64) - shift.to(torch.float64)
    u = s1.to(torch.float64) - (0.5 * n) * e
    out = s2 if inplace else s2.to(torch.float64, copy=True)
    u, e = u.reshape(s2.shape[:-1]), e.reshape(s2.shape[:-1])
    # two rank-one updates in place: no matrix-sized temporary, contiguous reads only
    return out.addcmul_(u.unsqueeze(-1), e.unsqueeze(-2), value=-1.0).addcmul_(e.unsqueeze(-1), u.unsqueeze(-2),
                                                                                value=-1.0)


def fold_mean(mean_prev: Tensor, block: BlockSummary, alpha: float, first: Union[bool, Sequence[bool]]) -> Tensor:
    """Eq. ``vmuxi``: ``mu(i) = alpha mu(i-1) + (1 - alpha) mean_block``; eq. ``vmuxnz`` when ``first``.

    Stacked layers: ``first`` one flag per layer.

    Args:
        mean_prev: ``mu(i-1)`` ``(M,)`` (ignored for a first block).
        block: the block's :class:`BlockSummary`.
        alpha: the config field ``alpha``, in ``[0, 1)``.
        first: ``True`` for the first folded block; one flag per layer when stacked.
    """
    mean = block.mean.to(torch.float64)
    return _first_or(first, mean, lambda: alpha * mean_prev.to(torch.float64) + (1.0 - alpha) * mean)


def block_covariance(block: BlockSummary, mu: Tensor) -> Tensor:
    """``1/n sum (x - mu)(x - mu)^T`` over the block's samples, centred on ``mu`` (not the block mean).

    From the block's own centred scatter by the parallel-axis identity
    ``sum (x - mu)(x - mu)^T = scatter + n (mean - mu)(mean - mu)^T``. float64.
    Symmetric to the last bit when ``scatter`` is (as :func:`summarize_block` makes it):
    every operation here treats entries ``(i, j)`` and ``(j, i)`` alike. Stacked layers alike.

    Args:
        block: the block's :class:`BlockSummary`.
        mu: the centre ``(M,)``, e.g. the new running mean ``mu(i)``.
    """
    scatter = block.scatter.to(torch.float64)
    n = _per_layer(torch.clamp(block.count.to(torch.float64), min=1.0), scatter)
    d = (block.mean.to(torch.float64) - mu.to(torch.float64)).reshape(scatter.shape[:-1])
    return torch.div(scatter, n).addcmul_(d.unsqueeze(-1), d.unsqueeze(-2))  # one matrix-sized allocation


def recursive_average(prev: Tensor, new: Tensor, alpha: float, first: Union[bool, Sequence[bool]], *,
                      inplace: bool = False) -> Tensor:
    """``alpha prev + (1 - alpha) new``, or ``new`` for the first block (no recursion). float64.

    Stacked layers: ``first`` one flag per layer. Elementwise: a symmetric ``prev`` and ``new`` give a result
    symmetric to the last bit.

    Args:
        prev: the running value.
        new: the block's value, same shape.
        alpha: the config field ``alpha``, in ``[0, 1)``.
        first: ``True`` for the first folded block; one flag per layer when stacked.
        inplace: write the recursion into ``prev`` (float64, a tensor of the caller's own) instead of a new
            tensor (default ``False``); the result is the same either way.
    """
    new = new.to(torch.float64)
    if inplace and prev.dtype == torch.float64:
        return _first_or(first, new, lambda: prev.mul_(alpha).add_(new, alpha=1.0 - alpha))
    return _first_or(first, new, lambda: torch.mul(prev.to(torch.float64), alpha).add_(new, alpha=1.0 - alpha))


def fold_moments(
    mean_prev: Tensor,
    cov_prev: Tensor,
    block: BlockSummary,
    alpha: float,
    first: Union[bool, Sequence[bool]],
) -> Tuple[Tensor, Tensor]:
    """One block of the moment recursion: eqs. ``vmuxi``/``vPhixi`` (``vmuxnz``/``vPhixnz`` when ``first``).

    ``mu(i) = alpha mu(i-1) + (1 - alpha) mean_block`` and
    ``Phi(i) = alpha Phi(i-1) + (1 - alpha) / n * sum (x - mu(i))(x - mu(i))^T``,
    the block's samples centred on the *new* mean ``mu(i)`` (ERRATA 7). For the
    first block there is no recursion (``alpha`` is ignored). float64.
    Symmetric to the last bit when ``cov_prev`` and the block's scatter are.

    Stacked layers (a leading dimension ``L`` on every tensor, ``first`` one
    flag per layer): the fold of many layers of one shape at once, each equal to
    its own fold to the last bit (elementwise operations only).

    Args:
        mean_prev: ``mu(i-1)`` ``(M,)``.
        cov_prev: ``Phi(i-1)`` ``(M, M)`` (grouped: ``(G, k, k)``).
        block: the block's :class:`BlockSummary`.
        alpha: the config field ``alpha``, in ``[0, 1)``.
        first: ``True`` for the first folded block; one flag per layer when stacked.

    Returns:
        ``(mu(i), Phi(i))``.
    """
    mu = fold_mean(mean_prev, block, alpha, first)
    return mu, recursive_average(cov_prev, block_covariance(block, mu), alpha, first)


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
def stats_dtype(dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype a layer keeps its statistics and transforms in: float64 for a float64 layer, else float32 (a
    bf16 / fp16 layer's too). ``dtype``: the layer's (default ``None``: ``torch.get_default_dtype()``, as ``nn``
    layers take it).

    Example:
        >>> stats_dtype(torch.float64), stats_dtype(torch.bfloat16)
        (torch.float64, torch.float32)
    """
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_shape(m: int, groups: int = 1) -> Tuple[int, ...]:
    """Shape of an ``M x M`` matrix kept per group: ``(M, M)`` for one group, else ``(G, M/G, M/G)``.

    Args:
        m: the number of features ``M``.
        groups: ``G`` >= 1 dividing ``M`` (default 1).
    """
    if groups == 1:
        return (m, m)
    return (groups, m // groups, m // groups)


def block_identity(m: int, groups: int = 1, *, device=None, dtype=None) -> Tensor:
    """The identity in the storage of :func:`block_shape`.

    Args:
        m, groups: as for :func:`block_shape`.
        device, dtype: of the result (default ``None``: torch's defaults).
    """
    if groups == 1:
        return torch.eye(m, device=device, dtype=dtype)
    k = m // groups
    return torch.eye(k, device=device, dtype=dtype).expand(groups, k, k).clone()


def block_diagonal(mat: Tensor) -> Tensor:
    """The dense ``(M, M)`` matrix of a ``(G, k, k)`` stack of blocks (an ``(M, M)`` matrix is returned as is).

    Args:
        mat: ``(G, k, k)`` blocks, or an ``(M, M)`` matrix.
    """
    if mat.dim() == 2:
        return mat
    return torch.block_diag(*mat.unbind(0))


def block_outer(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """The diagonal blocks of ``outer(a, b)`` for ``(M,)`` vectors: ``(G, k, k)``.

    Args:
        a, b: ``(M,)`` vectors.
        groups: ``G`` >= 1 dividing ``M``.
    """
    return einops.rearrange(a, "(g i) -> g i 1", g=groups) * einops.rearrange(b, "(g j) -> g 1 j", g=groups)


