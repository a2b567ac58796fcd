"""Which layers convert: target selection, the conversion report, listing and freezing the whitening layers."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._rebuild import modes_kept
from ..layers import WhiteningLayer
from ..layers._checks import CONVS, TRANSPOSED_CONVS
from ..methods import get_method
from ._common import DEFAULT_BLOCK_TYPES, BlockTypes, DirectWhitenWrapper, Predicate, _is_whitening


# --------------------------------------------------------------------------
# Target selection
# --------------------------------------------------------------------------
def _block_tuple(block_types: Optional[BlockTypes]) -> Sequence[Union[str, type]]:
    """``block_types`` as a sequence (default :data:`DEFAULT_BLOCK_TYPES`)."""
    if block_types is None:
        return DEFAULT_BLOCK_TYPES
    return (block_types,) if isinstance(block_types, (str, type)) else tuple(block_types)


def _block_matcher(block_types: Optional[BlockTypes]) -> Callable[[nn.Module], bool]:
    blocks = _block_tuple(block_types)
    for b in blocks:
        if not isinstance(b, (str, type)):
            raise TypeError(f"block_types must hold classes or class names, but got {b!r}")
    names = {b for b in blocks if isinstance(b, str)}
    classes = tuple(b for b in blocks if isinstance(b, type))

    def is_block(m: nn.Module) -> bool:
        return isinstance(m, classes) or any(c.__name__ in names for c in type(m).__mro__)

    return is_block


def _entries(model: nn.Module, is_block: Callable[[nn.Module], bool]) -> List[Tuple[str, nn.Module, bool]]:
    """The conv / linear layers, ``nn.MultiheadAttention`` modules and whitening layers of ``model``, each with its
    qualified name and whether it is inside a block: depth-first over ``named_children``, each module object once
    (at its first place), never descending into the modules listed."""
    if _is_layer(model) or _is_whitening(model):
        return [("", model, is_block(model))]
    entries: List[Tuple[str, nn.Module, bool]] = []
    seen = set()

    def rec(module: nn.Module, prefix: str, in_block: bool) -> None:
        for name, child in module._modules.items():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            if isinstance(child, nn.MultiheadAttention) or _is_layer(child) or _is_whitening(child):
                entries.append((prefix + name, child, in_block))
            else:
                rec(child, prefix + name + ".", in_block or is_block(child))

    rec(model, "", is_block(model))
    return entries


_TARGETS = ("blocks", "all")
#: ``targets="all"`` leaves out layers with more input features per group than this (``max_features``).
ALL_MAX_FEATURES = 8192
_PLAIN_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_LAYER_WORDS = "nn.Conv1d / nn.Conv2d / nn.Conv3d or nn.Linear"


def _is_layer(m: nn.Module) -> bool:
    """A convolution or linear layer of any kind (what the conversion report lists)."""
    return isinstance(m, CONVS + TRANSPOSED_CONVS + (nn.Linear,))


def _unsupported(m: nn.Module, allow_subclass: bool) -> Optional[str]:
    """Why no whitening layer can take ``m``'s place (``None``: one can)."""
    if isinstance(m, TRANSPOSED_CONVS):
        return f"{type(m).__name__}: transposed convolutions are not supported"
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        return f"{type(m).__name__}: an uninitialised lazy module (run one forward before converting)"
    if not isinstance(m, _PLAIN_LAYERS):
        return f"{type(m).__name__}: not an {_LAYER_WORDS}"
    parametrized = parametrize.is_parametrized(m)
    if not parametrized and not isinstance(m._parameters.get("weight"), nn.Parameter):
        return (f"{type(m).__name__}: its weight is computed by a forward pre-hook (torch.nn.utils.weight_norm / "
                "spectral_norm), which a converted layer would not call; apply it after convert_model, or use "
                "torch.nn.utils.parametrizations.weight_norm / spectral_norm, which convert_model carries over")
    cls = type(m).__bases__[0] if parametrized else type(m)  # parametrize subclasses the module's class
    if cls not in _PLAIN_LAYERS and not allow_subclass:
        base = next(b for b in _PLAIN_LAYERS if isinstance(m, b))
        return (f"{type(m).__name__}: a subclass of nn.{base.__name__}, whose forward may differ (e.g. weight "
                "standardisation) and would be dropped; a predicate can select it")
    if not m.weight.is_floating_point():
        return f"{type(m).__name__}: weight of dtype {m.weight.dtype}, not floating point"
    return None


