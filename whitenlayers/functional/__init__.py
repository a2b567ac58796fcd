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

import torch  # noqa: F401  (the namespace of the docstring examples, which run as tests under this module's name)

from .batch import (  # noqa: F401
    _CPU_BMM_MAX_FEATURES,
    _CPU_UNSHIFTED_MIN_ELEMENTS,
    STATS_MIN_ROWS_PER_FEATURE,
    accumulate_moments,
    accumulate_moments_split,
    batch_moments,
    batch_sums,
    fused_moments,
    fused_moments_on,
    grouped_batch_moments,
    low_precision_products_on,
    moments_accumulator,
    ones_for_moments,
    stats_samples,
    transform_weight_grad,
    weight_mean_product,
)
from .evd import (  # noqa: F401
    cholesky_dtype,
    damped_transform,
    damped_transform_batched,
    eigh_dtype,
    evd_transform,
    evd_transform_batched,
    evd_transform_grouped,
    evd_transform_grouped_batched,
    grouped_whitening_gains,
    robust_eigh,
    whitening_gains,
)
from .moments import (  # noqa: F401
    BlockSummary,
    all_finite,
    block_covariance,
    block_diagonal,
    block_identity,
    block_outer,
    block_power,
    block_shape,
    finite_each,
    fold_mean,
    fold_moments,
    recursive_average,
    scatter_about,
    summarize_block,
    symmetrize,
    unshifted_accurate,
    unshifted_accurate_each,
)
from .recursive import (  # noqa: F401
    RecursiveStep,
    principal_subspace,
    principal_subspace_grouped,
    recursive_step,
    recursive_step_blocks,
    recursive_step_grouped,
    smooth_grad_transform,
    whitened_covariance,
    whitened_covariance_update,
)
from .spectrum import (  # noqa: F401
    effective_rank,
    grouped_normalized_rank,
    grouped_whiteness,
    normalized_rank,
    whiteness,
)

# One module per concern; this package re-exports their public names (the module path of every name stays
# ``whitenlayers.functional``) and the two CPU switches that tests and benchmarks read.
from .stacked import accumulate_moments_grouped, stack_shifts, stacked_moments_accumulator  # noqa: F401

__all__ = [
    "BlockSummary",
    "symmetrize",
    "all_finite",
    "accumulate_moments",
    "accumulate_moments_grouped",
    "accumulate_moments_split",
    "moments_accumulator",
    "stack_shifts",
    "stacked_moments_accumulator",
    "ones_for_moments",
    "fused_moments",
    "fused_moments_on",
    "low_precision_products_on",
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
    "damped_transform",
    "damped_transform_batched",
    "cholesky_dtype",
    "robust_eigh",
    "eigh_dtype",
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

for _name in __all__:  # documented (and pickled) as whitenlayers.functional.<name>
    globals()[_name].__module__ = __name__
del _name
