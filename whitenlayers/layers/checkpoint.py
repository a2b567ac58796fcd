"""A whitening layer's state outside training: checkpoints (the partial block as extra state, the rule's identity,
loading with checks for another method's, another rule's or a pre-release version's keys), pickling and copying,
scripting.

The rule's identity: a buffer, ``whitening_rule``, holds :func:`~whitenlayers.rules.rule_identity` (a JSON text: the
rule's name and its config's fields) as one byte per element, zero-padded to a width fixed when the layer is built
(at least :data:`IDENTITY_WIDTH`): a tensor whose shape a fresh layer of the same construction has, so that loaders
that shape the state from a fresh model (``torch.distributed.checkpoint``) load it, and that averaging the model's
buffers (EMA, SWA) or casting them to a low precision (bytes are exact in bf16) leaves it intact. It is written from
the layer's rule whenever a state dict is taken. Loading a checkpoint whose identity names another rule warns naming
both, and the identity is an unexpected key (a strict load fails on it); the same rule with other hyper-parameters
loads, keeps the layer's config, and warns once per difference. A checkpoint of another method warns alike, its
keys missing and unexpected (:func:`_report_cause`: PyTorch tells a layer no caller's ``strict``).

The extra state (the partial block, the counters, a pending fold) is one float64 tensor whose values are named by
tables of :class:`Entry` (name, shape, dtype): :func:`_block_table` and :func:`_pending_table`, which
:func:`_write` and :func:`_read` follow both ways. Part of :mod:`whitenlayers.layers`.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import warnings
from typing import Any, Dict, Iterator, List, NamedTuple, NoReturn, Optional, Sequence, Set, Tuple, cast

import torch
from torch import Tensor

from ..fold import FAILED, FOLDED, FoldOutcome, PendingFold
from ..rules import _BUILT_IN, rule_identity
from .step import Reads, _Layer

__all__ = ["IDENTITY_BUFFER", "IDENTITY_WIDTH", "encode_identity", "decode_identity", "loading_plain_checkpoint"]


#: The buffer that holds the rule's identity.
IDENTITY_BUFFER = "whitening_rule"
#: The least width of the identity buffer (elements, one byte each); a longer identity takes the next multiple.
#: The built-in rules' identities take under 300 bytes, so that a config changed after the layer was built keeps
#: the buffer's shape (which a loader that shapes the state from a fresh model needs).
IDENTITY_WIDTH = 512
#: Hyper-parameter differences already warned about (one warning per difference, not one per layer).
_warned_differences: Set[Tuple[str, str]] = set()


def _width(text: str) -> int:
    n = len(text.encode("utf-8"))
    return max(IDENTITY_WIDTH, -(-n // IDENTITY_WIDTH) * IDENTITY_WIDTH)


def encode_identity(text: str, width: Optional[int] = None, **factory: Any) -> Tensor:
    """``text`` (UTF-8) as a 1-D tensor of its bytes, zero-padded to ``width`` (default: the least multiple of
    :data:`IDENTITY_WIDTH` that holds it); ``factory``: ``dtype`` (default float32) and ``device``.

    Example:
        >>> decode_identity(encode_identity('{"rule":"evd"}'))
        '{"rule":"evd"}'
    """
    data = list(text.encode("utf-8"))
    width = _width(text) if width is None else width
    if len(data) > width:
        raise ValueError(f"a rule identity of {len(data)} bytes does not fit in width={width}")
    factory.setdefault("dtype", torch.float32)
    return torch.tensor(data + [0] * (width - len(data)), **factory)


def decode_identity(values: Any) -> Optional[str]:
    """The text :func:`encode_identity` wrote into ``values``; ``None`` when ``values`` is not such an encoding (not
    a 1-D tensor of bytes followed by zeros, not UTF-8)."""
    if not isinstance(values, Tensor) or values.dim() != 1:
        return None
    try:  # ValueError: NaN, a byte outside 0..255 (bytes), not UTF-8; OverflowError: Inf
        data = [int(v) for v in values.detach().to("cpu", torch.float64).tolist()]
        end = data.index(0) if 0 in data else len(data)
        return None if any(data[end:]) else bytes(data[:end]).decode("utf-8")
    except (ValueError, OverflowError):
        return None


class Entry(NamedTuple):
    """One value of the extra state's table: its name, shape (``()``: a scalar) and the dtype it is read back as
    (the tensor holds every value as float64: exact for the counters, flags and float64 sums)."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _scalars(*names: str, dtype: torch.dtype = torch.int64) -> Tuple[Entry, ...]:
    return tuple(Entry(name, (), dtype) for name in names)


