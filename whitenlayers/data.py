"""Deprecated: the runner's datasets moved to :mod:`whitenlayers.experiment.data`.

This alias keeps ``import whitenlayers.data`` and ``whitenlayers.data.load_dataset`` (and every other name)
working for one release, with a ``DeprecationWarning`` at the first use of a name. The core package never
imports it.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn("whitenlayers.data moved to whitenlayers.experiment.data; the old name will be removed in the "
                  "next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("whitenlayers.experiment.data"), name)
