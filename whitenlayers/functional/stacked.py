"""Moments of several layers at once: their batches stacked and summed into stacked accumulators, a few
operations for all of them (what a converted model's fold coordinator runs at the end of a forward); and the
fold's stacks of layers' tensors (private helpers of :mod:`whitenlayers.fold`). Part of
:mod:`whitenlayers.functional`."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .batch import _ACC_ROW_ALIGN, LOW_PRECISION, _ones, _probe_out_dtype, _rows_layout
from .moments import BlockSummary

__all__ = ["accumulate_moments_grouped", "stack_shifts", "stacked_moments_accumulator"]


def accumulate_moments_grouped(acc: Tensor, xs: Sequence[Tensor],
                               shifts: Optional[Union[Sequence[Optional[Tensor]], Tensor]] = None,
                               blocks: Optional[Tuple[Tensor, Tensor]] = None) -> None:
    """:func:`~whitenlayers.functional.accumulate_moments` of several layers' batches of one shape at once, into
    their stacked accumulators: a few operations for all of them instead of two or more per layer (a host-bound
    step pays per operation, not per number).

    ``acc`` ``(L, M + 1, M + 1)`` holds layer ``i``'s accumulator at ``acc[i]`` (:func:`stacked_moments_accumulator`
    makes one with aligned rows); ``xs[i]`` is its batch (``(B, M)`` or ``(B, M, *spatial)``; one shape, dtype and
    device for all) and ``shifts[i]`` the shift it is summed about (broadcasting against it; ``None``: all summed
    about 0). The batches are stacked (one copy; a channels_last or 2-D batch as rows ``(P, M)``, otherwise
    features first), the shifts subtracted (one operation, in the accumulators' dtype), then two batched products
    add, in place, every ``sum (x - k)(x - k)^T`` into ``acc[:, :M, :M]`` and every ``sum (x - k)`` (the product
    with a column of ones) into ``acc[:, :M, M]``. The same sums as ``accumulate_moments`` up to rounding
    (products in another order).

    A bf16 / fp16 batch summed about 0 goes into the batched products as it is where the device multiplies it into
    float32 (CUDA, ``out_dtype``), as in ``accumulate_moments``; elsewhere it is converted first.

    Args:
        acc: the stacked accumulators, ``(L, M + 1, M + 1)``, float32 or float64 (a strided view is fine).
        xs: the ``L`` batches, features on dim 1.
        shifts: the ``L`` shifts (``(1, M, 1, ...)`` or ``(M,)``; ``None`` for a batch summed about 0), or
            ``None`` (all about 0); or already stacked, ``(L, M)`` in ``acc``'s dtype (:func:`stack_shifts`, for a
            caller that keeps them across calls).
        blocks: ``acc[:, :M, :M]`` and ``acc[:, :M, M:]`` as sliced once by the caller (default: sliced here).

    Example:
        >>> import torch
        >>> from whitenlayers.functional import accumulate_moments_grouped, stacked_moments_accumulator
        >>> acc = stacked_moments_accumulator(2, 3)
        >>> xs = [torch.randn(5, 3), torch.randn(5, 3)]
        >>> accumulate_moments_grouped(acc, xs)
        >>> torch.allclose(acc[1, :3, :3], xs[1].t() @ xs[1], atol=1e-5)
        True
    """
    if acc.dim() != 3 or acc.shape[0] != len(xs) or (shifts is not None and len(shifts) != len(xs)) or not xs:
        raise ValueError(f"accumulate_moments_grouped: expected a stacked accumulator (L, M + 1, M + 1) and L >= 1 "
                         f"batches (and shifts), but got acc of shape {tuple(acc.shape)}, {len(xs)} batches and "
                         f"{'no' if shifts is None else len(shifts)} shifts")
    shape = xs[0].shape
    m = acc.shape[-1] - 1
    if any(x.shape != shape for x in xs) or len(shape) < 2 or shape[1] != m:
        raise ValueError(f"accumulate_moments_grouped: the batches must share one shape with {m} features on dim "
                         f"1, but got shapes {sorted({tuple(x.shape) for x in xs})}")
    dtype = acc.dtype
    if len(shape) == 2:
        a = torch.stack(list(xs))  # (L, B, M)
        samples, features = 1, 2
    elif len(shape) == 4 and _rows_layout(xs[0]):
        # channels_last batches stack channels_last: the rows (L, P, M) are a view of the stack
        a = torch.stack(list(xs)).permute(0, 1, 3, 4, 2).reshape(len(xs), -1, m)
        samples, features = 1, 2
    else:  # (L, M, N): each batch's features first, copied once by the stack
        a = torch.stack([x.transpose(0, 1) for x in xs]).flatten(2)
        samples, features = 2, 1
    if shifts is not None:  # x - k in the accumulators' dtype (a bf16 batch is promoted by the subtraction)
        k = shifts if isinstance(shifts, Tensor) else stack_shifts(shifts, m, dtype)
        a = torch.sub(a, k.unsqueeze(samples))
    lowp = a.dtype != dtype and a.dtype in LOW_PRECISION and _probe_out_dtype(a.device, "bmm")
    if a.dtype != dtype and not lowp:
        a = a.to(dtype)
    left, right = (a.mT, a) if features == 2 else (a, a.mT)
    # Two products added in place into the accumulators' strided blocks (cuBLAS writes aligned rows as they are),
    # the column sums as the product with a column of ones, as accumulate_moments does: two kernels.
    s2, s1 = (acc[:, :m, :m], acc[:, :m, m:]) if blocks is None else blocks
    ones = _ones((a.shape[0], a.shape[samples], 1), a.dtype, a.device)  # (L, P or N, 1)
    if not lowp:
        s2.baddbmm_(left, right)
        s1.baddbmm_(left, ones)
    elif _probe_out_dtype(a.device, "baddbmm"):  # bf16 / fp16 products into float32 on tensor cores, in place
        torch.baddbmm(s2, left, right, out_dtype=dtype, out=s2)
        torch.baddbmm(s1, left, ones, out_dtype=dtype, out=s1)
    else:  # the products into float32, then added (out of place: outside autocast, which would cast them)
        with torch.autocast(device_type=a.device.type, enabled=False):
            s2.add_(torch.bmm(left, right, out_dtype=dtype))
            s1.add_(torch.bmm(left, ones, out_dtype=dtype))


def stack_shifts(shifts: Sequence[Optional[Tensor]], num_features: int, dtype: torch.dtype) -> Tensor:
    """The shifts of :func:`accumulate_moments_grouped` stacked ``(L, M)`` in ``dtype``, a row of zeros for each
    ``None`` (a batch summed about 0); at least one shift must be a tensor (its device is the stack's).

    Example:
        >>> stack_shifts([torch.ones(1, 2, 1, 1), None], 2, torch.float64)
        tensor([[1., 1.],
                [0., 0.]], dtype=torch.float64)
    """
    first = next((k for k in shifts if k is not None), None)
    if first is None:
        raise ValueError("stack_shifts: expected at least one shift tensor, but got only None")
    zeros = first.new_zeros(num_features)
    return torch.stack([zeros if k is None else k.reshape(-1) for k in shifts]).to(dtype)


def stacked_moments_accumulator(layers: int, num_features: int, dtype: torch.dtype = torch.float32,
                                device: Optional[Union[str, torch.device]] = None) -> Tensor:
    """``layers`` zeroed accumulators for :func:`accumulate_moments_grouped`, ``(L, M + 1, M + 1)``, each with
    :func:`~whitenlayers.functional.moments_accumulator`'s aligned rows (a view of ``(L, M + 1, M')`` storage).

    Example:
        >>> stacked_moments_accumulator(2, 3).stride()
        (32, 8, 1)
    """
    m1 = num_features + 1
    return torch.zeros(layers, m1, -(-m1 // _ACC_ROW_ALIGN) * _ACC_ROW_ALIGN, dtype=dtype, device=device)[:, :, :m1]


# The fold's stacks of layers' tensors (private helpers of whitenlayers.fold).
def _stack64(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack(tensors).to(torch.float64)`` in one allocation (the fold's matrices are large: each
    temporary costs a pass over memory and its first-touch page faults)."""
    out = torch.empty((len(tensors),) + tuple(tensors[0].shape), dtype=torch.float64, device=tensors[0].device)
    torch._foreach_copy_(list(out.unbind(0)), list(tensors))
    return out