#: The layouts of the extra state (its first value): 2, the block alone; 3, a layer with a pending fold (an
#: asynchronous fold in flight): the block, then the fold; 4, a layer whose coordinator folds asynchronously
#: (``fold_async``): layout 3's with the fold's part always there, every buffer of the outcome layout included
#: (zeros where the fold holds none; status :data:`_NO_FOLD` where there is no pending fold), so that its size
#: depends only on how the layer was built (loaders that load into tensors shaped by a fresh model,
#: ``torch.distributed.checkpoint``, need that).
_EXTRA_LAYOUT = 2
_EXTRA_LAYOUT_PENDING = 3
_EXTRA_LAYOUT_SLOT = 4
_LAYOUTS = (_EXTRA_LAYOUT, _EXTRA_LAYOUT_PENDING, _EXTRA_LAYOUT_SLOT)
#: The status of an empty pending-fold slot (layout 4).
_NO_FOLD = -1
_COUNTERS = ("transform_failures", "skipped_folds", "nonfinite_blocks", "clamped_steps")
#: The extra state's head, in order; then the block's shift, first sums (``M`` each) and second sums (the block
#: shape): :func:`_block_table`.
_EXTRA_HEAD = (_scalars("layout", "acc_batches") + _scalars("has_shift", dtype=torch.bool) + _scalars(*_COUNTERS)
               + _scalars("acc_count", dtype=torch.float64) + _scalars("stats_unshifted", dtype=torch.bool))
#: A pending fold's head, in order; then its new mean, mean change and next shift (``M`` each; the next shift is
#: unused, zeros) and the buffers its outcome holds (``kept`` of :meth:`~WhiteningLayer.outcome_layout`):
#: :func:`_pending_table`.
_PENDING_HEAD = (_scalars("status") + _scalars("clamped", "unshifted", dtype=torch.bool)
                 + _scalars("nonfinite", "kept"))


def _block_table(m: int, block: Tuple[int, ...]) -> Tuple[Entry, ...]:
    """The table of the extra state's block part, for ``m`` features and block statistics of shape ``block``."""
    return _EXTRA_HEAD + tuple(Entry(name, shape, torch.float64) for name, shape in
                               (("shift", (m,)), ("s1", (m,)), ("s2", block)))


def _pending_table(m: int, buffers: Sequence[Tuple[str, Tuple[int, ...]]]) -> Tuple[Entry, ...]:
    """The table of a pending fold, for ``m`` features and the outcome's ``buffers`` (name, shape)."""
    vectors = [(name, (m,)) for name in ("mean", "delta", "next_shift")]
    return _PENDING_HEAD + tuple(Entry(name, tuple(shape), torch.float64) for name, shape in (*vectors, *buffers))


def _numel(table: Sequence[Entry]) -> int:
    return sum(math.prod(entry.shape) for entry in table)


def _write(table: Sequence[Entry], values: Dict[str, Any], device: Any) -> Tensor:
    """``values`` (by name) as one float64 tensor on ``device``, in the order of ``table`` (its scalars first: one
    tensor for them)."""
    scalars = list(itertools.takewhile(_is_scalar, table))
    head = torch.tensor([float(values[entry.name]) for entry in scalars], dtype=torch.float64, device=device)
    return torch.cat([head] + [values[entry.name].to(device=device, dtype=torch.float64).reshape(-1)
                               for entry in table[len(scalars):]])


