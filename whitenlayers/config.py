"""Whitening hyper-parameters: one frozen dataclass per transform rule, the single source of their defaults.

:class:`EVDConfig` (``grad`` and ``direct`` layers) and :class:`RecursiveConfig`
(``recursive`` layers) carry the paper's symbols with its experimental values
as defaults, and validate themselves on construction (``ValueError`` naming the
argument; ``docs/PAPER.md``, "Hyper-parameters"). The layers' keyword arguments, ``convert_model``'s
keyword checks and the experiment runner's flags and help are all derived from
the fields below (each field's ``metadata`` holds its help text).

Example:
    >>> from whitenlayers.config import EVDConfig, RecursiveConfig
    >>> EVDConfig()  # doctest: +NORMALIZE_WHITESPACE
    EVDConfig(block_size=10, alpha=0.9, eps=1e-05, stats_fraction=1.0, accumulation_steps=1, stats_every=1,
              beta=0.95, gmax=10.0, gains='practical')
    >>> RecursiveConfig(alpha=0.2).gamma
    0.99
    >>> EVDConfig(alpha=1.0)
    Traceback (most recent call last):
    ...
    ValueError: alpha must be in [0, 1), but got alpha=1.0
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type

__all__ = ["WhiteningConfig", "EVDConfig", "RecursiveConfig", "make_config", "validate_hyperparameters"]

DEFAULT_BLOCK_SIZE = 10


def _int_at_least_1(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


#: name -> (predicate, what a valid value is); shared by every rule.
_CHECKS = {
    "block_size": (_int_at_least_1, "an integer >= 1"),
    "accumulation_steps": (_int_at_least_1, "an integer >= 1"),
    "stats_every": (_int_at_least_1, "an integer >= 1"),
    "alpha": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "beta": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "gamma": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "delta": (lambda v: v > 0.0, "> 0"),
    "eps": (lambda v: v > 0.0, "> 0"),
    "gmax": (lambda v: v >= 1.0, ">= 1"),
    "c_rel": (lambda v: v >= 0.0, ">= 0"),
    "c_abs": (lambda v: v >= 0.0, ">= 0"),
    "stats_fraction": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "gains": (lambda v: v in ("practical", "zca"), "'practical' or 'zca'"),
}


def validate_hyperparameters(**kw: Any) -> None:
    """Raise ``ValueError`` naming the first argument outside its valid range (docs/PAPER.md, "Hyper-parameters")."""
    for name, value in kw.items():
        ok, what = _CHECKS[name]
        try:
            exempt = name in ("block_size", "accumulation_steps", "stats_every", "gains")
            valid = bool(ok(value)) and (exempt or math.isfinite(value))
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"{name} must be {what}, but got {name}={value!r}")


def _hp(default: Any, help: str, symbol: Optional[str] = None) -> Any:
    return field(default=default, metadata={"help": help, "symbol": symbol})


@dataclass(frozen=True)
class WhiteningConfig:
    """Hyper-parameters every rule shares. Subclasses add their own and set ``method``."""

    block_size: int = _hp(DEFAULT_BLOCK_SIZE, "L, training batches per statistics block", "L")
    alpha: float = _hp(0.9, "recursive averaging of the moments between blocks", "alpha")
    eps: float = _hp(1e-5, "eigenvalue floor", "epsilon")
    stats_fraction: float = _hp(
        1.0, "fraction of each batch's samples used for the statistics (1.0: all, exact)", None)
    accumulation_steps: int = _hp(
        1, "training forwards per optimizer step (gradient accumulation): a block is block_size optimizer steps", None)
    stats_every: int = _hp(
        1, "gather statistics on the first of every stats_every training forwards of a block (1: every forward)",
        None)

    method = ""  # class attribute, not a field

    def __post_init__(self) -> None:
        validate_hyperparameters(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_names(cls, owner: str, kwargs: Mapping[str, Any], *, exclude: Tuple[str, ...] = ()) -> None:
        """``TypeError`` naming ``owner`` and the keywords it takes, for any other keyword in ``kwargs``."""
        names = [n for n in cls.field_names() if n not in exclude]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise TypeError(
                f"{owner} got unexpected whitening argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(names)}"
            )

    def replace(self, **changes: Any) -> "WhiteningConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def non_defaults(self, exclude: Tuple[str, ...] = ()) -> Dict[str, Any]:
        """The fields that differ from the defaults, in field order (for ``extra_repr``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in exclude and getattr(self, f.name) != f.default
        }

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EVDConfig(WhiteningConfig):
    """EVD transform (paper section 3; ``grad`` and ``direct`` layers): ``T = V diag(g)^(1/2) V^T``."""

    beta: float = _hp(0.95, "smoothing of the gradient transform Q_s (grad layers)", "beta")
    gmax: float = _hp(10.0, "largest whitening gain", "g_max")
    gains: str = _hp("practical", "'practical' gains (docs/PAPER.md, ERRATA 5) or plain ZCA 1/lambda ('zca')", None)

    method = "evd"


@dataclass(frozen=True)
class RecursiveConfig(WhiteningConfig):
    """Recursive transform (paper section 4): a rank-one power reduction and a leakage per block."""

    alpha: float = _hp(0.1, "recursive averaging of the moments between blocks", "alpha")
    beta: float = _hp(0.1, "smoothing of the gradient transform Q_s", "beta")
    gamma: float = _hp(0.99, "leakage of T toward the identity", "gamma")
    delta: float = _hp(0.25, "target power of the reduced direction, relative to the mean power", "delta")
    c_rel: float = _hp(0.025, "relative threshold of the principal-subspace search", "c_rel")
    c_abs: float = _hp(1e-6, "absolute threshold of the principal-subspace search", "c_abs")

    method = "recursive"


def make_config(cls: Type[WhiteningConfig], owner: str, config: Optional[WhiteningConfig],
                kwargs: Mapping[str, Any], *, exclude: Tuple[str, ...] = ()) -> WhiteningConfig:
    """A layer's config: ``config`` (or the defaults) with the keyword arguments ``kwargs`` applied.

    ``exclude`` names fields the layer has no use for (``DirectWhiten`` has no
    gradient transform, so no ``beta``): passing one is a ``TypeError``.
    """
    cls.check_names(owner, kwargs, exclude=exclude)
    if config is None:
        return cls(**kwargs)
    if type(config) is not cls:
        raise TypeError(f"{owner} expects config to be a {cls.__name__}, but got {type(config).__name__}")
    return config.replace(**kwargs) if kwargs else config


