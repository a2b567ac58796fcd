"""A whitening layer's state outside training: checkpoints (the partial block as extra state, the rule's identity,
loading with checks for another method's, another rule's or a pre-release version's keys), pickling and copying,
scripting.

The rule's identity: a buffer, ``whitening_rule``, holds :func:`~whitenlayers.rules.rule_identity` (a JSON text: the
rule's name and its config's fields) as one byte per element, zero-padded to a width fixed when the layer is built
(at least :data:`IDENTITY_WIDTH`): a tensor whose shape a fresh layer of the same construction has, so that loaders
that shape the state from a fresh model (``torch.distributed.checkpoint``) load it, and that averaging the model's
buffers (EMA, SWA) or casting them to a low precision (bytes are exact in bf16) leaves it intact. It is written from
the layer's rule whenever a state dict is taken. Loading a checkpoint whose identity names another rule is an error
naming both (a warning with ``strict=False``); the same rule with other hyper-parameters loads, keeps the layer's
config, and warns once per difference. Part of :mod:`whitenlayers.layers`.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, cast

import torch
from torch import Tensor

from ..fold import FAILED, FOLDED, FoldOutcome, PendingFold
from ..rules import _BUILT_IN, rule_identity
from .step import _Layer, _StepCache

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


#: Layout tag of the packed extra state (:meth:`WhiteningLayer.get_extra_state`).
_EXTRA_LAYOUT = 2
#: The layout of a layer with a pending fold (an asynchronous fold in flight): layout 2's, then the fold.
_EXTRA_LAYOUT_PENDING = 3
#: The layout of a layer whose coordinator folds asynchronously (``fold_async``): layout 3's with the fold's part
#: always there, every buffer of the outcome layout included (zeros where the fold holds none; status
#: :data:`_NO_FOLD` where there is no pending fold), so that its size depends only on how the layer was built.
#: Loaders that load into tensors shaped by a fresh model (``torch.distributed.checkpoint``) need that.
_EXTRA_LAYOUT_SLOT = 4
#: The status of an empty pending-fold slot (layout 4).
_NO_FOLD = -1
_LAYOUTS = (_EXTRA_LAYOUT, _EXTRA_LAYOUT_PENDING, _EXTRA_LAYOUT_SLOT)
#: The scalar head of a pending fold, in order; then its new mean, mean change and next shift (``M`` each) and the
#: buffers its outcome holds (:meth:`~whitenlayers.stats.WhiteningLayer._outcome_layout`, the first ``kept``).
_PENDING_HEAD = ("status", "clamped", "unshifted", "nonfinite", "kept")
#: The scalar head of the packed extra state, in order; then ``shift (M)``, ``s1 (M)``, ``s2`` (block shape).
_EXTRA_HEAD = ("layout", "acc_batches", "has_shift", "transform_failures", "skipped_folds", "nonfinite_blocks",
               "clamped_steps", "acc_count", "stats_unshifted")
_COUNTERS = ("transform_failures", "skipped_folds", "nonfinite_blocks", "clamped_steps")
#: Set while :func:`~whitenlayers.load_plain_state_dict` loads a plain checkpoint into a converted model.
_loading_plain = [False]


@contextlib.contextmanager
def loading_plain_checkpoint() -> Iterator[None]:
    """While active, loading a plain layer's keys into a whitening layer is expected (no warning)."""
    before, _loading_plain[0] = _loading_plain[0], True
    try:
        yield
    finally:
        _loading_plain[0] = before


def _load_frame() -> Any:
    """The frame of the ``Module.load_state_dict`` call under way, or ``None`` (a loader of its own)."""
    frame = sys._getframe(2)
    code = torch.nn.Module.load_state_dict.__code__
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


#: The errors the layers reported for a checkpoint of another method or rule (a strict load), which
#: :func:`cause_first` puts first.
_CAUSES: Set[str] = set()