def _read(table: Sequence[Entry], packed: Tensor) -> Dict[str, Any]:
    """The values of ``table`` in ``packed`` (exactly :func:`_numel` long) by name: the leading scalars as Python
    numbers of their dtype (read to the host together), the tensors as views shaped by their entry."""
    scalars = list(itertools.takewhile(_is_scalar, table))
    values: Dict[str, Any] = {entry.name: _PYTHON_TYPE[entry.dtype](number)
                              for entry, number in zip(scalars, packed[: len(scalars)].tolist())}
    rest = table[len(scalars):]
    parts = torch.split(packed[len(scalars):], [math.prod(entry.shape) for entry in rest])
    values.update((entry.name, part.view(entry.shape)) for entry, part in zip(rest, parts))
    return values


def _is_scalar(entry: Entry) -> bool:
    return not entry.shape


_PYTHON_TYPE = {torch.int64: int, torch.bool: bool, torch.float64: float}

#: Set while :func:`~whitenlayers.load_plain_state_dict` loads a plain checkpoint into a converted model.
_loading_plain = False


@contextlib.contextmanager
def loading_plain_checkpoint() -> Iterator[None]:
    """While active, loading a plain layer's keys into a whitening layer is expected (no warning)."""
    global _loading_plain
    before, _loading_plain = _loading_plain, True
    try:
        yield
    finally:
        _loading_plain = before


def _report_cause(msg: str, lenient: str) -> None:
    """A checkpoint of another method or rule in a layer's place: a warning, ``msg`` and what a lenient load does
    (``lenient``).

    Whether the load is strict is not known here: PyTorch passes ``strict=True`` to every ``_load_from_state_dict``
    and applies the caller's ``strict`` to the missing and unexpected keys afterwards, and tells no hook. So the
    mismatch is told through those keys (the other method's are unexpected, this one's missing; another rule's
    identity is unexpected): a strict load fails on them, a lenient one loads the keys that match; and the cause is
    this warning, either way."""
    warnings.warn(msg + " (a strict load fails on the keys that do not match; with strict=False" + lenient + ")",
                  UserWarning, stacklevel=4)


def cause_first(module: Any, incompatible_keys: Any) -> None:
    """Formerly the converted model's ``load_state_dict`` post-hook that put the cause of a failed load first; the
    layers now warn with the cause (:func:`_report_cause`), and :func:`~whitenlayers.convert_model` registers it no
    more. Kept so that a model pickled with the hook loads."""


#: Buffers only a recursive layer has (they tell a recursive checkpoint from a grad one).
_RECURSIVE_KEYS = ("running_cov_whitened", "running_power", "whitening_gram")

