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
    >>> EVDConfig(alpha=1.0)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: EVDConfig (methods 'grad' and 'direct'): alpha (recursive averaging of the moments between blocks)
    must be in [0, 1), but got alpha=1.0
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type

__all__ = ["GAINS", "WhiteningConfig", "EVDConfig", "RecursiveConfig", "make_config", "field_range", "field_doc"]

DEFAULT_BLOCK_SIZE = 10
#: The methods whose layers take each rule's config (``WhiteningConfig.method``), for the error messages.
_METHODS = {"evd": "methods 'grad' and 'direct'", "recursive": "method 'recursive'"}
#: The EVD config's choices of gains (``EVDConfig.gains``).
GAINS = ("practical", "zca", "damped")


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
    "gains": (lambda v: v in GAINS, "'practical', 'zca' or 'damped'"),
}


def _is_valid(name: str, value: Any) -> bool:
    """Whether ``value`` is in the range of the hyper-parameter ``name`` (a ``KeyError`` for another name)."""
    ok, _ = _CHECKS[name]
    try:
        exempt = name in ("block_size", "accumulation_steps", "stats_every", "gains")
        return bool(ok(value)) and (exempt or math.isfinite(value))
    except TypeError:
        return False


def _hp(default: Any, help: str, symbol: Optional[str] = None, *, doc: str, when: str) -> Any:
    """A config field. Its ``metadata`` is the single source of the field's texts:

    * ``help``: what it is, in a few words (the runner's ``--help`` shows it with the range and default);
    * ``symbol``: the paper's symbol, if it has one;
    * ``doc``: what it does, in a sentence or two;
    * ``range``: the valid values (the text of the check that the config applies, :func:`field_range`);
    * ``when``: why the default is what it is, and when to change it.

    The class docstrings' ``Args`` sections are built from them at import time (:func:`_document`).
    """
    return field(default=default, metadata={"help": help, "symbol": symbol, "doc": doc, "when": when})


def field_range(name: str) -> str:
    """The valid values of the hyper-parameter ``name``, as a config checks them on construction.

    Args:
        name: a field name of :class:`EVDConfig` or :class:`RecursiveConfig`, e.g. ``"alpha"``.

    Returns:
        The text of the check, e.g. ``"in [0, 1)"``.

    Example:
        >>> field_range("gamma"), field_range("block_size")
        ('in (0, 1]', 'an integer >= 1')
    """
    return _CHECKS[name][1]


def field_doc(f: "dataclasses.Field[Any]") -> str:
    """One field's entry of a config class's ``Args`` section: meaning, the paper's symbol, valid values,
    default, and when to change it, all from the field's ``metadata`` (see :func:`_hp`).

    Args:
        f: a field of a config dataclass (``dataclasses.fields(EVDConfig)``).

    Returns:
        One paragraph of plain text (reStructuredText literals), no line breaks.
    """
    meta = f.metadata
    help_text = meta["help"][0].upper() + meta["help"][1:]
    symbol = meta.get("symbol")
    symbol = f" (the paper's ``{symbol}``)" if symbol and symbol != f.name else ""
    return (f"{help_text}{symbol}. {meta['doc']} Valid: {field_range(f.name)}. Default: ``{f.default!r}``. "
            f"{meta['when']}")


def _document(cls: Type["WhiteningConfig"]) -> Type["WhiteningConfig"]:
    """Append to ``cls.__doc__`` an ``Args`` section with one :func:`field_doc` entry per field (in field
    order), so each text is written once, in the field's metadata, and shown by ``help()`` and the API
    reference alike."""
    entries = [textwrap.fill(field_doc(f), width=108, initial_indent=f"    {f.name}: ", subsequent_indent=" " * 8,
                             break_long_words=False, break_on_hyphens=False) for f in dataclasses.fields(cls)]
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n" + "\n".join(["", "Args:"] + entries) + "\n"
    return cls