def _unstack(block: BlockSummary, n: int) -> List[BlockSummary]:
    """The ``n`` layers' summaries of a stacked ``block``: one ``unbind`` per field (a call per field, not one
    indexing call per field and layer)."""
    return [BlockSummary(*fields) for fields in zip(*(t.unbind(0) for t in block))]


def _stack(blocks: Sequence[BlockSummary]) -> BlockSummary:
    return BlockSummary(*(_restack(ts) for ts in zip(*blocks)))


def _restack(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack(tensors)``, for reading: the stack they were unbound from (:func:`_unstack`) when they are
    its slices in order, or a view of a single tensor, without a copy."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0)
    base = tensors[0]._base
    if (base is not None and base.dim() == tensors[0].dim() + 1 and base.shape[0] == len(tensors)
            and all(t._base is base and t.shape == base.shape[1:] and t.stride() == base.stride()[1:]
                    and t.data_ptr() == base.data_ptr() + k * base.stride(0) * base.element_size()
                    for k, t in enumerate(tensors))):
        return base
    return torch.stack(list(tensors))


def _own_all(tensors: Sequence[Tensor]) -> List[Tensor]:
    """Contiguous tensors of their own with the values of ``tensors`` (a slice of a stack would keep the whole
    stack alive, and checkpoint it), in one call (``torch._foreach_clone``: one dispatch for the list, a copy
    per tensor inside ATen, where a clone each from Python cost its own call and checks), a clone per tensor
    where torch has no ``_foreach_clone``."""
    if not tensors:
        return []
    foreach = getattr(torch, "_foreach_clone", None)
    if foreach is not None:
        return list(foreach(list(tensors), memory_format=torch.contiguous_format))
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