class _CheckpointMixin(_Layer):
    """Checkpoints, pickling and scripting of :class:`~whitenlayers.WhiteningLayer` (this module's docstring)."""

    # 2: the partial block is one tensor in ``_extra_state``; grad layers with a bias keep their bias compensation
    # in ``bias_correction``. Checkpoints of an older version (pre-release) are refused.
    _version = 2

    def __getstate__(self) -> Dict[str, Any]:
        self._wait_for_fold()  # a fold in flight: its result is the layer's pending fold, copied with it
        state = dict(self.__dict__)
        # What the forwards read is taken again (the copies); the deferral's state is not copied (a copy is stepped
        # by no optimizer of the deferral, defer_grad_transform), nor is a direct wrapper's link.
        state["_reads"] = Reads()
        for transient in ("_deferral", "_wrapper"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = {k: v for k, v in state.items() if k != "_cache"}  # (a layer pickled before the copies were Reads)
        super().__setstate__({"_reads": Reads(), **state})

    def __prepare_scriptable__(self) -> Any:
        raise RuntimeError(
            f"{self._describe()}: torch.jit.script cannot compile a whitening layer (its forward gathers statistics "
            "and folds blocks in Python). To deploy, script the plain model: "
            "torch.jit.script(wl.to_plain_model(copy.deepcopy(model)).eval()); to trace or compile the converted model "
            "use torch.jit.trace, torch.export.export or torch.compile")

    # ---------------------------------------------------------- checkpointing
    def _wait_for_fold(self) -> None:
        """Wait for an asynchronous fold in flight (the coordinator's), which makes it this layer's pending fold."""
        coordinator = self.__dict__.get("_fold_coordinator")  # (None too while a pickle is being restored)
        if coordinator is not None:
            coordinator.wait()

    def get_extra_state(self) -> Tensor:
        """The partial block and the counters as one float64 tensor, so a mid-block checkpoint resumes bit-for-bit.

        Its values are those of the tables :func:`_block_table` (the scalars ``_EXTRA_HEAD``, a layout tag first, then
        the block's shift, first sums and second sums) and, for a layer with a pending fold (``fold_async``: this
        waits for a fold in flight), :func:`_pending_table` after it (layout tag 3: ``_PENDING_HEAD``, its new mean,
        mean change and next shift, and the buffers its outcome holds), so that a resume writes the fold where the
        run would have. A layer of a model converted with ``fold_async=True`` always has layout tag 4: layout 3's
        with room for every buffer of a fold, pending or not, so that the tensor's size depends only on how the layer
        was built (``torch.distributed.checkpoint`` loads into the tensors of a fresh model's ``state_dict``). A
        tensor, not a dict, so the state dict holds tensors only (EMA helpers, safetensors and exporters iterate over
        it as tensors); a fresh one at each call, owned by nobody.
        """
        self._wait_for_fold()  # a fold in flight: its result is the pending fold written below
        coordinator = self.__dict__.get("_fold_coordinator")
        pending = cast(Optional[PendingFold], self._pending_fold)
        block = self._block
        device = self.running_mean.device
        slot = coordinator is not None and coordinator.fold_async
        _, shift, s1, s2 = block.sums()
        values: Dict[str, Any] = {
            "layout": _EXTRA_LAYOUT_SLOT if slot else _EXTRA_LAYOUT if pending is None else _EXTRA_LAYOUT_PENDING,
            "acc_batches": block.batches, "has_shift": block.shift is not None, "acc_count": block.rows,
            "stats_unshifted": block.unshifted, "shift": shift, "s1": s1, "s2": s2,
            **{name: getattr(self, name) for name in _COUNTERS}}
        parts = [_write(_block_table(self.num_features, self._block_shape), values, device)]
        if pending is not None or slot:
            outcome = FoldOutcome(_NO_FOLD) if pending is None else cast(FoldOutcome, pending.outcome)
            layout = self.outcome_layout()
            kept = [(name, shape) for name, shape in layout if name in outcome.buffers]
            zeros = torch.zeros(self.num_features, dtype=torch.float64, device=device)
            fold: Dict[str, Any] = {"status": outcome.status, "clamped": outcome.clamped, "kept": len(kept),
                                    "unshifted": False, "nonfinite": 0, "mean": zeros, "delta": zeros,
                                    "next_shift": zeros}  # (once the next block's shift: unused)
            if pending is not None:
                fold.update(unshifted=pending.unshifted, nonfinite=pending.nonfinite, mean=pending.mean,
                            delta=pending.delta)
            # layout 4: the buffers the outcome does not hold (no fold, a failed fold keeps the transform) as zeros
            fold.update({name: torch.zeros(shape) for name, shape in layout}, **outcome.buffers)
            parts.append(_write(_pending_table(self.num_features, layout if slot else kept), fold, device))
        return torch.cat(parts)

    def set_extra_state(self, state: Tensor) -> None:
        """Restore the partial block and the counters (``load_state_dict`` calls this).

        Args:
            state: what :meth:`get_extra_state` returned (a float64 tensor).
        """
        self._wait_for_fold()  # a fold in flight is dropped: the checkpoint's state replaces it
        values, pending = self._unpack_extra_state(state)
        block = self._block = self._new_block(self.running_mean.device)
        block.batches = values["acc_batches"]
        block.gather_next = block.batches % block.every == 0
        block.rows = values["acc_count"]
        block.unshifted = values["stats_unshifted"]
        if values["has_shift"]:  # the block's shift, in the tensor a compiled forward reads
            block.store.copy_(values["shift"])
            block.shift = block.store
        block.s1.copy_(values["s1"])  # in the sums' own dtype (exact for sums the block had written)
        block.s2.copy_(values["s2"])
        if block.acc is not None:  # the augmented accumulator's last row: s1 again and the row count
            block.acc[-1, :-1] = values["s1"]
            block.acc[-1, -1] = block.rows
        for name in _COUNTERS:
            setattr(self, name, values[name])
        self._pending_fold = pending

    def _unpack_extra_state(self, packed: Tensor) -> Tuple[Dict[str, Any], Optional[PendingFold]]:
        """The values of a packed extra state's block part by name (:func:`_block_table`) and its pending fold,
        checked against this layer."""
        m, block = self.num_features, self._block_shape
        table = _block_table(m, block)
        numel = _numel(table)
        if not isinstance(packed, Tensor) or packed.dim() != 1 or not packed.is_floating_point():
            raise RuntimeError(f"{self._describe()}: checkpoint extra state must be a 1-D float tensor (the partial "
                               f"block), but got {type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}")
        layout = _read(table[:1], packed[:1])["layout"] if packed.numel() else None
        if packed.numel() < len(_EXTRA_HEAD) or layout not in _LAYOUTS:
            raise RuntimeError(f"{self._describe()}: checkpoint extra state has an unknown layout "
                               f"(tag {float(packed[:1]) if packed.numel() else None}, expected one of {_LAYOUTS})")
        pending = None
        if layout != _EXTRA_LAYOUT:
            pending = self._unpack_pending(packed[numel:], padded=layout == _EXTRA_LAYOUT_SLOT)
            packed = packed[:numel]
        if packed.numel() != numel:
            raise RuntimeError(
                f"{self._describe()}: checkpoint extra state holds {packed.numel()} values, but this layer needs "
                f"{numel}: block statistics of shape {block} ({_shape_words(block)}) for {m} features")
        return _read(table, packed), pending

    def _unpack_pending(self, packed: Tensor, padded: bool = False) -> Optional[PendingFold]:
        """The pending fold of a layout-3 extra state (what follows the block), on this layer's device; ``padded``:
        layout 4's slot (every buffer of the outcome layout there; ``None`` for an empty slot)."""
        m, layout = self.num_features, self.outcome_layout()
        n_head = len(_PENDING_HEAD)
        if packed.numel() < n_head:
            self._pending_mismatch(packed, None, None)
        head = _read(_PENDING_HEAD, packed[:n_head])
        status, kept = head["status"], head["kept"]
        table = _pending_table(m, layout if padded else layout[: max(kept, 0)])
        if padded and status == _NO_FOLD and kept == 0 and packed.numel() == _numel(table):
            return None
        if kept != {FOLDED: len(layout), FAILED: 1}.get(status, 0) or packed.numel() != _numel(table):
            self._pending_mismatch(packed, status, kept)
        dev = self.running_mean.device
        values = {name: value.to(dev).clone() if isinstance(value, Tensor) else value
                  for name, value in _read(table, packed).items()}
        buffers = {name: values[name] for name, _ in layout[:kept]}
        return PendingFold(FoldOutcome(status, head["clamped"], buffers), values["mean"].to(self.running_mean.dtype),
                           values["delta"], head["unshifted"], head["nonfinite"])

    def _pending_mismatch(self, packed: Tensor, status: Optional[int], kept: Optional[int]) -> NoReturn:
        raise RuntimeError(f"{self._describe()}: checkpoint extra state holds a pending fold of {packed.numel()} "
                           f"values that does not match this layer (status {status}, {kept} buffers for "
                           f"{self.num_features} features)")

    def _checkpoint_method(self, state_dict: Dict[str, Any], prefix: str) -> Tuple[Optional[str], str]:
        """What the checkpoint holds in this layer's place, and where: ``"grad"``, ``"recursive"``, ``"direct"``,
        ``"plain"`` (an unconverted layer) or ``None`` (nothing there). A direct layer sits at ``<name>.whiten.``,
        a grad or recursive one at ``<name>.`` (PyTorch hands a module only the keys under its prefix: the direct
        wrapper checks for its whitening layer, :class:`~whitenlayers.DirectWhitenWrapper`)."""
        place = prefix[: -len("whiten.")] if self.method == "direct" and prefix.endswith("whiten.") else prefix
        where = place[:-1] or "<root>"
        for found in (place, place + "whiten."):
            if any(found + name in state_dict for name in _RECURSIVE_KEYS):
                return "recursive", where
            if found + "grad_transform" in state_dict:
                return "grad", where
            if found + "whitening_matrix" in state_dict:
                return "direct", where
        if place + "weight" in state_dict:
            return "plain", where
        return None, where

    def _check_checkpoint_method(self, state_dict: Dict[str, Any], prefix: str) -> None:
        """A checkpoint of another method (or of the plain model) in this layer's place: a warning that names both
        (:func:`_report_cause`: a strict load then fails on the other method's keys, a lenient one would drop them
        silently)."""
        (theirs, where), mine = self._checkpoint_method(state_dict, prefix), self.method
        # (a plain layer's keys at a direct wrapper's place: the wrapped layer's own check, missing keys)
        if theirs in (None, mine) or (theirs == "plain" and (_loading_plain or mine == "direct")):
            return
        if theirs == "plain":
            msg = (f"{self._describe()}: the checkpoint holds a plain (unconverted) layer at '{where}', but this "
                   f"model's layer there is a '{mine}' whitening layer; load it with "
                   "wl.load_plain_state_dict(model, state_dict)")
        else:
            msg = (f"{self._describe()}: the checkpoint holds a '{theirs}' whitening layer at '{where}', but this "
                   f"model's layer there is '{mine}'; convert the model with method={theirs!r} before loading")
        _report_cause(msg, ": the whitening state of the other method is not loaded; only keys with the same names "
                           "are")

    # ------------------------------------------------------------ the rule's identity
    def _identity_value(self, device: Any = None) -> Tensor:
        """The rule's identity as the buffer holds it: in its dtype, on its device (or ``device``), as wide as it is
        or as the identity needs; in the statistics' dtype and on their device before the buffer exists."""
        text = rule_identity(self.rule)
        buf = self._buffers.get(IDENTITY_BUFFER)
        like = self.running_mean if buf is None else buf
        width = _width(text) if buf is None else max(buf.numel(), _width(text))
        return encode_identity(text, width, dtype=like.dtype, device=like.device if device is None else device)

    def _refresh_rule_identity(self, force: bool = False) -> None:
        """Write the rule's identity into the buffer (registered when the layer is built) when the rule changed since
        it was written (a new config), or always (``force``: after a load or ``to_empty``, which leave other values
        there)."""
        if not force and self.__dict__.get("_identity_of") is self.rule:
            return
        buf = self._buffers.get(IDENTITY_BUFFER)
        value = self._identity_value()
        if buf is None:  # the layer being built (or one pickled before the identity existed)
            self.register_buffer(IDENTITY_BUFFER, value)
        elif value.shape == buf.shape:
            with torch.no_grad():
                buf.copy_(value)
        else:
            self._buffers[IDENTITY_BUFFER] = value
        self.__dict__["_identity_of"] = self.rule

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._refresh_rule_identity()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """The checks of a checkpoint of this layer (its rule, method, version and sizes), then ``nn.Module``'s load."""
        state_dict = self._checked_rule_identity(state_dict, prefix, unexpected_keys, error_msgs)
        self._wait_for_fold()  # a fold in flight reads the buffers this writes (set_extra_state then replaces it)
        self._check_checkpoint_method(state_dict, prefix)
        version = local_metadata.get("version")
        m, block = self.num_features, self._block_shape
        mkey, ckey = prefix + "running_mean", prefix + "running_cov"
        error = None
        # An older version's layer of this method (a plain layer or a direct wrapper in its place has nn.Module's 1)
        if (version is not None and version < self._version
                and self._checkpoint_method(state_dict, prefix)[0] == self.method):
            error = (f"this checkpoint was written by a pre-release whitenlayers (version {version}); it cannot be "
                     "loaded")
        elif mkey in state_dict and state_dict[mkey].shape != (m,):
            error = f"checkpoint has {state_dict[mkey].shape[0]} features in '{mkey}', but this layer has {m}"
        elif ckey in state_dict and tuple(state_dict[ckey].shape) != block:
            shape = tuple(state_dict[ckey].shape)
            error = (f"checkpoint '{ckey}' has shape {shape} ({_shape_words(shape)}), but this layer needs {block} "
                     f"({_shape_words(block)})")
        if error is not None:  # (nothing of this layer loaded)
            error_msgs.append(f"{self._describe()}: {error}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._reads.dropped()  # (torch wrote the buffers)
        self.__dict__["_identity_of"] = None  # the buffer holds what was loaded: written again at the next save

    def _checked_rule_identity(self, state_dict: Dict[str, Any], prefix: str, unexpected_keys: List[str],
                               error_msgs: List[str]) -> Dict[str, Any]:
        """The checkpoint ``state_dict`` as this layer loads it: the identity checked against the layer's rule
        (another rule's: a warning naming both and the checkpoint's identity in ``unexpected_keys``, on which a
        strict load fails) and replaced by the layer's own, or added where the checkpoint has none but holds this
        layer's other keys (a plain checkpoint)."""
        key = prefix + IDENTITY_BUFFER
        self._refresh_rule_identity()
        # ``mine`` on the checkpoint's device where it is a real one (a model built on meta loads real tensors)
        like = state_dict.get(key, state_dict.get(prefix + "running_mean"))
        mine = self._identity_value(like.device if isinstance(like, Tensor) and not like.is_meta else None)
        if key not in state_dict:
            if not any(k.startswith(prefix) for k in state_dict):
                return state_dict  # nothing of this layer: reported missing, as the other keys
            return {**state_dict, key: mine}
        where = prefix[:-1] or "<root>"
        try:
            theirs = json.loads(decode_identity(state_dict[key]) or "")  # (not an identity: "", a ValueError)
        except ValueError:
            theirs = None
        if not isinstance(theirs, dict) or not isinstance(theirs.get("rule"), str):
            error_msgs.append(f"{self._describe()}: checkpoint '{key}' does not hold a rule identity (a byte-encoded "
                              f"JSON object naming the rule), but got a tensor of shape "
                              f"{tuple(getattr(state_dict[key], 'shape', ()))}")
            return state_dict
        ours = json.loads(rule_identity(self.rule))
        kept = {**state_dict, key: mine}
        method = self._checkpoint_method(state_dict, prefix)[0]
        if method not in (None, "plain", self.method) and type(self.rule) in _BUILT_IN:
            return kept  # another method's built-in rule: the method check's message says it (state_io)
        if theirs["rule"] != ours["rule"]:
            msg = (f"{self._describe()}: the checkpoint at '{where}' was saved with the rule {theirs['rule']!r}, but "
                   f"this layer's rule is {ours['rule']!r} ({type(self.rule).__name__}); build the model with "
                   f"rule={theirs['rule']!r} (convert_model(..., rule=...)) before loading it")
            _report_cause(msg, ": loaded into this layer's rule anyway")
            unexpected_keys.append(key)
            return kept
        what = ", ".join(f"{name}={theirs.get(name)!r} (this layer: {value!r})" for name, value in ours.items()
                         if name != "rule" and theirs.get(name) != value)
        if what and (ours["rule"], what) not in _warned_differences:
            _warned_differences.add((ours["rule"], what))
            warnings.warn(f"{self._describe()}: the checkpoint at '{where}' was saved with the rule "
                          f"{ours['rule']!r} and {what}; the layer keeps its own hyper-parameters (assign "
                          "layer.config to change them). Said once for every layer with this difference",
                          UserWarning, stacklevel=4)
        return kept


def _shape_words(shape: tuple) -> str:
    """What a per-group matrix shape means, for error messages."""
    if len(shape) == 3:
        groups, features, _ = shape
        return f"groups={groups} of {features} features"
    return "groups=1" if len(shape) == 2 else "unknown layout"