@_document
@dataclass(frozen=True)
class WhiteningConfig:
    """Hyper-parameters every rule shares. Subclasses add their own and set ``method``.

    Frozen: change a value with :meth:`replace` (validated again). Pass a config to a layer
    (``config=``), or its fields as the layer's keyword arguments.
    """

    block_size: int = _hp(
        DEFAULT_BLOCK_SIZE, "training batches per statistics block", "L",
        doc="The statistics of ``block_size`` training forwards (optimizer steps with ``accumulation_steps``) "
            "form a block; after the block's last forward it is folded in: new ``mu``, ``Phi_x``, ``T`` and "
            "``Q_s``, used from the next forward on (with ``convert_model(..., fold_async=True)`` one block "
            "later: block ``i``'s fold is in force from block ``i + 2`` on).",
        when="The paper does not give ``L`` (ERRATA 4); 10 makes a fold cost about 0.35 % of a ResNet-20 "
             "training step on a CPU (``benchmarks/RESULTS.md``, \"Fold cost\"). Lower it (1-5) "
             "for short runs, so that the transform follows the fast-changing early features and many blocks "
             "fold per epoch (the runner uses 2 on its small datasets); raise it (20-50) when the folds' cost "
             "matters more than freshness (many whitened layers, small batches).")
    alpha: float = _hp(
        0.9, "recursive averaging of the moments between blocks", "alpha",
        doc="Weight of the running mean and covariance when a block folds in, ``mu(i) = alpha mu(i-1) + "
            "(1 - alpha) mean of block i`` (eqs. 2-3; the first block sets them alone); 0 keeps only the "
            "latest block.",
        when="The paper's value for the EVD layers: the statistics average about ``1 / (1 - alpha) = 10`` "
             "blocks. Lower it when the features change fast relative to a block (large blocks, large "
             "learning rates); raise it (0.95-0.99) when a block's estimate is noisy (small batches, many "
             "input features).")
    eps: float = _hp(
        1e-5, "eigenvalue floor", "epsilon",
        doc="Floor on an eigenvalue or a power in a denominator: the gains ``1 / max(lambda, eps)`` (EVD) and "
            "the recursive step's ``delta mean(phi_x) / max(lambda_e, eps)``; in the units of the features' "
            "variance.",
        when="The paper's value. It is absolute: raise it for features of very small scale (variances near "
             "1e-5) or noisy statistics, so that near-null directions are not amplified (the default "
             "``'practical'`` gains also cap them at ``gmax``).")
    stats_fraction: float = _hp(
        1.0, "fraction of each batch's samples used for the statistics (1.0: all, exact)", None,
        doc="The leading ``ceil(stats_fraction * B)`` samples of each training batch (never fewer than 16 rows "
            "per feature) enter the block statistics; the gradient transform still acts on the whole batch.",
        when="1.0 keeps the statistics exact, and under ``torch.distributed`` equal to one process's on the "
             "global batch. 0.25 left accuracy unchanged and saved 7-9 % of the CPU time per epoch on a "
             "width-8 ResNet-20 (``docs/CONVERGENCE.md``, finding 9), nothing measurable on a width-16 step: "
             "try it on one process when the statistics dominate the step. Under ``torch.distributed`` each "
             "rank then sub-samples its own batch.")
    accumulation_steps: int = _hp(
        1, "training forwards per optimizer step (gradient accumulation): a block is block_size optimizer steps",
        None,
        doc="A block is then ``block_size * accumulation_steps`` forwards, and its fold follows the forward "
            "of a step's last micro-batch, so that every micro-batch of a step sees the same ``Q_s``.",
        when="1: one forward per optimizer step. Set it to your gradient-accumulation factor ``k`` (``k`` "
             "forwards and backwards per ``optimizer.step()``); the accumulated run then equals the big-batch "
             "run to float tolerance (docs/conventions.md, \"Gradient accumulation\").")
    stats_every: int = _hp(
        1, "gather statistics on the first of every stats_every training forwards of a block (1: every forward)",
        None,
        doc="The other forwards add only the gradient transform and still count toward ``block_size``; the "
            "first forward of every block always gathers, and every rank gathers on the same forwards.",
        when="1 is the paper's estimator (every forward). ``stats_every=5`` with ``block_size=10`` left accuracy "
             "unchanged and saved 6-15 % of the CPU time per epoch on the two small datasets studied "
             "(``docs/CONVERGENCE.md``, finding 12): use it for speed once a run of yours confirms the "
             "accuracy.")

    method = ""  # class attribute, not a field

    def __post_init__(self) -> None:
        # The fields of this module's classes; a subclass of a rule of one's own checks its extra fields in its own
        # __post_init__ (calling this one).
        # The message names the config and its methods, and says what the field is (its help text).
        owner = type(self).__name__ + (f" ({_METHODS[self.method]})" if self.method in _METHODS else "")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CHECKS and not _is_valid(f.name, value):
                raise ValueError(f"{owner}: {f.name} ({f.metadata['help']}) must be {field_range(f.name)}, "
                                 f"but got {f.name}={value!r}")

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        """The names of the fields, in order: the keyword arguments a layer of this rule takes."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_names(cls, owner: str, kwargs: Mapping[str, Any], *, exclude: Tuple[str, ...] = ()) -> None:
        """``TypeError`` naming ``owner`` and the keywords it takes, for any other keyword in ``kwargs``.

        Args:
            owner: the name the message gives (a layer class, ``"convert_model"``).
            kwargs: the keyword arguments to check (only their names are looked at).
            exclude: field names ``owner`` does not take (``DirectWhiten``: ``("beta",)``).
        """
        names = [n for n in cls.field_names() if n not in exclude]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise TypeError(
                f"{owner} got unexpected whitening argument(s) {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(names)}"
            )

    def replace(self, **changes: Any) -> "WhiteningConfig":
        """A copy with ``changes`` applied (validated again).

        Args:
            **changes: new values by field name.
        """
        return dataclasses.replace(self, **changes)

    def non_defaults(self, exclude: Tuple[str, ...] = ()) -> Dict[str, Any]:
        """The fields that differ from the defaults, in field order (for ``extra_repr``).

        Args:
            exclude: field names to leave out.
        """
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in exclude and getattr(self, f.name) != f.default
        }

    def as_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (name -> value), e.g. to save next to a checkpoint."""
        return dataclasses.asdict(self)


