"""Model surgery: put whitening layers into an existing model, and take them out again.

* :func:`convert_model` replaces the target convolutions of a model (by
  default every ``nn.Conv2d`` inside a residual block) with whitening layers,
  in place, in the style of ``nn.SyncBatchNorm.convert_sync_batchnorm``.
* :func:`export_model` folds the whitening back into plain ``nn.Conv2d`` /
  ``nn.Linear`` layers with identical outputs, for deployment without this
  package.
* :func:`load_plain_state_dict` / :func:`plain_state_dict` move checkpoints
  between a converted model and the unconverted architecture.
* :func:`whitening_layers` lists the whitening layers of a model.

``state_dict`` keys
-------------------
``method="grad"`` / ``"recursive"``: a target ``name`` keeps its keys
``name.weight`` (and ``name.bias``) and gains the whitening state
``name.running_mean``, ``name.running_cov``, ``name.whitening_matrix``,
``name.grad_transform``, ``name.num_blocks``, ``name._extra_state`` (the
partial block), ``name.bias_correction`` for a bias-free layer,
``name.absorbed_offset`` for a layer whose centring its BatchNorm absorbs
(``absorb_centring``, the default where the output feeds only a BatchNorm),
and for the recursive method ``name.running_cov_whitened``,
``name.running_power``, ``name.whitening_gram``.

``method="direct"``: the target ``name`` becomes a :class:`DirectWhitened`
wrapper with two children, ``whiten`` (the :class:`~whitenlayers.DirectWhiten`)
and ``layer`` (the original module, unchanged): keys ``name.weight`` become
``name.layer.weight`` and the whitening state is under ``name.whiten.*``.

A plain checkpoint (keys of the unconverted architecture) loads into a
converted model with :func:`load_plain_state_dict`, and
:func:`plain_state_dict` gives the converted model's function as a plain
checkpoint.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
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
import torch.fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import functional as F_w
from .autograd import _transform_mean
from .config import WhiteningConfig, make_config
from .fold import STRATEGIES, FoldCoordinator
from .layers import (
    GRAD_LAYER_TYPES,
    DirectWhiten,
    GradWhitenConv1d,
    GradWhitenConv2d,
    GradWhitenConv3d,
    GradWhitenLinear,
    RecursiveWhitenConv1d,
    RecursiveWhitenConv2d,
    RecursiveWhitenConv3d,
    RecursiveWhitenLinear,
)
from .stats import WhiteningStatistics

if TYPE_CHECKING:  # pragma: no cover
    from torch.nn.modules.conv import _ConvNd

    from .layers import _GradWhitenMixin

__all__ = [
    "DEFAULT_BLOCK_TYPES",
    "ConversionReport",
    "LayerDecision",
    "conversion_report",
    "DirectWhitened",
    "convert_model",
    "export_model",
    "whitening_layers",
    "frozen",
    "target_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "absorbing_batchnorms",
]

#: Class names of the residual blocks whose convolutions are converted by default: ``BasicBlock`` and
#: ``Bottleneck`` (torchvision's, timm's and most CIFAR ResNets'), and Hugging Face transformers' ResNet blocks
#: ``ResNetBasicLayer`` and ``ResNetBottleNeckLayer``. A module is a block when its class or a base class has one
#: of these names.
DEFAULT_BLOCK_TYPES: Tuple[str, ...] = ("BasicBlock", "Bottleneck", "ResNetBasicLayer", "ResNetBottleNeckLayer")

Predicate = Callable[[str, nn.Module], bool]
BlockTypes = Union[str, type, Sequence[Union[str, type]]]

_METHODS = ("grad", "recursive", "direct")
_GRAD_CLASSES = {
    "grad": (GradWhitenConv2d, GradWhitenLinear),
    "recursive": (RecursiveWhitenConv2d, RecursiveWhitenLinear),
}
_CONVND_CLASSES = {
    "grad": {nn.Conv1d: GradWhitenConv1d, nn.Conv3d: GradWhitenConv3d},
    "recursive": {nn.Conv1d: RecursiveWhitenConv1d, nn.Conv3d: RecursiveWhitenConv3d},
}
# Hook dictionaries of nn.Module that fire when the module is called.
_CALL_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
)
_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


class DirectWhitened(nn.Module):
    """``layer(whiten(x))``: a :class:`~whitenlayers.DirectWhiten` in front of a conv or linear layer.

    What ``convert_model(..., method="direct")`` puts in place of a target.
    ``layer`` is the original module object (same Parameters, same
    state-dict hooks); the forward/backward hooks that were registered on it
    are moved to this wrapper, so they see the same input and output as
    before the conversion.
    """

    def __init__(self, whiten: DirectWhiten, layer: nn.Module) -> None:
        super().__init__()
        self.whiten = whiten
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.layer, nn.Linear) and x.dim() != 2:
            # A linear layer acts on the last dim: whiten the (N, C) rows of x (statistics over all leading dims).
            return self.layer(self.whiten(x.reshape(-1, x.shape[-1])).reshape(x.shape))
        return self.layer(self.whiten(x))


# --------------------------------------------------------------------------
# Target selection
# --------------------------------------------------------------------------
def _block_matcher(block_types: Optional[BlockTypes]) -> Callable[[nn.Module], bool]:
    if block_types is None:
        block_types = DEFAULT_BLOCK_TYPES
    if isinstance(block_types, (str, type)):
        block_types = (block_types,)
    names, classes = set(), []
    for b in block_types:
        if isinstance(b, str):
            names.add(b)
        elif isinstance(b, type):
            classes.append(b)
        else:
            raise TypeError(f"block_types must hold classes or class names, but got {b!r}")
    classes_t = tuple(classes)

    def is_block(m: nn.Module) -> bool:
        if classes_t and isinstance(m, classes_t):
            return True
        return any(c.__name__ in names for c in type(m).__mro__)

    return is_block


def _is_whitening(m: nn.Module) -> bool:
    return isinstance(m, (WhiteningStatistics, DirectWhitened))


def _walk(model: nn.Module, visit: Callable[[nn.Module, str, nn.Module, str, bool], bool], is_block) -> None:
    """Depth-first over ``named_children``; ``visit(parent, child_name, child, qualified, in_block)``.

    ``visit`` returns True to stop descending into ``child``. Whitening layers
    and :class:`DirectWhitened` wrappers are visited but never descended into.
    Each module object is visited once even when it appears at several places.
    """
    seen = set()

    def rec(module: nn.Module, prefix: str, in_block: bool) -> None:
        for name, child in module._modules.items():
            if child is None:
                continue
            qualified = prefix + name
            stop = visit(module, name, child, qualified, in_block)
            if stop or _is_whitening(child) or id(child) in seen:
                continue
            seen.add(id(child))
            rec(child, qualified + ".", in_block or is_block(child))

    rec(model, "", is_block(model))


_TARGETS = ("blocks", "all")
#: ``targets="all"`` leaves out layers with more input features per group than this (``max_features``).
ALL_MAX_FEATURES = 8192
_PLAIN_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_LAYER_WORDS = "nn.Conv1d / nn.Conv2d / nn.Conv3d or nn.Linear"


def _is_layer(m: nn.Module) -> bool:
    """A convolution or linear layer of any kind (what the conversion report lists)."""
    return isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))


def _base_name(m: nn.Module) -> str:
    for base in _PLAIN_LAYERS:
        if isinstance(m, base):
            return f"nn.{base.__name__}"
    return type(m).__name__


def _unsupported(m: nn.Module, allow_subclass: bool) -> Optional[str]:
    """Why no whitening layer can take ``m``'s place (``None``: one can)."""
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return f"{type(m).__name__}: transposed convolutions are not supported"
    lazy = getattr(nn.modules.lazy, "LazyModuleMixin", None)
    if lazy is not None and isinstance(m, lazy) and m.has_uninitialized_params():
        return f"{type(m).__name__}: an uninitialised lazy module (run one forward before converting)"
    if not isinstance(m, _PLAIN_LAYERS):
        return f"{type(m).__name__}: not an {_LAYER_WORDS}"
    if type(m) not in _PLAIN_LAYERS and not allow_subclass:
        return (f"{type(m).__name__}: a subclass of {_base_name(m)}, whose forward may differ (e.g. weight "
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
    warned about), ``False`` when it was not selected.
    """

    name: str
    layer_type: str
    status: str
    reason: str = ""
    unsupported: bool = False


@dataclass
class ConversionReport:
    """What :func:`convert_model` converted and what it left out, and why (see :func:`conversion_report`).

    ``decisions`` lists every convolution, linear layer and
    ``nn.MultiheadAttention`` of the model, in module order. ``str(report)``
    is a readable table.
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
        lines = [head] + [
            f"  {d.name or '<root>':<{width}}  {d.layer_type:<18} {d.status}{': ' + d.reason if d.reason else ''}"
            for d in self.decisions
        ]
        return "\n".join(lines)


