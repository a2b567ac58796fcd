"""Renamed public names: the old name stays for one release, with a ``DeprecationWarning`` (a module ``__getattr__``).

Renamed in 0.2 (issue 23): ``WhiteningStatistics`` -> :class:`~whitenlayers.WhiteningLayer` (the base of every
whitening layer), ``DirectWhitened`` -> :class:`~whitenlayers.DirectWhitenWrapper` (one letter from
``DirectWhiten``), ``export_model`` -> :func:`~whitenlayers.to_plain_model` (read as ``torch.export``).
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Dict

#: old name -> (new name, module that defines it)
RENAMED: Dict[str, tuple] = {
    "WhiteningStatistics": ("WhiteningLayer", "whitenlayers.stats"),
    "DirectWhitened": ("DirectWhitenWrapper", "whitenlayers.convert._common"),
    "export_model": ("to_plain_model", "whitenlayers.convert.export"),
}


def module_getattr(module: str, *names: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves the old ``names`` to their new objects, with a warning."""

    def __getattr__(name: str) -> Any:
        if name in names:
            new, home = RENAMED[name]
            warnings.warn(f"{module}.{name} is renamed {new} (whitenlayers.{new}); the old name will be removed in "
                          "the next release", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(home), new)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