class LayerDecision(NamedTuple):
    """One conv / linear layer (or ``nn.MultiheadAttention``) of a model and what :func:`~whitenlayers.convert_model`
    does with it.

    ``status`` is ``"converted"`` (``"to convert"`` in a dry run), ``"whitening"``
    (already a whitening layer, left as it is) or ``"skipped"``; ``reason``
    says why for a skipped layer. ``unsupported`` is ``True`` when the layer
    was selected by the target rule but cannot be converted (these are
    warned about), ``False`` when it was not selected. ``role`` is ``"stem"``
    (the model's first conv / linear layer), ``"classifier"`` (its last) or ``""``.

    Args:
        name: the layer's qualified name (``""``: the model itself).
        layer_type: its class name (``"Conv2d"``, ``"Linear"``, ...).
        status: ``"converted"``, ``"to convert"``, ``"whitening"`` or ``"skipped"``.
        reason: why it was skipped (default ``""``).
        unsupported: selected but not convertible (default ``False``).
        role: ``"stem"``, ``"classifier"`` or ``""`` (default).
    """

    name: str
    layer_type: str
    status: str
    reason: str = ""
    unsupported: bool = False
    role: str = ""


@dataclass
class ConversionReport:
    """What :func:`convert_model` converted and what it left out, and why (see :func:`conversion_report`).

    ``decisions`` lists every convolution, linear layer and
    ``nn.MultiheadAttention`` of the model, in module order. ``str(report)``
    is a readable table.

    Args:
        method: the conversion method the report is about (``"grad"``, ``"recursive"``, ``"direct"``).
        decisions: one :class:`~whitenlayers.convert.LayerDecision` per layer, in module order.
        dry_run: ``True`` for :func:`conversion_report` (nothing was changed: status ``"to convert"``),
            ``False`` (default) for ``convert_model(..., report=True)``.
    """

    method: str
    decisions: List[LayerDecision]
    dry_run: bool = False

    @property
    def converted(self) -> List[str]:
        """Qualified names of the layers converted (to be converted, in a dry run)."""
        return [d.name for d in self.decisions if d.status in ("converted", "to convert")]

    @property
    def skipped(self) -> Dict[str, str]:
        """Qualified name -> reason, for every layer left out."""
        return {d.name: d.reason for d in self.decisions if d.status == "skipped"}

    @property
    def unsupported(self) -> Dict[str, str]:
        """The skipped layers that the target rule selected but that cannot be converted."""
        return {d.name: d.reason for d in self.decisions if d.status == "skipped" and d.unsupported}

    @property
    def existing(self) -> List[str]:
        """Layers that were whitening layers already."""
        return [d.name for d in self.decisions if d.status == "whitening"]

    def __str__(self) -> str:
        head = (f"convert_model(method={self.method!r}){' (dry run)' if self.dry_run else ''}: "
                f"{len(self.converted)} {'to convert' if self.dry_run else 'converted'}, {len(self.skipped)} left out, "
                f"{len(self.existing)} already whitening")
        width = max([len(d.name or "<root>") for d in self.decisions] + [4])
        return "\n".join([head] + [
            f"  {d.name or '<root>':<{width}}  {d.layer_type:<18} {d.status}{': ' + d.reason if d.reason else ''}"
            for d in self.decisions
        ])


@dataclass(frozen=True)
class TargetSpec:
    """Which layers a conversion targets: the keywords that :func:`~whitenlayers.convert_model`,
    :func:`~whitenlayers.conversion_report`, ``target_layers`` and :func:`~whitenlayers.collect_diagnostics`
    share, in one frozen description, validated when it is made (``ValueError`` naming the argument). The rules
    are :func:`~whitenlayers.convert_model`'s.

    Args:
        targets: ``"blocks"`` (default) or ``"all"``.
        predicate: ``predicate(qualified_name, module) -> bool`` deciding alone (default ``None``).
        block_types: residual-block classes or class names replacing ``DEFAULT_BLOCK_TYPES`` (default ``None``).
        include_linear: ``nn.Linear`` layers as targets (default ``None``: no for ``"blocks"``, yes for ``"all"``).
        include_stem, include_classifier: add the first / last conv or linear layer (default ``False``).
        max_features: the largest number of input features per group of a target, an integer >= 1 (default
            ``None``: 8192 for ``"all"``, no limit for ``"blocks"``).
        example_input: inputs of one eval-mode forward that finds the layers the model calls (default ``None``).
    """

    targets: str = "blocks"
    predicate: Optional[Predicate] = None
    block_types: Optional[BlockTypes] = None
    include_linear: Optional[bool] = None
    include_stem: bool = False
    include_classifier: bool = False
    max_features: Optional[int] = None
    example_input: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.targets not in _TARGETS:
            raise ValueError(f"targets must be one of {_TARGETS}, but got targets={self.targets!r}")
        if self.predicate is not None and self.block_types is not None:
            raise ValueError("pass either predicate or block_types, not both (the predicate decides alone)")
        if self.predicate is not None and (self.targets != "blocks" or self.include_stem or self.include_classifier):
            raise ValueError("a predicate decides alone: do not combine it with targets='all', include_stem or "
                             "include_classifier")
        if self.targets == "all" and self.block_types is not None:
            raise ValueError("block_types only applies to targets='blocks'")
        m = self.max_features
        if m is not None and (not isinstance(m, int) or m < 1):
            raise ValueError(f"max_features must be a positive integer or None, but got max_features={m!r}")

    def select(self, model: nn.Module) -> List[Tuple[str, nn.Module]]:
        """The plain layers of ``model`` these rules target, with their qualified names (as ``target_layers``).

        Args:
            model: the model to look at (left unchanged).
        """
        return [(name, m) for name, m, d in _plan(model, self) if d.status == "to convert"]