@_document
@dataclass(frozen=True)
class EVDConfig(WhiteningConfig):
    """EVD transform (paper section 3; ``grad`` and ``direct`` layers): ``T = V diag(g)^(1/2) V^T``.

    The defaults are the paper's experimental values (section 6) where it gives them. Every layer keyword
    argument of :class:`~whitenlayers.GradWhitenConv2d`, :class:`~whitenlayers.GradWhitenLinear`, their 1-D
    and 3-D forms and :class:`~whitenlayers.DirectWhiten` (less ``beta``) is a field below.

    Example:
        >>> EVDConfig(gmax=5.0).replace(beta=0.9).non_defaults()
        {'beta': 0.9, 'gmax': 5.0}
    """

    beta: float = _hp(
        0.95, "smoothing of the gradient transform Q_s (grad layers)", "beta",
        doc="``Q_s(i) = beta Q_s(i-1) + (1 - beta) Q(i)`` (eq. 35): the share of the previous gradient "
            "transform the new one keeps. ``DirectWhiten`` has no gradient transform and does not take it.",
        when="The paper's value: ``Q_s`` averages about 20 blocks, so the optimizer sees a slowly changing "
             "preconditioner. Lower it (0.5-0.9) when 20 blocks are a large part of training; at lr 0.1 "
             "``beta=0.5`` was within noise of 0.95 (``docs/CONVERGENCE.md``, finding 6).")
    gmax: float = _hp(
        10.0, "largest whitening gain", "g_max",
        doc="Cap on the practical gains ``g_m = min(mean(lambda) / max(lambda_m, eps), gmax)`` (eq. 34, "
            "ERRATA 5): no direction of the signal subspace gains more than ``gmax`` in power. Unused with "
            "``gains='zca'``.",
        when="The paper's value. Lower it (2-5) when weak directions are mostly noise (small batches) or "
             "training turns unstable after the first folds; raise it to whiten well-estimated, badly "
             "conditioned features harder.")
    gains: str = _hp(
        "practical", "'practical' gains (docs/PAPER.md, ERRATA 5), plain ZCA 1/lambda ('zca'), or 'damped' "
        "c (Phi + d I)^-1 from a Cholesky factorisation", None,
        doc="``'practical'``: the ``round(M_s)`` strongest eigendirections (``M_s`` the effective rank) are "
            "brought to the mean eigenvalue, capped at ``gmax``, the others keep gain 1: the average input "
            "power is kept (eq. 34, ERRATA 5). ``'zca'``: ``1 / max(lambda, eps)`` for every direction, no "
            "rank cut and no cap: unit variance. ``'damped'``: ``Q = c (Phi + d I)^-1`` with ``c`` the mean "
            "eigenvalue (at least ``eps``) and ``d = c / gmax``, gains ``c / (lambda + d)``: the practical "
            "gains' normalisation and cap, smooth, without the rank cut, computed from a Cholesky "
            "factorisation (no eigendecomposition); its ``T`` is the Cholesky whitening ``sqrt(c) L^-1``, "
            "not symmetric, so ``DirectWhiten`` does not take it.",
        when="``'practical'`` is the paper's choice for training. ``'zca'`` for exact whitening (comparisons, "
             "tests), knowing that it amplifies near-null directions up to ``1 / eps``. ``'damped'`` where "
             "the fold's eigendecompositions cost too much (wide layers, GPUs: ``docs/writing-a-rule.md``, \"Gains\"); "
             "grad layers only.")

    method = "evd"


