"""Model surgery: put whitening layers into an existing model, and take them out again.

* :func:`convert_model` replaces the target convolutions of a model (by
  default every ``nn.Conv2d`` inside a residual block) with whitening layers,
  in place, in the style of ``nn.SyncBatchNorm.convert_sync_batchnorm``.
* :func:`to_plain_model` folds the whitening back into plain ``nn.Conv2d`` /
  ``nn.Linear`` layers with identical outputs, for deployment without this
  package.
* :func:`load_plain_state_dict` / :func:`plain_state_dict` move checkpoints
  between a converted model and the unconverted architecture.
* :func:`whitening_layers` lists the whitening layers of a model.

``state_dict`` keys
-------------------
``method="grad"`` / ``"recursive"``: a target ``name`` keeps its keys
``name.weight`` (and ``name.bias``) and gains the whitening state
``name.running_mean``, ``name.running_cov``, ``name.whitening_matrix``,
``name.grad_transform``, ``name.num_blocks``, ``name._extra_state`` (the
partial block), ``name.bias_correction`` for a bias-free layer,
``name.absorbed_offset`` for a layer whose centring its BatchNorm absorbs
(``absorb_centring``, the default where the output feeds only a BatchNorm),
and for the recursive method ``name.running_cov_whitened``,
``name.running_power``, ``name.whitening_gram``.

``method="direct"``: the target ``name`` becomes a :class:`DirectWhitenWrapper`
wrapper with two children, ``whiten`` (the :class:`~whitenlayers.DirectWhiten`)
and ``layer`` (the original module, unchanged): keys ``name.weight`` become
``name.layer.weight`` and the whitening state is under ``name.whiten.*``.

A plain checkpoint (keys of the unconverted architecture) loads into a
converted model with :func:`load_plain_state_dict`, and
:func:`plain_state_dict` gives the converted model's function as a plain
checkpoint.

The package has one module per concern: :mod:`.targets` (which layers, the report), :mod:`.absorb` (the
BatchNorm that absorbs a layer's centring), :mod:`.surgery` (:func:`convert_model`), :mod:`.export`
(:func:`to_plain_model`, plain checkpoints); the names below are re-exported here.
"""
from __future__ import annotations

__all__ = [
    "DEFAULT_BLOCK_TYPES",
    "ConversionReport",
    "LayerDecision",
    "TargetSpec",
    "conversion_report",
    "DirectWhitenWrapper",
    "convert_model",
    "to_plain_model",
    "whitening_layers",
    "frozen",
    "target_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "absorbing_batchnorms",
]

from ._common import DEFAULT_BLOCK_TYPES, DirectWhitenWrapper
from ._common import BlockTypes as BlockTypes  # type aliases of the signatures
from ._common import Predicate as Predicate
from .absorb import absorbing_batchnorms
from .export import load_plain_state_dict, plain_state_dict, to_plain_model
from .surgery import convert_model
from .targets import (
    ConversionReport,
    LayerDecision,
    TargetSpec,
    conversion_report,
    frozen,
    target_layers,
    whitening_layers,
)

