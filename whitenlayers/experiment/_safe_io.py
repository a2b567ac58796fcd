"""Reading files that may come from elsewhere without running code from them.

Used by :mod:`whitenlayers.experiment.data` (CIFAR archives) and the experiment runner
(checkpoints). Nothing here is part of the public API.

* :func:`unpickle_cifar` reads one CIFAR python batch with a restricted
  unpickler: only the globals that such batches reference (numpy arrays and
  dtypes, under their numpy 1 and numpy 2 module names) are admitted; any
  other global is refused before it is imported or called.
* :func:`check_tar_members` refuses archives with absolute or ``..`` member
  names, links, devices or fifos.
* :func:`save_checkpoint` / :func:`load_checkpoint` write and read runner
  checkpoints that hold only tensors, dicts, lists, tuples, numbers, strings
  and ``None``, loaded with ``torch.load(weights_only=True)``.
* :func:`numpy_rng_to_plain` / :func:`numpy_rng_from_plain` turn numpy's
  global random state into such plain values and back.
"""
from __future__ import annotations

import codecs
import collections
import contextlib
import importlib
import os
import pickle
import re
import tarfile
import tempfile
from typing import Any, BinaryIO, Callable, Dict, Tuple

import numpy as np
import torch

__all__ = [
    "UnsafeFileError",
    "unpickle_cifar",
    "check_tar_members",
    "save_checkpoint",
    "load_checkpoint",
    "numpy_rng_to_plain",
    "numpy_rng_from_plain",
]


class UnsafeFileError(ValueError):
    """A file (or archive member) was refused because reading it could run code or write elsewhere."""


# --------------------------------------------------------------------------
# CIFAR batches
# --------------------------------------------------------------------------
_CIFAR_CONTENT = "CIFAR batches hold only dicts, lists, bytes/str, ints and numpy arrays"


def _numpy_attr(submodule: str, name: str) -> Callable[[], Any]:
    """Resolve ``numpy._core.<submodule>.<name>`` (numpy 2) or ``numpy.core.<submodule>.<name>`` (numpy 1)."""

    def resolve() -> Any:
        for base in ("numpy._core", "numpy.core"):
            try:
                return getattr(importlib.import_module(f"{base}.{submodule}"), name)
            except (ImportError, AttributeError):
                continue
        raise AttributeError(f"numpy has no {submodule}.{name}")

    return resolve


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 pickles bytes at protocol < 3 as _codecs.encode(text, "latin1"); admit only that use.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {type(text).__name__}, {encoding!r}")
    return codecs.encode(text, encoding)


# (module, name) -> a zero-argument function returning the object. Both numpy 1
# (``numpy.core``) and numpy 2 (``numpy._core``) names, whichever numpy wrote the
# file: the official archives are Python 2 / numpy 1 pickles referencing
# numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype.
_CIFAR_GLOBALS: Dict[Tuple[str, str], Callable[[], Any]] = {
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_encode,
}
for _core in ("numpy.core", "numpy._core"):
    _CIFAR_GLOBALS[(f"{_core}.multiarray", "_reconstruct")] = _numpy_attr("multiarray", "_reconstruct")
    _CIFAR_GLOBALS[(f"{_core}.multiarray", "scalar")] = _numpy_attr("multiarray", "scalar")
    _CIFAR_GLOBALS[(f"{_core}.numeric", "_frombuffer")] = _numpy_attr("numeric", "_frombuffer")
del _core


class _CifarUnpickler(pickle.Unpickler):
    def __init__(self, fobj: BinaryIO, label: str) -> None:
        super().__init__(fobj, encoding="bytes")
        self.label = label

    def find_class(self, module: str, name: str) -> Any:
        resolve = _CIFAR_GLOBALS.get((module, name))
        if resolve is None:
            raise UnsafeFileError(f"{self.label}: refusing to unpickle global '{module}.{name}' ({_CIFAR_CONTENT})")
        return resolve()

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeFileError(f"{self.label}: refusing a persistent id in a pickle ({_CIFAR_CONTENT})")


def unpickle_cifar(fobj: BinaryIO, label: str) -> dict:
    """Unpickle one CIFAR python batch from ``fobj``; ``label`` names the file (or archive member) in errors.

    Strings of Python 2 pickles come back as ``bytes`` (``encoding="bytes"``),
    as with the official archives' ``pickle.load(f, encoding="bytes")``.
    Raises :class:`UnsafeFileError` for any global outside the CIFAR allow list
    and ``ValueError`` for a file that is not a CIFAR batch.
    """
    try:
        obj = _CifarUnpickler(fobj, label).load()
    except UnsafeFileError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise ValueError(f"{label}: not a readable CIFAR batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{label}: not a CIFAR batch (a pickled {type(obj).__name__}, expected a dict)")
    return obj