def _report_cause(msg: str, error_msgs: List[str], lenient: str) -> None:
    """A checkpoint of another method or rule: the error ``msg`` (a strict load, :func:`cause_first` puts it first),
    or, with ``strict=False``, a warning: ``msg`` and what the lenient load does (``lenient``).

    ``strict`` is that of the ``Module.load_state_dict`` call under way (PyTorch passes ``strict=True`` to every
    ``_load_from_state_dict`` and applies ``strict`` to the missing / unexpected keys afterwards); ``False`` where
    no such call is found (a loader of its own: warn, never fail a load PyTorch would accept)."""
    frame = _load_frame()
    if frame is not None and bool(frame.f_locals.get("strict", True)):
        _CAUSES.add(msg)
        error_msgs.append(msg)
    else:
        warnings.warn(msg + lenient, UserWarning, stacklevel=4)


def cause_first(module: Any, incompatible_keys: Any) -> None:
    """A converted model's ``load_state_dict`` post-hook: where its layers found a checkpoint of another method or
    rule (a strict load, which fails), the error leads with that cause and its fix, and the missing and unexpected
    keys (hundreds in a ResNet, all of them the other method's) are cut to a count and the first few."""
    frame = _load_frame()
    error_msgs = frame.f_locals.get("error_msgs") if frame is not None else None
    ours = [m for m in error_msgs if m in _CAUSES] if isinstance(error_msgs, list) else []
    _CAUSES.clear()
    if not ours or not isinstance(error_msgs, list):
        return
    def few(keys: List[str]) -> str:
        return f"{len(keys)}" + (f" ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else "")

    lead = ours[0] + (f" ({len(ours) - 1} more layer(s) alike)" if len(ours) > 1 else "")
    counts = (f"missing keys: {few(incompatible_keys.missing_keys)}; unexpected keys: "
              f"{few(incompatible_keys.unexpected_keys)}")
    rest = [m for m in error_msgs if m not in ours]
    error_msgs[:] = [lead, counts] + rest
    incompatible_keys.missing_keys.clear()  # (said in `counts`; the load fails either way)
    incompatible_keys.unexpected_keys.clear()


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
        # What a forward keeps between steps is made again (the step cache); the deferral's state is not copied (a
        # copy is stepped by no optimizer of the deferral, defer_grad_transform), nor is a direct wrapper's link.
        state["_cache"] = _StepCache()
        for transient in ("_deferral", "_wrapper"):
            state.pop(transient, None)
        return state

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

        Layout: the scalars ``_EXTRA_HEAD`` (a layout tag first), then the block's shift (``M``), first sums
        (``M``) and second sums (the block shape, flattened). A tensor, not a dict, so the state dict holds
        tensors only (EMA helpers, safetensors and exporters iterate over it as tensors); a fresh one at each
        call, owned by nobody. A layer with a pending fold (``fold_async``: this waits for a fold in flight) has
        layout tag 3 and the fold after the block: ``_PENDING_HEAD``, its new mean, mean change and next
        shift, and the buffers its outcome holds, so that a resume writes it where the run would have. A layer of
        a model converted with ``fold_async=True`` always has layout tag 4: layout 3's with room for every buffer
        of a fold, pending or not, so that the tensor's size depends only on how the layer was built
        (``torch.distributed.checkpoint`` loads into the tensors of a fresh model's ``state_dict``).
        """
        coordinator = self.__dict__.get("_fold_coordinator")
        if coordinator is not None:
            coordinator.flush_stats()
            coordinator.wait()  # a fold in flight: its result is the pending fold packed below
        pending = cast(Optional[PendingFold], self._pending_fold)
        block = self._block
        f64: Dict[str, Any] = {"dtype": torch.float64, "device": self.running_mean.device}
        slot = coordinator is not None and coordinator.fold_async
        layout = _EXTRA_LAYOUT_SLOT if slot else _EXTRA_LAYOUT if pending is None else _EXTRA_LAYOUT_PENDING
        head = torch.tensor([layout, block.batches, block.shift is not None]
                            + [getattr(self, name) for name in _COUNTERS] + [block.rows, block.unshifted], **f64)
        _, shift, s1, s2 = block.sums()
        parts = [head, shift, s1, s2.reshape(-1)]
        if pending is not None:
            outcome = cast(FoldOutcome, pending.outcome)
            layout_shapes = self._outcome_layout()
            kept = [name for name, _ in layout_shapes if name in outcome.buffers]
            parts += [torch.tensor([outcome.status, outcome.clamped, pending.unshifted, pending.nonfinite, len(kept)],
                                   **f64),
                      pending.mean, pending.delta, torch.zeros_like(pending.delta)]  # (once the next shift: unused)
            parts += [outcome.buffers[name].reshape(-1) for name in kept]
            if slot:  # the buffers the outcome does not hold (a failed fold keeps the transform): zeros
                parts += [torch.zeros(math.prod(shape), **f64) for _, shape in layout_shapes[len(kept):]]
        elif slot:
            size = 3 * self.num_features + sum(math.prod(shape) for _, shape in self._outcome_layout())
            parts += [torch.tensor([_NO_FOLD, 0, 0, 0, 0], **f64), torch.zeros(size, **f64)]
        return torch.cat([t.to(device=head.device, dtype=torch.float64) for t in parts])

    def set_extra_state(self, state: Tensor) -> None:
        """Restore the partial block and the counters (``load_state_dict`` calls this).

        Args:
            state: what :meth:`get_extra_state` returned (a float64 tensor).
        """
        self._wait_for_fold()  # a fold in flight is dropped: the checkpoint's state replaces it
        head, shift, s1, s2, pending = self._unpack_extra_state(state)
        block = self._block = self._new_block(self.running_mean.device)
        block.batches = int(head["acc_batches"])
        block.gather_next = block.batches % block.every == 0
        block.rows = head["acc_count"]
        block.unshifted = bool(head["stats_unshifted"])
        if head["has_shift"]:  # the block's shift, in the tensor a compiled forward reads
            block.store.copy_(shift)
            block.shift = block.store
        block.s1.copy_(s1)  # in the sums' own dtype (exact for sums the block had written)
        block.s2.copy_(s2)
        if block.acc is not None:  # the augmented accumulator's last row: s1 again and the row count
            block.acc[-1, :-1] = s1
            block.acc[-1, -1] = block.rows
        for name in _COUNTERS:
            setattr(self, name, int(head[name]))
        self._pending_fold = pending

    def _unpack_extra_state(self, packed: Tensor) -> Tuple[Dict[str, float], Tensor, Tensor, Tensor,
                                                          Optional[PendingFold]]:
        """The head (``_EXTRA_HEAD`` by name), the block's shift, first and second sums (the block shape) and the
        pending fold of a packed extra state, checked against this layer."""
        m, block = self.num_features, self._block_shape
        numel = len(_EXTRA_HEAD) + 2 * m + math.prod(block)
        if not isinstance(packed, Tensor) or packed.dim() != 1 or not packed.is_floating_point():
            raise RuntimeError(f"{self._describe()}: checkpoint extra state must be a 1-D float tensor (the partial "
                               f"block), but got {type(packed).__name__} {tuple(getattr(packed, 'shape', ()))}")
        if packed.numel() < len(_EXTRA_HEAD) or int(packed[0]) not in _LAYOUTS:
            raise RuntimeError(f"{self._describe()}: checkpoint extra state has an unknown layout "
                               f"(tag {float(packed[0]) if packed.numel() else None}, expected one of {_LAYOUTS})")
        pending = None
        if int(packed[0]) != _EXTRA_LAYOUT:
            pending = self._unpack_pending(packed[numel:], padded=int(packed[0]) == _EXTRA_LAYOUT_SLOT)
            packed = packed[:numel]
        if packed.numel() != numel:
            raise RuntimeError(
                f"{self._describe()}: checkpoint extra state holds {packed.numel()} values, but this layer needs "
                f"{numel}: block statistics of shape {block} ({_shape_words(block)}) for {m} features")
        head = dict(zip(_EXTRA_HEAD, packed[: len(_EXTRA_HEAD)].tolist()))
        shift, s1, s2 = torch.split(packed[len(_EXTRA_HEAD):], [m, m, math.prod(block)])
        return head, shift, s1, s2.view(block), pending

    def _unpack_pending(self, packed: Tensor, padded: bool = False) -> Optional[PendingFold]:
        """The pending fold of a layout-3 extra state (what follows the block), on this layer's device; ``padded``:
        layout 4's slot (every buffer of the outcome layout there; ``None`` for an empty slot)."""
        m, layout = self.num_features, self._outcome_layout()
        n_head = len(_PENDING_HEAD)
        head = packed[:n_head].tolist() if packed.numel() >= n_head else [-2, 0, 0, 0, -1]  # (too short: an error)
        status, clamped, unshifted, nonfinite, kept = (int(value) for value in head)  # _PENDING_HEAD
        sizes = [m, m, m] + [math.prod(shape) for _, shape in layout[: len(layout) if padded else max(kept, 0)]]
        if padded and status == _NO_FOLD and kept == 0 and packed.numel() == n_head + sum(sizes):
            return None
        expected = {FOLDED: len(layout), FAILED: 1}.get(status, 0)
        if kept != expected or packed.numel() != n_head + sum(sizes):
            raise RuntimeError(f"{self._describe()}: checkpoint extra state holds a pending fold of "
                               f"{packed.numel()} values that does not match this layer (status {status}, "
                               f"{kept} buffers for {m} features)")
        dev = self.running_mean.device
        values = [t.to(dev).clone() for t in torch.split(packed[n_head:], sizes)]
        buffers = {name: t.view(shape) for (name, shape), t in zip(layout[:kept], values[3:])}
        return PendingFold(FoldOutcome(status, bool(clamped), buffers), values[0].to(self.running_mean.dtype),
                           values[1], bool(unshifted), nonfinite)

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

    def _check_checkpoint_method(self, state_dict: Dict[str, Any], prefix: str, error_msgs: List[str]) -> None:
        """A checkpoint of another method (or of the plain model) in this layer's place: an error that names both
        (a strict load), or a warning (``strict=False``, where PyTorch would drop the other method's keys
        silently)."""
        (theirs, where), mine = self._checkpoint_method(state_dict, prefix), self.method
        # (a plain layer's keys at a direct wrapper's place: the wrapped layer's own check, missing keys)
        if theirs in (None, mine) or (theirs == "plain" and (_loading_plain[0] or mine == "direct")):
            return
        if theirs == "plain":
            msg = (f"{self._describe()}: the checkpoint holds a plain (unconverted) layer at '{where}', but this "
                   f"model's layer there is a '{mine}' whitening layer; load it with "
                   "wl.load_plain_state_dict(model, state_dict)")
        else:
            msg = (f"{self._describe()}: the checkpoint holds a '{theirs}' whitening layer at '{where}', but this "
                   f"model's layer there is '{mine}'; convert the model with method={theirs!r} before loading")
        _report_cause(msg, error_msgs, " (strict=False: the whitening state of the other method is not loaded; only "
                                       "keys with the same names are)")

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
        state_dict = self._checked_rule_identity(state_dict, prefix, error_msgs)
        self._wait_for_fold()  # a fold in flight reads the buffers this writes (set_extra_state then replaces it)
        self._check_checkpoint_method(state_dict, prefix, error_msgs)
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
        self._state_changed()
        self.__dict__["_identity_of"] = None  # the buffer holds what was loaded: written again at the next save

    def _checked_rule_identity(self, state_dict: Dict[str, Any], prefix: str, error_msgs: List[str]
                               ) -> Dict[str, Any]:
        """The checkpoint ``state_dict`` as this layer loads it: the identity checked against the layer's rule (an
        error naming both for another rule, see the module docstring) and replaced by the layer's own, or added
        where the checkpoint has none but holds this layer's other keys (a plain checkpoint)."""
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
            _report_cause(msg, error_msgs, " (strict=False: loaded into this layer's rule anyway)")
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
        return f"groups={shape[0]} of {shape[1]} features"
    return "groups=1" if len(shape) == 2 else "unknown layout"