def _plan(model: nn.Module, spec: TargetSpec) -> List[Tuple[str, nn.Module, LayerDecision]]:
    """The decision for every conv / linear layer (and ``nn.MultiheadAttention``) of ``model``, in module order."""
    targets, predicate = spec.targets, spec.predicate
    cap = spec.max_features if spec.max_features is not None else (ALL_MAX_FEATURES if targets == "all" else None)
    include_linear = targets == "all" if spec.include_linear is None else spec.include_linear
    entries = _entries(model, _block_matcher(spec.block_types))
    layers = [m for _, m, _ in entries if _is_layer(m) or isinstance(m, DirectWhitenWrapper)]
    called: Optional[Dict[int, int]] = None
    if spec.example_input is not None:
        called = _call_order(model, [m for _, m, _ in entries], spec.example_input)
        layers = sorted((m for m in layers if id(m) in called), key=lambda m: called[id(m)])
    stem = id(layers[0]) if layers else None
    classifier = id(layers[-1]) if layers else None
    block_names = [b if isinstance(b, str) else b.__name__ for b in _block_tuple(spec.block_types)]
    block_words = f"class or base class named {', '.join(map(repr, block_names))}"

    def decide(name: str, m: nn.Module, in_block: bool) -> LayerDecision:
        kind = type(m).__name__
        if _is_whitening(m):
            return LayerDecision(name, kind, "whitening", "already a whitening layer")
        if isinstance(m, nn.MultiheadAttention):
            reason = ("nn.MultiheadAttention: its input and output projections are applied inside "
                      "F.multi_head_attention_forward, not called as modules, so no whitening layer can take "
                      "their place")
            return LayerDecision(name, kind, "skipped", reason, predicate is None and (targets == "all" or in_block))
        linear = isinstance(m, nn.Linear)
        problem = _unsupported(m, allow_subclass=predicate is not None)
        position = "stem" if id(m) == stem else "classifier" if id(m) == classifier else ""
        role = ""
        if position:
            role = f"the {position} (the model's {'first' if position == 'stem' else 'last'} conv/linear layer; " + (
                f"include_{position}=True converts it)" if problem is None else f"and {problem})")
        forced = id(m) == stem and spec.include_stem or id(m) == classifier and spec.include_classifier
        why = ""
        if predicate is not None:
            if linear and not include_linear:
                selected = False
                why = "nn.Linear: a predicate is asked about Linear layers only with include_linear=True"
            elif problem is not None:
                selected = False  # the predicate is not asked about layers that cannot be converted
                why = problem
            else:
                selected = bool(predicate(name, m))
                why = "not selected by the predicate"
        elif targets == "blocks":
            if forced:
                selected = True
            elif linear:
                selected = include_linear
                why = role or ("nn.Linear: include_linear=True (or targets='all') converts Linear layers"
                               if problem is None else problem)
            else:
                selected = in_block
                why = role or f"not inside a residual block ({block_words}); " + (
                    "targets='all' converts it" if problem is None else problem)
        else:  # all
            if role and not forced:
                selected, why = False, role
            elif linear and not include_linear:
                selected, why = False, "nn.Linear, and include_linear=False"
            else:
                selected = True
        if not selected:
            return LayerDecision(name, kind, "skipped", why, False, position)
        if problem is None and cap is not None:
            groups = 1 if linear else cast(nn.Conv2d, m).groups
            k = cast(nn.Linear, m).in_features if linear else cast(nn.Conv2d, m).in_channels // groups
            if k > cap:
                gb = 20 * k * k * groups / 1e9  # 3 float32 matrices and a float64 accumulator
                problem = (f"{k} input features per group exceed max_features={cap} (a {k} x {k} whitening state of "
                           f"about {gb:.1f} GB and an O(M^3) fold; pass a larger max_features to convert it)")
        if problem is None and called is not None and id(m) not in called:
            problem = ("not called as a module by the model's forward of example_input (the model uses its weight "
                       "directly, e.g. torchvision's Swin attention, or the branch did not run in eval mode)")
        if problem is not None:
            return LayerDecision(name, kind, "skipped", problem, True, position)
        return LayerDecision(name, kind, "to convert", role=position)

    return [(name, m, decide(name, m, in_block)) for name, m, in_block in entries]


