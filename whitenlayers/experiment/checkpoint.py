"""Checkpoint files of a run: one per (method, seed), written atomically after every epoch.

A checkpoint holds the epoch count, the model and optimizer state, the
global random generators' state, the metrics rows so far and the
configuration fingerprint (:func:`~whitenlayers.experiment.config.fingerprint`);
with ``--amp fp16`` also the gradient scaler's state. Rank 0 reads it and
broadcasts it to the other ranks.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

from ._safe_io import load_checkpoint, numpy_rng_from_plain, numpy_rng_to_plain, save_checkpoint
from .context import Context

__all__ = ["checkpoint_path", "rng_state", "set_rng_state"]


def checkpoint_path(out: str, method: str, seed: int) -> str:
    return os.path.join(out, "checkpoints", f"{method}-seed{seed}.pt")


def rng_state() -> Dict[str, Any]:
    # numpy's stubs type a plain get_state() by its legacy=False overload (a dict); it returns the legacy tuple.
    state = {"torch": torch.get_rng_state(),
             "numpy": numpy_rng_to_plain(np.random.get_state()),  # type: ignore[arg-type]
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_from_plain(state["numpy"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_save(obj: Any, path: str) -> None:
    save_checkpoint(obj, path)  # plain values only, so that it loads with weights_only=True


def _load_checkpoint(path: str, ctx: Context) -> Optional[Dict[str, Any]]:
    """Rank 0 reads ``path`` (``None`` when there is none) and every rank gets it."""
    state = None
    if ctx.is_main and os.path.isfile(path):
        state = load_checkpoint(path)  # torch.load(weights_only=True): a checkpoint cannot run code
    return ctx.broadcast_object(state)
