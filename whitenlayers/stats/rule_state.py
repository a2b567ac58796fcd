"""The rule's identity in a layer's checkpoint: its name and config, saved beside the state, checked on load.

A buffer, ``whitening_rule``, holds :func:`~whitenlayers.rules.rule_identity` (a JSON text: the rule's name and
its config's fields) as one byte per element, zero-padded to a width fixed when the layer is built (at least
:data:`IDENTITY_WIDTH`): a tensor whose shape a fresh layer of the same construction has, so that loaders that
shape the state from a fresh model (``torch.distributed.checkpoint``) load it, and that averaging the model's
buffers (EMA, SWA: equal values average to themselves) or casting them to a low precision (bytes are exact in
bf16) leaves it intact. It is written from the layer's rule whenever a state dict is taken.

Loading a checkpoint whose identity names another rule is an error naming both (a warning with
``strict=False``, the layer's own identity kept); the same rule with other hyper-parameters loads, keeps the
layer's config, and warns once per difference. A checkpoint without it (a plain layer's, or of a version that had
none) loads as before. Part of :mod:`whitenlayers.stats`.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from ..rules import _BUILT_IN, rule_identity
from .state_io import _StateIOMixin, _strict_load

__all__ = ["IDENTITY_BUFFER", "IDENTITY_WIDTH", "encode_identity", "decode_identity"]

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
    try:
        data = [int(v) for v in values.detach().to("cpu", torch.float64).tolist()]
    except (ValueError, OverflowError):  # NaN, Inf
        return None
    if any(v < 0 or v > 255 for v in data):
        return None
    end = data.index(0) if 0 in data else len(data)
    if any(data[end:]):
        return None
    try:
        return bytes(data[:end]).decode("utf-8")
    except UnicodeDecodeError:
        return None


class _RuleStateMixin(_StateIOMixin):
    """The ``whitening_rule`` buffer of :class:`~whitenlayers.WhiteningLayer` (this module's docstring)."""

    def _register_rule_identity(self) -> None:
        """Register the identity buffer (once, when the layer is built), in the statistics' dtype and device."""
        text = rule_identity(self.rule)
        mean = self.running_mean
        self.register_buffer(IDENTITY_BUFFER, encode_identity(text, dtype=mean.dtype, device=mean.device))
        self.__dict__["_identity_of"] = (self.rule, text)

    def _refresh_rule_identity(self, force: bool = False) -> None:
        """Write the rule's identity into the buffer when the rule changed since it was written (a new config), or
        always (``force``: after a load or ``to_empty``, which leave other values there)."""
        written = self.__dict__.get("_identity_of")
        if not force and written is not None and written[0] is self.rule:
            return
        buf = self._buffers.get(IDENTITY_BUFFER)
        if buf is None:  # a layer pickled before the identity existed
            self._register_rule_identity()
            return
        text = rule_identity(self.rule)
        width = max(buf.numel(), _width(text))
        value = encode_identity(text, width, dtype=buf.dtype, device=buf.device)
        with torch.no_grad():
            if value.shape == buf.shape:
                buf.copy_(value)
            else:
                self._buffers[IDENTITY_BUFFER] = value
        self.__dict__["_identity_of"] = (self.rule, text)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._refresh_rule_identity()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        state_dict = self._checked_rule_identity(state_dict, prefix, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.__dict__["_identity_of"] = None  # the buffer holds what was loaded: written again at the next save

    def _checked_rule_identity(self, state_dict: Dict[str, Any], prefix: str, error_msgs: List[str]
                               ) -> Dict[str, Any]:
        """The checkpoint ``state_dict`` as this layer loads it: the identity checked against the layer's rule (an
        error naming both for another rule, see the module docstring) and replaced by the layer's own, or added
        where the checkpoint has none but holds this layer's other keys (a plain or an older checkpoint)."""
        key = prefix + IDENTITY_BUFFER
        self._refresh_rule_identity()
        mine = self._buffers[IDENTITY_BUFFER]
        if key not in state_dict:
            if not any(k.startswith(prefix) for k in state_dict):
                return state_dict  # nothing of this layer: reported missing, as the other keys
            return {**state_dict, key: mine.detach().clone()}
        text = decode_identity(state_dict[key])
        own = rule_identity(self.rule)
        where = prefix[:-1] or "<root>"
        try:
            theirs = json.loads(text) if text is not None else None
        except ValueError:
            theirs = None
        if not isinstance(theirs, dict) or not isinstance(theirs.get("rule"), str):
            error_msgs.append(f"{self._describe()}: checkpoint '{key}' does not hold a rule identity (a byte-encoded "
                              f"JSON object naming the rule), but got a tensor of shape "
                              f"{tuple(getattr(state_dict[key], 'shape', ()))}")
            return state_dict
        ours = json.loads(own)
        kept = {**state_dict, key: mine.detach().clone()}
        method = self._checkpoint_method(state_dict, prefix)[0]
        if method not in (None, "plain", self._method_name()) and type(self.rule) in _BUILT_IN:
            return kept  # another method's built-in rule: the method check's message says it (state_io)
        if theirs["rule"] != ours["rule"]:
            msg = (f"{self._describe()}: the checkpoint at '{where}' was saved with the rule {theirs['rule']!r}, but "
                   f"this layer's rule is {ours['rule']!r} ({type(self.rule).__name__}); build the model with "
                   f"rule={theirs['rule']!r} (convert_model(..., rule=...)) before loading it")
            if _strict_load():
                error_msgs.append(msg)
            else:
                warnings.warn(msg + " (strict=False: loaded into this layer's rule anyway)", UserWarning,
                              stacklevel=4)
            return kept
        differ = [f"{name}={theirs.get(name)!r} (this layer: {value!r})" for name, value in ours.items()
                  if name != "rule" and theirs.get(name) != value]
        if differ:
            what = ", ".join(differ)
            if (ours["rule"], what) not in _warned_differences:
                _warned_differences.add((ours["rule"], what))
                warnings.warn(f"{self._describe()}: the checkpoint at '{where}' was saved with the rule "
                              f"{ours['rule']!r} and {what}; the layer keeps its own hyper-parameters (assign "
                              "layer.config to change them). Said once for every layer with this difference",
                              UserWarning, stacklevel=4)
        return kept