def _check_target_args(targets: str, predicate, block_types, include_stem: bool, include_classifier: bool) -> None:
    if targets not in _TARGETS:
        raise ValueError(f"targets must be one of {_TARGETS}, but got targets={targets!r}")
    if predicate is not None and block_types is not None:
        raise ValueError("pass either predicate or block_types, not both (the predicate decides alone)")
    if predicate is not None and (targets != "blocks" or include_stem or include_classifier):
        raise ValueError("a predicate decides alone: do not combine it with targets='all', include_stem or "
                         "include_classifier")
    if targets == "all" and block_types is not None:
        raise ValueError("block_types only applies to targets='blocks'")


def _plan(
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
) -> List[Tuple[str, nn.Module, LayerDecision]]:
    """The decision for every conv / linear layer (and ``nn.MultiheadAttention``) of ``model``, in module order."""
    _check_target_args(targets, predicate, block_types, include_stem, include_classifier)
    if max_features is not None and (not isinstance(max_features, int) or max_features < 1):
        raise ValueError(f"max_features must be a positive integer or None, but got max_features={max_features!r}")
    cap = max_features if max_features is not None else (ALL_MAX_FEATURES if targets == "all" else None)
    if include_linear is None:
        include_linear = targets == "all"
    is_block = _block_matcher(block_types)
    entries: List[Tuple[str, nn.Module, bool]] = []
    if _is_layer(model) or _is_whitening(model):
        entries.append(("", model, is_block(model)))
    else:
        seen = set()

        def visit(parent, name, child, qualified, in_block):
            if id(child) in seen:
                return True
            if isinstance(child, nn.MultiheadAttention) or _is_layer(child) or _is_whitening(child):
                seen.add(id(child))
                entries.append((qualified, child, in_block))
                return True
            return False

        _walk(model, visit, is_block)
    layers = [m for _, m, _ in entries if _is_layer(m) or isinstance(m, DirectWhitened)]
    called: Optional[Dict[int, int]] = None
    if example_input is not None:
        called = _call_order(model, [m for _, m, _ in entries], example_input)
        layers = sorted((m for m in layers if id(m) in called), key=lambda m: called[id(m)])
    stem = id(layers[0]) if layers else None
    classifier = id(layers[-1]) if layers else None
    block_words = f"class or base class named {', '.join(map(repr, _block_names(block_types)))}"
    out = []
    for name, m, in_block in entries:
        kind = type(m).__name__
        if _is_whitening(m):
            out.append((name, m, LayerDecision(name, kind, "whitening", "already a whitening layer")))
            continue
        if isinstance(m, nn.MultiheadAttention):
            reason = ("nn.MultiheadAttention: its input and output projections are applied inside "
                      "F.multi_head_attention_forward, not called as modules, so no whitening layer can take "
                      "their place")
            in_scope = predicate is None and (targets == "all" or in_block)
            out.append((name, m, LayerDecision(name, kind, "skipped", reason, in_scope)))
            continue
        linear = isinstance(m, nn.Linear)
        problem = _unsupported(m, allow_subclass=predicate is not None)
        role = ""
        if id(m) == stem:
            role = "the stem (the model's first conv/linear layer; " + (
                "include_stem=True converts it)" if problem is None else f"and {problem})")
        elif id(m) == classifier:
            role = "the classifier (the model's last conv/linear layer; " + (
                "include_classifier=True converts it)" if problem is None else f"and {problem})")
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
            if id(m) == stem and include_stem or id(m) == classifier and include_classifier:
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
            if role and not (id(m) == stem and include_stem or id(m) == classifier and include_classifier):
                selected, why = False, role
            elif linear and not include_linear:
                selected, why = False, "nn.Linear, and include_linear=False"
            else:
                selected = True
        if selected and problem is None and cap is not None:
            k = (cast(nn.Linear, m).in_features if linear
                 else cast("_ConvNd", m).in_channels // cast("_ConvNd", m).groups)
            if k > cap:
                # 3 float32 matrices and a float64 accumulator
                gb = 20 * k * k * (1 if linear else cast("_ConvNd", m).groups) / 1e9
                problem = (f"{k} input features per group exceed max_features={cap} (a {k} x {k} whitening state of "
                           f"about {gb:.1f} GB and an O(M^3) fold; pass a larger max_features to convert it)")
        if selected and problem is None and called is not None and id(m) not in called:
            problem = ("not called as a module by the model's forward of example_input (the model uses its weight "
                       "directly, e.g. torchvision's Swin attention, or the branch did not run in eval mode)")
        if selected and problem is not None:
            out.append((name, m, LayerDecision(name, kind, "skipped", problem, True)))
        elif selected:
            out.append((name, m, LayerDecision(name, kind, "to convert")))
        else:
            out.append((name, m, LayerDecision(name, kind, "skipped", why, False)))
    return out


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
    flags = [(m, m.training) for m in model.modules()]
    try:
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
        for m, flag in flags:
            m.training = flag
    return order


def _block_names(block_types: Optional[BlockTypes]) -> List[str]:
    if block_types is None:
        block_types = DEFAULT_BLOCK_TYPES
    if isinstance(block_types, (str, type)):
        block_types = (block_types,)
    return [b if isinstance(b, str) else getattr(b, "__name__", repr(b)) for b in block_types]


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
    plan = _plan(model, targets=targets, predicate=predicate, block_types=block_types, include_linear=include_linear,
                 include_stem=include_stem, include_classifier=include_classifier, example_input=example_input,
                 max_features=max_features)
    return [(name, m) for name, m, d in plan if d.status == "to convert"]


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

    Example:
        >>> import whitenlayers as wl
        >>> report = wl.conversion_report(wl.models.resnet20())
        >>> len(report.converted), report.skipped["conv1"][:8], report.skipped["fc"][:14]
        (18, 'the stem', 'the classifier')
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, but got method={method!r}")
    plan = _plan(model, targets=targets, predicate=predicate, block_types=block_types, include_linear=include_linear,
                 include_stem=include_stem, include_classifier=include_classifier, example_input=example_input,
                 max_features=max_features)
    return ConversionReport(method, [d for _, _, d in plan], dry_run=True)


def whitening_layers(model: nn.Module) -> List[Tuple[str, WhiteningStatistics]]:
    """The whitening layers of ``model`` (grad, recursive and :class:`~whitenlayers.DirectWhiten`) with qualified names.

    In the order of ``named_modules``. For ``method="direct"`` the names end
    in ``.whiten``.
    """
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WhiteningStatistics)]


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the ``with`` block, ``model``'s whitening layers gather and fold nothing; they still whiten.

    For passes in training mode that are not training steps, such as
    :func:`torch.optim.swa_utils.update_bn`, which re-estimates the
    BatchNorm statistics of an averaged model: the BatchNorms update, the
    whitening state (``mu``, ``T``, ``Q_s``, the partial block, the counters)
    stays as it is. Each layer's own :meth:`~whitenlayers.WhiteningStatistics.freeze`
    setting is restored on exit.

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


