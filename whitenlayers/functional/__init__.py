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

from . import batch, evd, moments, recursive, spectrum, stacked
from .batch import *  # noqa: F401,F403  (each module's __all__: its public names)
from .evd import *  # noqa: F401,F403
from .moments import *  # noqa: F401,F403
from .recursive import *  # noqa: F401,F403
from .spectrum import *  # noqa: F401,F403
from .stacked import *  # noqa: F401,F403

__all__ = [*batch.__all__, *moments.__all__, *spectrum.__all__, *evd.__all__, *recursive.__all__, *stacked.__all__]

for _name in __all__:  # documented (and pickled) as whitenlayers.functional.<name>
    globals()[_name].__module__ = __name__
del _name
