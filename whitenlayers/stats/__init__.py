"""Deprecated: the base class of the whitening layers moved to :mod:`whitenlayers.layers` (this sub-package held the
layer, not statistics). Its names resolve there, with a ``FutureWarning``, for one release."""
from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from .. import layers
    from ..layers import checkpoint

    home = {"WhiteningLayer": layers, "recomputing": layers, "loading_plain_checkpoint": checkpoint}.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"whitenlayers.stats is renamed whitenlayers.layers ({name} lives there); the old name will be "
                  "removed in the next release", FutureWarning, stacklevel=2)
    return getattr(home, name)