# --------------------------------------------------------------------------
# Hooks and the fold coordinator
# --------------------------------------------------------------------------
def _share_hooks(src: nn.Module, dst: nn.Module, names: Iterable[str], move: bool = False) -> None:
    """Give ``dst`` the very hook dictionaries of ``src`` (existing handles keep working)."""
    for attr in names:
        if hasattr(src, attr):
            d = getattr(src, attr)
            setattr(dst, attr, d)
            if move:
                setattr(src, attr, type(d)() if isinstance(d, dict) else None)


def _coordinators(module: nn.Module) -> List[Tuple[int, FoldCoordinator]]:
    return [(k, h) for k, h in module._forward_hooks.items() if isinstance(h, FoldCoordinator)]


def _remove_coordinators(module: nn.Module) -> None:
    for key, _ in _coordinators(module):
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, attr, {}).pop(key, None)


def _install_coordinator(model: nn.Module, strategy: str = "auto") -> Optional[FoldCoordinator]:
    layers = [m for _, m in whitening_layers(model)]
    if not layers:
        return None
    existing = _coordinators(model)
    if existing:
        coord = existing[0][1]
        coord.strategy = strategy
    else:
        coord = FoldCoordinator(strategy)
        coord.handle = model.register_forward_hook(coord)
    for layer in layers:
        layer._fold_coordinator = coord
    coord.layers = layers
    coord.checked = False  # the first fold checks that every layer is called (FoldCoordinator)
    return coord


# --------------------------------------------------------------------------
# Centring absorbed by a following BatchNorm: which targets feed only a BatchNorm
# --------------------------------------------------------------------------
class _DataflowTracer(torch.fx.Tracer):
    """torch.fx tracer that keeps the targets (and whitening layers) as leaves, so their calls show as nodes."""

    def __init__(self, leaves: set) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves or _is_whitening(m) or super().is_leaf_module(m, module_qualified_name)


def _absorbing_batchnorm_ok(layer: nn.Module, bn: nn.Module) -> bool:
    if isinstance(layer, nn.modules.conv._ConvNd):
        batchnorm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(layer.kernel_size)]
        kinds: Tuple[type, ...] = (batchnorm, nn.SyncBatchNorm)
        features = layer.out_channels
    else:
        kinds = (nn.BatchNorm1d, nn.SyncBatchNorm)
        features = cast(nn.Linear, layer).out_features
    return (isinstance(bn, kinds) and isinstance(bn, _BatchNorm) and bn.num_features == features
            and not bn._forward_pre_hooks and not getattr(bn, "_forward_pre_hooks_with_kwargs", None))


