"""The fold's stacks of several layers' tensors (private helpers of :mod:`whitenlayers.fold`). Part of
:mod:`whitenlayers.functional`."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from .moments import BlockSummary

__all__: List[str] = []


# The fold's stacks of layers' tensors (private helpers of whitenlayers.fold).
def _stack64(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack(tensors).to(torch.float64)`` in one allocation (the fold's matrices are large: each
    temporary costs a pass over memory and its first-touch page faults)."""
    out = torch.empty((len(tensors),) + tuple(tensors[0].shape), dtype=torch.float64, device=tensors[0].device)
    return torch.stack(list(tensors), out=out)


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
    stack alive, and checkpoint it)."""
    return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