@_document
@dataclass(frozen=True)
class RecursiveConfig(WhiteningConfig):
    """Recursive transform (paper section 4): a rank-one power reduction and a leakage per block.

    The defaults are the paper's experimental values (section 6) where it gives them. Every layer keyword
    argument of :class:`~whitenlayers.RecursiveWhitenConv2d`, :class:`~whitenlayers.RecursiveWhitenLinear`
    and their 1-D and 3-D forms is a field below.

    Example:
        >>> RecursiveConfig().alpha, RecursiveConfig(delta=0.5).delta
        (0.1, 0.5)
    """

    alpha: float = _hp(
        0.1, "recursive averaging of the moments between blocks", "alpha",
        doc="Weight of the running moments when a block folds in (eqs. 2-3 and 37): of ``mu``, ``Phi_x``, the "
            "powers ``phi_x`` and the whitened covariance ``Phi_y``; 0 keeps only the latest block.",
        when="The paper's value for the recursive layers: ``Phi_y`` describes the features under the transform "
             "in force, which changes at every fold, so it averages little more than the latest block. Raise "
             "it (0.5-0.9) when a block's estimate is noisy (small batches, many input features).")
    beta: float = _hp(
        0.1, "smoothing of the gradient transform Q_s", "beta",
        doc="``Q_s(i) = beta Q_s(i-1) + (1 - beta) Q(i)`` (eq. 35): the share of the previous gradient "
            "transform the new one keeps.",
        when="The paper's value: the recursive ``T`` already moves by one rank-one step per fold, so ``Q_s`` "
             "needs little smoothing. Raise it (0.5-0.95) if the loss jumps at the folds.")
    gamma: float = _hp(
        0.99, "leakage of T toward the identity", "gamma",
        doc="Each fold sets ``T(i) = gamma T~ T(i-1) + (1 - gamma) I`` (eqs. 42, 44): old reductions fade "
            "toward the identity. 1: no leakage.",
        when="The paper's value: about 1 % of the accumulated transform is forgotten per fold. Lower it "
             "(0.9-0.98) when the features' correlations change fast, so that stale reductions fade sooner; "
             "1 keeps every step, and its errors, for good.")
    delta: float = _hp(
        0.25, "target power of the reduced direction, relative to the mean power", "delta",
        doc="Each fold reduces the power of the strongest direction of ``Phi_y`` to ``delta`` times the mean "
            "input power (eq. 40); a direction already below that is left alone (ERRATA 6).",
        when="The paper's value. Larger values reduce less per fold (gentler, slower whitening), smaller ones "
             "push the dominant direction down harder; rarely changed.")
    c_rel: float = _hp(
        0.025, "relative threshold of the principal-subspace search", "c_rel",
        doc="Column alignment (section 4.2, eq. 48): column ``m`` of ``Phi_y`` joins the strongest column's "
            "coherent set when ``|c_m| >= max(c_rel xi_m' xi_m, c_abs)`` (``xi`` the column norms, ``c`` the "
            "columns' inner products with the strongest).",
        when="The paper's value. Raise it to build the direction from fewer, more coherent columns when "
             "``Phi_y`` is noisy; rarely changed.")
    c_abs: float = _hp(
        1e-6, "absolute threshold of the principal-subspace search", "c_abs",
        doc="The absolute floor of the same threshold (eq. 48), in the units of ``Phi_y`` squared (the paper "
            "prints it as a second ``c_rel``: ERRATA 4).",
        when="The paper's value. Raise it with features of large scale, where ``c_rel`` alone admits columns "
             "that are numerically zero; rarely changed.")

    method = "recursive"


def make_config(cls: Type[WhiteningConfig], owner: str, config: Optional[WhiteningConfig],
                kwargs: Mapping[str, Any], *, exclude: Tuple[str, ...] = ()) -> WhiteningConfig:
    """A layer's config: ``config`` (or the defaults) with the keyword arguments ``kwargs`` applied.

    Args:
        cls: the config class of the layer's rule (:class:`EVDConfig` or :class:`RecursiveConfig`).
        owner: the layer's name, for the error messages.
        config: a config of exactly ``cls`` to start from, or ``None`` for the defaults.
        kwargs: whitening keyword arguments given to the layer; they override ``config``'s values.
        exclude: fields the layer has no use for (``DirectWhiten`` has no gradient transform, so no
            ``beta``): passing one is a ``TypeError``.

    Returns:
        The validated config (``config`` itself when ``kwargs`` is empty).
    """
    cls.check_names(owner, kwargs, exclude=exclude)
    if config is not None and type(config) is not cls:
        raise TypeError(f"{owner} expects config to be a {cls.__name__}, but got {type(config).__name__}")
    try:
        if config is None:
            return cls(**kwargs)
        return config.replace(**kwargs) if kwargs else config
    except ValueError as exc:  # a value out of its range: the message names the layer too
        raise ValueError(f"{owner}: {exc}") from None