def absorbing_batchnorms(
    model: nn.Module, targets: Sequence[Tuple[str, nn.Module]]
) -> Dict[int, Tuple[nn.Module, nn.Module]]:
    """For each target whose output feeds one BatchNorm and nothing else: ``id(target) -> (BatchNorm, its parent)``.

    The rule (conservative; anything else is left centred): the dataflow of
    the forward of the target's parent module is traced with ``torch.fx``
    (the targets kept as leaf modules; if the parent returns the target's
    output unchanged, the grandparent's forward is traced, and so on). The
    target must be called exactly once there, and its output's only user must
    be one call of a ``BatchNorm2d`` (``BatchNorm1d`` for a linear target) or
    ``SyncBatchNorm`` module with as many features, taking that output as its
    only argument and called once in that forward. The target and the
    BatchNorm must each sit at one place in the model, the target must have
    no forward hooks (they could change its output) and the BatchNorm no
    forward pre-hooks; a BatchNorm absorbs at most one target. A forward that
    ``torch.fx`` cannot trace (data-dependent control flow) absorbs nothing.
    Whether the BatchNorm is in training mode is checked at every forward by
    the layer itself, not here.
    """
    places: Dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        places[id(m)] = places.get(id(m), 0) + 1
    leaves = {id(m) for _, m in targets}
    graphs: Dict[str, Optional[torch.fx.Graph]] = {}

    def graph_of(path: str) -> Optional[torch.fx.Graph]:
        if path not in graphs:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graphs[path] = _DataflowTracer(leaves).trace(model.get_submodule(path))
            except Exception:  # untraceable forward: nothing absorbed there
                graphs[path] = None
        return graphs[path]

    found: Dict[int, Tuple[nn.Module, nn.Module]] = {}
    claims: Dict[int, int] = {}
    for name, layer in targets:
        if not name or places.get(id(layer), 0) != 1 or layer._forward_hooks:
            continue
        if getattr(layer, "_forward_hooks_with_kwargs", None) or getattr(layer, "_forward_hooks_always_called", None):
            continue
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            anc, rel = ".".join(parts[:depth]), ".".join(parts[depth:])
            graph = graph_of(anc)
            if graph is None:
                break
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == rel]
            if not calls:
                continue  # called from further up, or not at all
            if len(calls) > 1:
                break
            node = calls[0]
            users = list(node.users)
            if len(users) != 1:
                break
            user = users[0]
            if user.op == "output" and user.args == (node,):
                continue  # returned unchanged: its consumer is in the caller's forward
            if user.op != "call_module" or user.args != (node,) or user.kwargs:
                break
            if sum(1 for n in graph.nodes if n.op == "call_module" and n.target == user.target) != 1:
                break
            path = f"{anc}.{user.target}" if anc else str(user.target)
            bn = model.get_submodule(path)
            if places.get(id(bn), 0) == 1 and _absorbing_batchnorm_ok(layer, bn):
                found[id(layer)] = (bn, model.get_submodule(path.rpartition(".")[0]))
                claims[id(bn)] = claims.get(id(bn), 0) + 1
            break
    return {k: v for k, v in found.items() if claims[id(v[0])] == 1}


# --------------------------------------------------------------------------
# convert_model
# --------------------------------------------------------------------------
#: Layer keywords that are not whitening hyper-parameters.
_LAYER_OPTIONS = ("config", "process_group")


def _check_layer_kwargs(method: str, layer_kwargs: Dict[str, Any]) -> None:
    """``TypeError`` for a keyword the method's layers do not take (names from the config dataclasses)."""
    owner = f"convert_model(method={method!r})"
    whitening = {k: v for k, v in layer_kwargs.items() if k not in _LAYER_OPTIONS}
    if method == "direct":
        cls, exclude = DirectWhiten._CONFIG_CLASS, DirectWhiten._unused_fields
    else:
        cls, exclude = _GRAD_CLASSES[method][0]._CONFIG, ()
    cls.check_names(owner, whitening, exclude=exclude)
    config = layer_kwargs.get("config")
    if config is not None and type(config) is not cls:
        raise TypeError(f"{owner} expects config to be a {cls.__name__}, but got {type(config).__name__}")


def _requested_config(method: str, layer_kwargs: Dict[str, Any]) -> WhiteningConfig:
    """The config the new layers of this call get (validated: ``ValueError`` naming a bad value)."""
    owner = f"convert_model(method={method!r})"
    whitening = {k: v for k, v in layer_kwargs.items() if k not in _LAYER_OPTIONS}
    if method == "direct":
        return make_config(DirectWhiten._CONFIG_CLASS, owner, layer_kwargs.get("config"), whitening,
                           exclude=DirectWhiten._unused_fields)
    return make_config(_GRAD_CLASSES[method][0]._CONFIG, owner, layer_kwargs.get("config"), whitening)


def _check_existing(model: nn.Module, method: str, layer_kwargs: Dict[str, Any]) -> None:
    """``ValueError`` when ``model`` holds whitening layers of another method or with other hyper-parameters.

    Converting again with the same method and arguments converts the targets
    that are still plain (e.g. after a partial conversion) and leaves the
    whitening layers as they are; anything else would silently mix layers.
    """
    config = _requested_config(method, layer_kwargs)
    group = layer_kwargs.get("process_group")
    for name, m in model.named_modules():
        if isinstance(m, DirectWhitened):
            have, layer = "direct", m.whiten
        elif isinstance(m, GRAD_LAYER_TYPES):
            have, layer = ("recursive" if m.method == "recursive" else "grad"), m
        else:
            continue
        where = f"'{name}'" if name else "the model"
        if have != method:
            raise ValueError(
                f"convert_model: the model is already converted with method={have!r} ({where} is a "
                f"{type(m).__name__}), so method={method!r} cannot be applied on top of it. Convert the plain model "
                "instead, or fold the whitening out first with export_model(model) and convert that."
            )
        if layer.config != config or layer.process_group is not group:
            what = ("another process_group" if layer.config == config else
                    f"{layer.config!r}, and this call asks for {config!r}")
            raise ValueError(
                f"convert_model: {where} was converted with {what}; converting again would leave it as it is. "
                "To change the hyper-parameters of converted layers, assign layer.config = "
                "layer.config.replace(...) for each layer of wl.whitening_layers(model) (it takes effect at the "
                "next fold), or convert the plain model with the new arguments."
            )


def _make_layer(method: str, module: nn.Module, name: str, layer_kwargs: Dict[str, Any]) -> nn.Module:
    if method == "direct":
        weight = module.weight
        linear = isinstance(module, nn.Linear)
        num = module.in_features if linear else module.in_channels
        groups = 1 if linear else module.groups
        whiten = DirectWhiten(num, device=weight.device, dtype=weight.dtype, groups=groups, **layer_kwargs)
        whiten.layer_name = f"{name}.whiten" if name else "whiten"
        new: nn.Module = DirectWhitened(whiten, module)
        new.train(module.training)
        _share_hooks(module, new, _CALL_HOOKS, move=True)
        return new
    conv_cls, lin_cls = _GRAD_CLASSES[method]
    if isinstance(module, nn.Linear):
        new = lin_cls.from_linear(module, **layer_kwargs)
    elif isinstance(module, nn.Conv2d):
        new = conv_cls.from_conv(module, **layer_kwargs)
    else:
        plain = nn.Conv1d if isinstance(module, nn.Conv1d) else nn.Conv3d
        new = _CONVND_CLASSES[method][plain].from_conv(module, **layer_kwargs)
    cast(WhiteningStatistics, new).layer_name = name or None
    new.train(module.training)
    _share_hooks(module, new, _CALL_HOOKS + _STATE_HOOKS)
    return new