@torch.no_grad()
def _call_order(model: nn.Module, modules: Sequence[nn.Module], example_input: Any) -> Dict[int, int]:
    """``id(module) -> position`` in the order ``modules`` are first called by an eval-mode forward of
    ``example_input``.

    The model's training flags are restored afterwards; in eval mode nothing
    is updated (BatchNorm statistics, whitening blocks).
    """
    order: Dict[int, int] = {}

    def hook(module, args):
        order.setdefault(id(module), len(order))

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        with modes_kept(model.modules()):
            model.eval()
            if isinstance(example_input, tuple):
                model(*example_input)
            elif isinstance(example_input, dict):
                model(**example_input)
            else:
                model(example_input)
    finally:
        for h in handles:
            h.remove()
    return order


def target_layers(
    model: nn.Module,
    *,
    targets: str = "blocks",
    predicate: Optional[Predicate] = None,
    block_types: Optional[BlockTypes] = None,
    include_linear: Optional[bool] = None,
    include_stem: bool = False,
    include_classifier: bool = False,
    max_features: Optional[int] = None,
    example_input: Any = None,
) -> List[Tuple[str, nn.Module]]:
    """The plain layers :func:`convert_model` would replace, with their qualified names.

    See :func:`convert_model` for the rules and :func:`conversion_report` for
    what is left out and why. Whitening layers already in the model are not
    listed (they would be left alone).
    """
    return TargetSpec(targets, predicate, block_types, include_linear, include_stem, include_classifier, max_features,
                      example_input).select(model)


def conversion_report(
    model: nn.Module,
    method: str = "grad",
    *,
    targets: str = "blocks",
    predicate: Optional[Predicate] = None,
    block_types: Optional[BlockTypes] = None,
    include_linear: Optional[bool] = None,
    include_stem: bool = False,
    include_classifier: bool = False,
    max_features: Optional[int] = None,
    example_input: Any = None,
) -> ConversionReport:
    """What :func:`convert_model` with these arguments would convert and leave out, and why; changes nothing.

    Args:
        model: the model to inspect (left unchanged).
        method: ``"grad"`` (default), ``"recursive"`` or ``"direct"``, as for :func:`convert_model`.
        targets, predicate, block_types, include_linear, include_stem, include_classifier, max_features:
            the target rule, with :func:`convert_model`'s meanings and defaults.
        example_input: inputs for one eval-mode forward that finds the layers the model calls (default
            ``None``), as for :func:`convert_model`; the model's training flag is restored.

    Returns:
        A :class:`ConversionReport` with ``dry_run=True``.

    Example:
        >>> import whitenlayers as wl
        >>> report = wl.conversion_report(wl.models.resnet20())
        >>> len(report.converted), report.skipped["conv1"][:8], report.skipped["fc"][:14]
        (18, 'the stem', 'the classifier')
    """
    get_method(method)  # ValueError naming the methods
    plan = _plan(model, TargetSpec(targets, predicate, block_types, include_linear, include_stem, include_classifier,
                                   max_features, example_input))
    return ConversionReport(method, [d for _, _, d in plan], dry_run=True)


def whitening_layers(model: nn.Module) -> List[Tuple[str, WhiteningLayer]]:
    """The whitening layers of ``model`` (grad, recursive and :class:`~whitenlayers.DirectWhiten`) with qualified names.

    In the order of ``named_modules``. For ``method="direct"`` the names end
    in ``.whiten``.

    Args:
        model: any module (a converted model, or a single whitening layer: then the name is ``""``).

    Returns:
        ``(qualified_name, layer)`` pairs; empty for a model without whitening layers.
    """
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WhiteningLayer)]


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the ``with`` block, ``model``'s whitening layers gather and fold nothing; they still whiten.

    For passes in training mode that are not training steps, such as
    :func:`torch.optim.swa_utils.update_bn`, which re-estimates the
    BatchNorm statistics of an averaged model: the BatchNorms update, the
    whitening state (``mu``, ``T``, ``Q_s``, the partial block, the counters)
    stays as it is. Each layer's own :meth:`~whitenlayers.WhiteningLayer.freeze`
    setting is restored on exit.

    Args:
        model: the model whose whitening layers are frozen; it is what the ``with`` statement yields.

    Example:
        >>> import torch, whitenlayers as wl
        >>> model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
        >>> with wl.frozen(model):
        ...     _ = model(torch.randn(2, 3, 8, 8))
        >>> int(wl.whitening_layers(model)[0][1].num_blocks)
        0
    """
    layers = [m for _, m in whitening_layers(model)]
    before = [m.frozen for m in layers]
    for m in layers:
        m.freeze()
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.freeze(was)
