"""The state of a whitening layer: running statistics, buffers, the block, checkpoints.

:class:`WhiteningLayer` is a mixin of the whitening layers. It registers
the contract buffers (``running_mean``, ``running_cov``, ``whitening_matrix``,
``grad_transform``, ``num_blocks``) and its rule's own, accumulates each
training batch's moments, and folds a block every ``block_size`` training
forwards (``docs/PAPER.md``, "Conventions"): it computes the new moments and hands them to its
transform rule (:mod:`whitenlayers.rules`), which returns the new transform.
Hyper-parameters live in a frozen config (:mod:`whitenlayers.config`).

One module per concern:

- :mod:`~whitenlayers.stats.step`: the per-step path, what a training forward runs when no fold is due;
- :mod:`~whitenlayers.stats.block`: the block's accumulators and the layer's side of a fold;
- :mod:`~whitenlayers.stats.state_io`: checkpoints, pickling, scripting;
- :mod:`~whitenlayers.stats.rule_state`: the rule's name and config in the checkpoint, checked on load;
- :mod:`~whitenlayers.stats.layer`: the class itself: construction, config, resets and casts;
- ``_core``: what they share.

Grouped layers (``groups = G > 1``, grouped convolutions and
``DirectWhiten(groups=G)``) keep every ``M x M`` matrix as its ``G`` diagonal
blocks, a ``(G, M/G, M/G)`` tensor: ``running_cov``, ``whitening_matrix``,
``grad_transform`` and the recursive ``running_cov_whitened`` and
``whitening_gram`` (a depthwise layer with ``M = 960`` keeps ``960 x 1 x 1``
numbers, not ``960 x 960``); vectors (``running_mean``, ``running_power``)
stay ``(M,)``. ``groups=1`` layers keep the ``(M, M)`` shapes of the contract,
so their checkpoints are those of earlier versions and load unchanged.

Per-batch accumulators are *not* buffers: DistributedDataParallel re-broadcasts
every buffer from rank 0 before each forward, which would overwrite each rank's
partial sums. They travel in checkpoints through ``get_extra_state`` as one
float64 tensor (like every other entry of the state dict, so EMA helpers,
safetensors and exporters that expect tensors work; the dict of version 1
checkpoints still loads).

A forward that autograd re-runs inside a backward (activation checkpointing,
either kind) is not a new batch: it gathers nothing, folds nothing, and reads
the buffers that were in force at the layer's last original forward
(:func:`recomputing`, :meth:`WhiteningLayer._forward_state`).
Folding across layers and ranks is :mod:`whitenlayers.fold`'s.
"""
from .._deprecated import module_getattr
from ._core import _is_compiling as _is_compiling  # the layers' check: are we inside a traced graph?
from .layer import WhiteningLayer
from .state_io import loading_plain_checkpoint as loading_plain_checkpoint
from .step import recomputing

__all__ = ["WhiteningLayer", "recomputing"]

__getattr__ = module_getattr("whitenlayers.stats", "WhiteningStatistics")