def convert_model(
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
    report: bool = False,
    fold_strategy: str = "auto",
    absorb_centring: bool = True,
    **layer_kwargs: Any,
) -> Union[nn.Module, Tuple[nn.Module, "ConversionReport"]]:
    """Replace the target layers of ``model`` by whitening layers, in place; returns ``model``.

    Methods:

    * ``"grad"``: each target ``nn.Conv2d`` / ``nn.Linear`` becomes a
      :class:`~whitenlayers.GradWhitenConv2d` / :class:`~whitenlayers.GradWhitenLinear`
      (EVD transform, paper section 3); ``nn.Conv1d`` / ``nn.Conv3d`` become
      :class:`~whitenlayers.GradWhitenConv1d` / :class:`~whitenlayers.GradWhitenConv3d`;
    * ``"recursive"``: :class:`~whitenlayers.RecursiveWhitenConv2d` /
      :class:`~whitenlayers.RecursiveWhitenLinear` (and ``...Conv1d`` / ``...Conv3d``; paper section 4);
    * ``"direct"``: the target is wrapped as ``DirectWhitened(DirectWhiten(C, groups=G), target)``,
      i.e. the whitening ``y = T (x - mu)`` runs before the unchanged layer
      (features on dim 1 for a conv, on the last dim for an ``nn.Linear``).

    Grouped and depthwise convolutions are converted like the others, with
    whitening per group (block-diagonal ``T`` and ``Q_s``; see
    :mod:`whitenlayers.layers`).

    ``layer_kwargs`` go to every new whitening layer: the whitening
    hyper-parameters (``block_size``, ``alpha``, ``beta``, ...: the fields of
    :class:`~whitenlayers.EVDConfig` for ``grad``/``direct``, of
    :class:`~whitenlayers.RecursiveConfig` for ``recursive``), or a whole
    ``config=`` (with keywords applied on top), and ``process_group=`` (the
    group whose ranks sum their statistics at a fold; default: the world). An
    argument the method's layers do not take raises ``TypeError`` before
    anything is changed (``DirectWhiten`` has no ``beta``).

    Targets. ``targets="blocks"`` (the default, the paper's placement): every
    convolution (``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``, grouped and
    depthwise included) inside a residual block, including the block's
    downsample / shortcut conv, and nothing else (not the stem, not the
    classifier): 108 layers for CIFAR ResNet-110, 52 for ResNet-50 and for
    ResNeXt-50. A module is a residual block when its class, or one of its
    base classes, has one of the names in ``DEFAULT_BLOCK_TYPES``:
    ``BasicBlock`` and ``Bottleneck`` (torchvision, timm and most CIFAR
    ResNets, so a user's own ResNet converts too) and Hugging Face's
    ``ResNetBasicLayer`` and ``ResNetBottleNeckLayer``; ``block_types``
    replaces those names (classes or class names).
    ``targets="all"``: every convolution and ``nn.Linear`` of the model that a
    whitening layer can replace, except the stem (the model's first conv /
    linear layer in module order) and the classifier (the last one), which
    ``include_stem=True`` / ``include_classifier=True`` add (they add them
    with ``targets="blocks"`` too), and layers with more than
    ``max_features`` input features per group (default 8192 for ``"all"``,
    e.g. VGG's first classifier layer with 25088; no limit for ``"blocks"``
    unless given), whose ``M x M`` whitening state and ``O(M^3)`` fold would
    not be practical. ``include_linear`` says whether
    ``nn.Linear`` layers are targets: by default no for ``"blocks"`` and yes
    for ``"all"``; ``include_linear=True`` with ``"blocks"`` adds every plain
    ``nn.Linear`` (the classifier included).
    ``predicate(qualified_name, module) -> bool`` overrides the rule: it is
    asked about every convolution (and, with ``include_linear``, every
    ``nn.Linear``) that can be converted, subclasses included, and decides
    alone (combining it with ``block_types``, ``targets="all"``,
    ``include_stem`` or ``include_classifier`` is a ``ValueError``).
    Without a predicate only plain ``nn.Conv1d/2d/3d`` / ``nn.Linear`` are
    targeted, not subclasses (a subclass may override ``forward``, e.g. weight
    standardisation, which the whitening layer would silently drop).
    Never converted: transposed convolutions, uninitialised lazy modules, and
    the projections of ``nn.MultiheadAttention`` (it applies them itself,
    without calling them as modules). A model may also use other layers'
    weights without calling them (torchvision's Swin attention passes
    ``qkv.weight`` to a function): such a layer, once converted, never sees
    its input and cannot whiten. Pass ``example_input`` (a tensor, a tuple of
    positional arguments or a dict of keyword arguments) to run one eval-mode
    forward first: targets it does not call are then left out (and reported),
    and the stem and the classifier are the first and last layers *called*;
    without it, the first fold warns about every converted layer that saw no
    input.

    What is left out is always said. ``convert_model(..., report=True)``
    returns ``(model, report)``, a :class:`ConversionReport` listing every
    conv / linear layer (and ``nn.MultiheadAttention``) with what was done and
    why (:func:`conversion_report` gives the same without converting). A
    ``UserWarning`` names every layer the rule selected but that cannot be
    converted, and says when nothing was converted, and why.

    Converting again. A module that is already a whitening layer, or a
    wrapper from an earlier ``direct`` conversion, is left alone, so a second
    call with the same method and hyper-parameters converts only what is
    still plain (e.g. other targets) and never double-wraps. A second call
    with another method, other hyper-parameters or another
    ``process_group`` raises ``ValueError`` before changing anything. A
    module object that appears at several places is converted once and the
    new layer is put at each place.

    What is kept. The new layers share the original Parameter objects (an
    optimizer built before the conversion keeps working), so device, dtype and
    ``requires_grad`` carry over; the training flag is kept; hooks are kept:
    for ``grad``/``recursive`` the new layer takes over the original module's
    hook dictionaries (forward, forward-pre, backward and state-dict hooks;
    existing handles still remove them); for ``direct`` the call hooks move to
    the wrapper (so they see the same input and output as before) and the
    state-dict hooks stay on the wrapped layer. Each new whitening layer's
    ``layer_name`` is its qualified name (used in its error messages). At
    conversion time the whitening state is the identity (``mu = 0``,
    ``T = Q_s = I``), so the converted model computes exactly the same
    function, in train and eval mode.

    Centring absorbed by a BatchNorm (``grad`` / ``recursive``; docs/conventions.md).
    With ``absorb_centring=True`` (the
    default) every new layer whose output feeds a BatchNorm and nothing else
    (the rule of ``absorbing_batchnorms``: a ``torch.fx`` trace of the
    enclosing block's forward; in a ResNet every block conv, downsample convs
    included) gets ``layer.absorb_centring(bn)``: while that BatchNorm uses
    batch statistics the layer skips its centring offset, which the BatchNorm
    removes anyway (training unchanged up to rounding, one pass over the
    output and one backward reduction less per layer); eval mode and
    :func:`export_model` stay exact, and the export keeps the original keys
    (bias-free convs stay bias-free). ``layer.centring`` says which layers
    absorb. ``absorb_centring=False`` keeps every layer centring its input.
    Ignored for ``direct``.

    Folding. One :class:`~whitenlayers.fold.FoldCoordinator` is registered as a
    forward hook on ``model`` and given to every whitening layer: all layers
    whose block ends during a forward fold together after the model's forward
    (one set of collectives per block for the whole model under ``torch.distributed``).
    Converting a model that already has a coordinator reuses it.
    ``fold_strategy`` says how the transforms are computed under
    ``torch.distributed``: ``"replicated"`` (every rank computes every layer),
    ``"owner"`` (each layer folded on one rank, its new buffers sent to all) or ``"auto"``
    (owner when the layers' summed ``M^3`` is large; see
    :func:`whitenlayers.fold.fold_layers`). Convert
    before wrapping the model in ``DistributedDataParallel`` (buffers added
    after DDP's construction would not be synchronised); passing a DDP module
    raises ``ValueError``.

    The root. A bare conv / ``nn.Linear`` passed as ``model`` is converted
    only if ``predicate("", model)`` selects it, or with ``include_stem`` /
    ``include_classifier`` (it is both; the default rule never converts it:
    it is inside no block); the new layer is returned, and it folds on its own
    (no coordinator). Check the result with :func:`whitening_layers`.

    Example:
        >>> import whitenlayers as wl
        >>> model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=5)
        >>> len(wl.whitening_layers(model))
        18
        >>> type(model.layer1[0].conv1).__name__, model.layer1[0].conv1.layer_name
        ('GradWhitenConv2d', 'layer1.0.conv1')
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, but got method={method!r}")
    if fold_strategy not in STRATEGIES:
        raise ValueError(f"fold_strategy must be one of {STRATEGIES}, but got fold_strategy={fold_strategy!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("convert_model: convert the model before wrapping it in DistributedDataParallel")
    _check_layer_kwargs(method, layer_kwargs)
    _check_existing(model, method, layer_kwargs)
    plan = _plan(model, targets=targets, predicate=predicate, block_types=block_types, include_linear=include_linear,
                 include_stem=include_stem, include_classifier=include_classifier, example_input=example_input,
                 max_features=max_features)

    selected = [(name, module) for name, module, decision in plan if decision.status == "to convert"]
    absorbers = absorbing_batchnorms(model, selected) if (absorb_centring and method != "direct") else {}
    # Build every new layer first, so an error leaves the model untouched.
    new_by_id: Dict[int, nn.Module] = {}
    for name, module in selected:
        new_by_id[id(module)] = _make_layer(method, module, name, layer_kwargs)
    for key, (bn, parent) in absorbers.items():
        cast("_GradWhitenMixin", new_by_id[key]).absorb_centring(cast(_BatchNorm, bn), parent=parent)
    decisions = [d._replace(status="converted") if d.status == "to convert" else d for _, _, d in plan]
    result = ConversionReport(method, decisions)
    _warn_left_out(result, targets=targets, predicate=predicate, include_linear=include_linear,
                   model_has_whitening=bool(whitening_layers(model)))
    if id(model) in new_by_id:  # a bare layer passed as the model
        new_root = new_by_id[id(model)]
        return (new_root, result) if report else new_root
    if new_by_id:
        for parent in list(model.modules()):
            for child_name, child in list(parent._modules.items()):
                if child is not None and id(child) in new_by_id and not _is_whitening(parent):
                    setattr(parent, child_name, new_by_id[id(child)])
    _install_coordinator(model, fold_strategy)
    return (model, result) if report else model


def _warn_left_out(report: ConversionReport, *, targets: str, predicate, include_linear: Optional[bool],
                   model_has_whitening: bool) -> None:
    """The warnings of :func:`convert_model`: selected layers that cannot be converted; nothing converted."""
    def listing(items: Dict[str, str], limit: int = 6) -> str:
        parts = [f"'{n or '<root>'}' ({r})" for n, r in list(items.items())[:limit]]
        more = len(items) - limit
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")

    unsupported = report.unsupported
    if unsupported:
        warnings.warn(
            f"convert_model left out {len(unsupported)} layer(s) that the target rule selected but that cannot be "
            f"converted: {listing(unsupported)} (convert_model(..., report=True) lists every layer)",
            UserWarning, stacklevel=3,
        )
    if report.converted or model_has_whitening:
        return
    decisions = report.decisions
    if not decisions:
        msg = f"the model has no {_LAYER_WORDS} layer"
    elif predicate is not None:
        considered = [d for d in decisions if d.reason == "not selected by the predicate"]
        msg = f"the predicate selected none of the {len(considered)} layer(s) it was asked about"
        others = {d.name: d.reason for d in decisions if d.reason != "not selected by the predicate"}
        if others:
            msg += f"; not asked about: {listing(others)}"
    else:
        counts: Dict[str, int] = {}
        for d in decisions:
            counts[d.reason] = counts.get(d.reason, 0) + 1
        reasons = "; ".join(f"{n} x {r}" for r, n in counts.items())
        msg = f"{len(decisions)} conv/linear layer(s) found, none converted: {reasons}"
        if targets == "blocks":
            msg += (". Pass targets='all' to convert every conv and linear layer, block_types=... to name your "
                    "residual block classes, or a predicate")
    warnings.warn(f"convert_model found no layer to convert: {msg}", UserWarning, stacklevel=3)


# --------------------------------------------------------------------------
# export_model
# --------------------------------------------------------------------------
def _plain_conv_class(conv: "_ConvNd") -> type:
    return {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(conv.kernel_size)]


def _zero_padding(conv: "_ConvNd") -> bool:
    pad = getattr(conv, "_reversed_padding_repeated_twice", None)
    if pad is None:
        return conv.padding == "valid" or all(p == 0 for p in conv.padding)
    return all(p == 0 for p in pad)


@torch.no_grad()
def _export_direct(wrapper: DirectWhitened) -> nn.Module:
    layer: Any  # a conv (any dimension) or linear layer: the code reads the attributes of its kind
    whiten, layer = wrapper.whiten, wrapper.layer
    t = whiten.whitening_matrix.to(torch.float64)
    mu = whiten.running_mean.to(torch.float64)
    w = layer.weight
    b64 = layer.bias.to(torch.float64) if layer.bias is not None else None
    conv = not isinstance(layer, nn.Linear)
    if conv and not _zero_padding(layer):
        # conv(pad(T (x - mu))) != conv(pad(x)) with any constant bias at the border: keep a 1x1 whitening conv
        # (grouped like T: one k x k block per group).
        m, groups = whiten.num_features, whiten.groups
        pre = _plain_conv_class(layer)(m, m, 1, groups=groups, bias=True, device=w.device, dtype=w.dtype)
        pre.weight.copy_(t.reshape((m, m // groups) + (1,) * len(layer.kernel_size)))
        pre.bias.copy_(-_transform_mean(t, mu))
        pre.weight.requires_grad_(w.requires_grad)
        out: Any = nn.Sequential(pre, layer)  # or (below) the plain conv or linear layer
    else:
        # layer(T (x - mu)) = layer(x; W T) - sum_k (W T)_k mu: exact for unpadded convs and linear layers.
        if t.dim() == 3:  # grouped: W_g T_g per group of output channels
            g = t.shape[0]
            w64 = w.to(torch.float64)
            wt = torch.einsum("gsi...,gij->gsj...", w64.reshape((g, w.shape[0] // g) + tuple(w.shape[1:])), t)
            wt = wt.reshape(w.shape)
            offset = F_w.weight_mean_product(wt, mu)
        else:
            wt = torch.einsum("oi...,ij->oj...", w.to(torch.float64), t)
            offset = wt.reshape(wt.shape[0], wt.shape[1], -1).sum(-1) @ mu
        bias = (b64 if b64 is not None else torch.zeros_like(offset)) - offset
        if conv:
            out = _plain_conv_class(layer)(
                layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=True,
                padding_mode=layer.padding_mode, device=w.device, dtype=w.dtype)
        else:
            out = nn.Linear(layer.in_features, layer.out_features, bias=True, device=w.device, dtype=w.dtype)
        out.weight.copy_(wt)
        out.bias.copy_(bias)
        out.weight.requires_grad_(w.requires_grad)
        _share_hooks(layer, out, _STATE_HOOKS)
    _share_hooks(wrapper, out, _CALL_HOOKS)
    out.train(wrapper.training)
    return out


@torch.no_grad()
def _export_absorbed(layer: Any) -> nn.Module:  # a grad layer (conv of any dimension or linear)
    """A layer whose centring its BatchNorm absorbs: the plain layer with the original keys, ``s - d`` moved into
    the BatchNorm's ``running_mean`` (exact: the BatchNorm subtracts it; in training mode it removes any offset)."""
    w = layer.weight
    has_bias = layer.bias is not None
    if not isinstance(layer, nn.Linear):
        out: Any = _plain_conv_class(layer)(  # the plain conv, or (below) linear layer
            layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride, padding=layer.padding,
            dilation=layer.dilation, groups=layer.groups, bias=has_bias, padding_mode=layer.padding_mode,
            device=w.device, dtype=w.dtype,
        )
    else:
        out = nn.Linear(layer.in_features, layer.out_features, bias=has_bias, device=w.device, dtype=w.dtype)
    out.weight.copy_(w)
    out.weight.requires_grad_(w.requires_grad)
    if has_bias:
        out.bias.copy_(layer.bias)
        out.bias.requires_grad_(layer.bias.requires_grad)
    bn = layer._absorbing_bn()
    if bn.running_mean is not None:
        shift = layer._skipped_offset(w.detach().to(torch.float64)) - layer.absorbed_offset.to(torch.float64)
        bn.running_mean.copy_((bn.running_mean.to(torch.float64) - shift).to(bn.running_mean.dtype))
    out.train(layer.training)
    return out