# --------------------------------------------------------------------------
# Tar archives
# --------------------------------------------------------------------------
def check_tar_members(tar: tarfile.TarFile, label: str) -> None:
    """Refuse ``tar`` unless every member is a plain file or folder with a relative name inside the archive root.

    The CIFAR reader does not extract, but an archive with absolute or ``..``
    names, symbolic or hard links, devices or fifos is not an official one and
    would write outside the folder if someone extracted it, so it is refused
    whole. Where the Python version has it, ``tarfile.data_filter`` checks
    each member as well.
    """
    data_filter = getattr(tarfile, "data_filter", None)
    dest = os.path.realpath(os.path.dirname(os.path.abspath(label)) or os.curdir)
    for member in tar.getmembers():
        name = member.name
        parts = name.replace("\\", "/").split("/")
        reason = None
        if name.startswith(("/", "\\")) or os.path.isabs(name) or re.match(r"^[A-Za-z]:", name):
            reason = "absolute path"
        elif ".." in parts:
            reason = "'..' in the path"
        elif member.issym() or member.islnk():
            reason = f"{'symbolic' if member.issym() else 'hard'} link to {member.linkname!r}"
        elif not (member.isfile() or member.isdir()):
            reason = "not a regular file or folder"
        elif data_filter is not None:
            try:
                data_filter(member, dest)
            except tarfile.FilterError as exc:
                reason = str(exc)
        if reason is not None:
            raise UnsafeFileError(f"{label}: refusing archive member {name!r}: {reason}")


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
_PLAIN_LEAVES = (str, int, float, bool, type(None), torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype,
                 torch.device)
_CHECKPOINT_CONTENT = ("whitenlayers checkpoints hold only tensors, dicts, lists, tuples, numbers, strings and None; "
                       "they are read with torch.load(weights_only=True)")


def _check_plain(obj: Any, where: str) -> None:
    if type(obj) in _PLAIN_LEAVES:
        return
    if isinstance(obj, dict) and type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}")


def save_checkpoint(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` with ``torch.save``, atomically (a temporary file in the same folder, then a rename).

    ``obj`` must hold only plain values (see :data:`_CHECKPOINT_CONTENT`), so
    that :func:`load_checkpoint` reads it back with ``weights_only=True``; a
    ``TypeError`` names the first value that is not.
    """
    try:
        _check_plain(obj, "checkpoint")
    except TypeError as exc:
        raise TypeError(f"{path}: cannot save {exc} ({_CHECKPOINT_CONTENT})") from None
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _legacy_numpy_globals() -> Any:
    """Checkpoints written before issue 16 held numpy's random state as a uint32 array: admit just that
    (``torch.serialization.safe_globals``, torch >= 2.5; older torch refuses such checkpoints)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        return contextlib.nullcontext()
    reconstruct = _numpy_attr("multiarray", "_reconstruct")()
    return safe_globals([reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))])


def load_checkpoint(path: str, map_location: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` with ``torch.load(weights_only=True)``.

    Anything but plain values (tensors, containers, numbers, strings; and the
    numpy random state of older runner checkpoints) is refused with
    :class:`UnsafeFileError` naming ``path`` and the refused global.
    """
    try:
        with _legacy_numpy_globals():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeFileError(f"{path}: {_weights_only_reason(str(exc))} ({_CHECKPOINT_CONTENT})") from None


def _weights_only_reason(msg: str) -> str:
    """The gist of torch's weights-only refusal (its wording varies between torch versions)."""
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    if m:
        return f"refusing to unpickle global '{m.group(1)}'"
    m = re.search(r"WeightsUnpickler error:\s*(.+)", msg)
    lines = [ln.strip() for ln in msg.splitlines()[1:] if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("(1)", "(2)", "Check the documentation"))]
    detail = m.group(1) if m else (lines[0] if lines else msg.strip())
    return f"refused by torch.load(weights_only=True): {detail}"


def numpy_rng_to_plain(state: tuple) -> Dict[str, Any]:
    """``np.random.get_state()`` as plain values (the key as an int64 tensor)."""
    kind, key, pos, has_gauss, cached = state
    return {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def numpy_rng_from_plain(state: Any) -> tuple:
    """Inverse of :func:`numpy_rng_to_plain`, for ``np.random.set_state``; a numpy state tuple passes through."""
    if isinstance(state, dict):
        key = state["key"].numpy().astype(np.uint32)
        return (state["kind"], key, state["pos"], state["has_gauss"], state["cached_gaussian"])
    return tuple(state)