def _export_one(module: nn.Module) -> Optional[nn.Module]:
    if isinstance(module, DirectWhitened):
        return _export_direct(module)
    if isinstance(module, GRAD_LAYER_TYPES):
        if module.centring == "absorbed" and module._absorbing_bn() is not None:
            out = _export_absorbed(module)
        elif isinstance(module, GradWhitenLinear):
            out = module.to_linear()
        else:
            out = module.to_conv()
        _share_hooks(module, out, _CALL_HOOKS + _STATE_HOOKS)
        return out
    return None


def export_model(model: nn.Module) -> nn.Module:
    """Fold the whitening out of ``model``, in place; returns the plain model.

    * Every grad / recursive layer that centres its input becomes a plain
      ``nn.Conv2d`` / ``nn.Linear`` (:meth:`~whitenlayers.GradWhitenConv2d.to_conv`):
      same weight, the running mean folded into the bias. Outputs are
      identical; the layer always has a bias afterwards (``bias - sum_k W_k mu``,
      plus the bias compensation of a bias-free layer).
    * A grad / recursive layer whose centring a following BatchNorm absorbs
      (``layer.centring == "absorbed"``, the default of :func:`convert_model`
      where the output feeds only a BatchNorm) becomes the plain layer with
      the original's bias setting (bias-free stays bias-free), and its offset
      (``s - d``, see :meth:`~whitenlayers.GradWhitenConv2d.absorb_centring`)
      is subtracted from that BatchNorm's ``running_mean`` (computed in
      float64): exact in eval mode, and in training mode the BatchNorm
      removes any offset anyway. The export then has the state-dict keys of
      the original architecture.
    * Every ``direct`` wrapper :class:`DirectWhitened` becomes, when exact,
      one plain layer with weight ``W T`` and bias ``b - sum_k (W T)_k mu``:
      always for ``nn.Linear``, and for an ``nn.Conv2d`` without padding
      (1x1 downsample convs). A padded conv cannot absorb ``T`` and ``mu``
      (its zero border would have to be ``-T mu``), so it becomes
      ``nn.Sequential(Conv2d(C, C, 1) with weight T and bias -T mu, conv)``:
      exact, plain PyTorch, but with the extra 1x1 conv the direct method
      costs anyway. State-dict keys there are ``name.0.*`` and ``name.1.*``.
    * A bare :class:`~whitenlayers.DirectWhiten` not created by
      :func:`convert_model` is left alone.

    The new modules have new Parameters (an optimizer must be rebuilt), the
    original training flag and the call hooks of the replaced module. The
    :class:`~whitenlayers.fold.FoldCoordinator` hooks are removed. A partial block
    and the whitening state are dropped: the export computes what the
    converted model computes in eval mode now. A whitening layer passed as
    ``model`` is returned exported.
    """
    out = _export_one(model)
    if out is not None:
        return out
    done: Dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        if _is_whitening(parent):
            continue
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in done:
                new = _export_one(child)
                if new is None:
                    continue
                done[id(child)] = new
            setattr(parent, child_name, done[id(child)])
    for m in model.modules():
        _remove_coordinators(m)
    return model


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
class _LoadResult(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def _positions(model: nn.Module) -> Dict[str, nn.Module]:
    """Qualified name -> grad/recursive layer or DirectWhitened wrapper."""
    return {n: m for n, m in model.named_modules() if isinstance(m, GRAD_LAYER_TYPES + (DirectWhitened,))}


@torch.no_grad()
def _reset_to_identity(layer: WhiteningStatistics) -> None:
    """The state right after conversion: ``mu = 0``, ``T = Q_s = I``, no blocks, no bias compensation."""
    layer.reset_running_stats()  # keeps the function through bias_correction, zeroed next (a fold never writes a bias)
    if getattr(layer, "bias_correction", None) is not None:
        cast("_GradWhitenMixin", layer).bias_correction.zero_()
    absorbed = getattr(layer, "_buffers", {}).get("absorbed_offset")
    if absorbed is not None:
        absorbed.zero_()  # the checkpoint's BatchNorm running mean is the plain model's: d = 0


def load_plain_state_dict(model: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> _LoadResult:
    """Load a checkpoint of the *unconverted* architecture into a converted ``model``.

    Keys are translated (``name.weight`` -> ``name.layer.weight`` for a
    ``direct`` wrapper; for a bias-free grad/recursive layer an incoming
    ``name.bias``, as written by :func:`plain_state_dict`, goes to its
    ``bias_correction``), every whitening layer is reset to the identity state
    of a fresh conversion (``mu = 0``, ``T = Q_s = I``, no blocks, no partial
    block), and the parameters and other buffers are loaded. The converted
    model then computes exactly what the plain model with that checkpoint
    computes. With ``strict`` a key of the checkpoint that has no place, or a
    key of the model that the checkpoint lacks (the whitening state aside),
    raises ``RuntimeError`` before anything is changed. Returns
    ``(missing_keys, unexpected_keys)`` like ``load_state_dict``.

    Example:
        >>> import torch, whitenlayers as wl
        >>> plain = wl.models.resnet20()
        >>> model = wl.convert_model(wl.models.resnet20(), method="direct")
        >>> wl.load_plain_state_dict(model, plain.state_dict())
        _LoadResult(missing_keys=[], unexpected_keys=[])
    """
    positions = _positions(model)
    translated: Dict[str, Any] = {}
    key_map: Dict[str, str] = {}
    for key, value in state_dict.items():
        new_key = key
        head, _, leaf = key.rpartition(".")
        pos = positions.get(head)
        if isinstance(pos, DirectWhitened):
            new_key = f"{head}.layer.{leaf}"
        elif pos is not None and leaf == "bias" and pos.bias is None:
            new_key = f"{head}.bias_correction"
        translated[new_key] = value
        key_map[key] = new_key
    whitening_state = set()
    for name, layer in whitening_layers(model):
        prefix = f"{name}." if name else ""
        for key in cast(nn.Module, layer).state_dict().keys():
            if key not in ("weight", "bias", "bias_correction"):
                whitening_state.add(prefix + key)
        if getattr(layer, "bias_correction", None) is not None:
            whitening_state.add(prefix + "bias_correction")  # zero when the checkpoint has no bias
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        translated = OrderedDict(translated)
        translated._metadata = OrderedDict(  # type: ignore[attr-defined]
            (f"{k}.layer" if isinstance(positions.get(k), DirectWhitened) else k, v) for k, v in metadata.items()
        )
    model_keys = set(model.state_dict().keys())
    missing = sorted(k for k in model_keys - set(translated) if k not in whitening_state)
    unexpected = sorted(k for k, new_key in key_map.items() if new_key not in model_keys)
    if strict and (missing or unexpected):
        raise RuntimeError(
            "load_plain_state_dict: checkpoint does not match the model: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    for _, layer in whitening_layers(model):
        _reset_to_identity(layer)
    for key in [k for k in translated if k not in model_keys]:
        del translated[key]
    model.load_state_dict(translated, strict=False)
    return _LoadResult(missing, unexpected)


def _not_original(model: nn.Module) -> Dict[str, str]:
    """Qualified name -> why the original architecture cannot hold that converted layer's current function."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, DirectWhitened):
            layer = module.layer
            if not isinstance(layer, nn.Linear) and not _zero_padding(cast("_ConvNd", layer)):
                out[name] = ("a padded direct conv: its zero border would have to be -T mu, so it exports as "
                             "Sequential(1x1 whitening conv, conv)")
        elif isinstance(module, GRAD_LAYER_TYPES) and module.bias is None:
            if not (module.centring == "absorbed" and module._absorbing_bn() is not None):
                out[name] = "a bias-free layer that centres its input: the centring needs a bias the original lacks"
    return out


def plain_state_dict(model: nn.Module, strict: bool = True) -> Dict[str, Any]:
    """The converted ``model``'s current function as a checkpoint of the original architecture (no whitening state).

    It is ``export_model(copy.deepcopy(model)).state_dict()`` (see
    :func:`export_model`). With ``strict`` (default) its keys are exactly
    those of the unconverted architecture: it loads with ``strict=True`` into
    a fresh unconverted model, which then computes what the converted model
    computes in eval mode. That holds for every grad / recursive layer whose
    centring a BatchNorm absorbs (the default of :func:`convert_model` in
    every ResNet; the offsets move into the BatchNorms' ``running_mean``),
    every layer with a bias, and every unpadded ``direct`` layer (linear, 1x1
    convs). Two kinds of layer have no exact form in the original
    architecture, and with ``strict`` a ``ValueError`` names them:

    * a padded ``direct`` conv (``conv(pad(T (x - mu)))``: the zero border
      would have to be ``-T mu``); :func:`export_model` turns it into
      ``nn.Sequential(1x1 whitening conv, conv)``, keys ``name.0.*`` and
      ``name.1.*``;
    * a bias-free grad / recursive layer that centres its input (converted
      with ``absorb_centring=False``, or not followed by a BatchNorm): its
      export needs a ``bias`` (the running mean folded in).

    ``strict=False`` returns the export's state dict as it is, those extra
    keys included; :func:`load_plain_state_dict` loads it back into a
    converted model, and :func:`export_model` gives the matching module.
    """
    if strict:
        bad = _not_original(model)
        if bad:
            reasons: Dict[str, List[str]] = {}
            for name, why in bad.items():
                reasons.setdefault(why, []).append(repr(name))
            listing = "; ".join(f"{', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}: "
                                f"{why}" for why, names in reasons.items())
            raise ValueError(
                f"plain_state_dict: the original architecture cannot hold the function of {len(bad)} converted "
                f"layer(s): {listing}. Use wl.export_model(copy.deepcopy(model)) for a plain model with that extra "
                "structure, or plain_state_dict(model, strict=False) for its checkpoint (load it back with "
                "wl.load_plain_state_dict)")
    return export_model(copy.deepcopy(model)).state_dict()
