"""Model surgery: :func:`convert_model` replaces the target layers with whitening layers, in place."""
from __future__ import annotations

import collections
import contextlib
import warnings
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterator,
    Optional,
    Tuple,
    Union,
    cast,
)

from torch import nn
from torch.nn.utils import parametrize

from .._rebuild import modes_kept
from ..coordinator import FoldCoordinator, check_fold_async
from ..fold import check_strategy
from ..layers import (
    GRAD_LAYER_TYPES,
    WhiteningLayer,
)
from ..methods import get_method
from ..patches import PATCH_MAX_FEATURES
from ..privacy import register_if_loaded
from ._common import (
    _CALL_HOOKS,
    _STATE_HOOKS,
    BlockTypes,
    DirectWhitenWrapper,
    Predicate,
    _coordinators,
    _share_hooks,
    _swap_in,
)
from .absorb import absorbing_batchnorms
from .targets import _LAYER_WORDS, ConversionReport, TargetSpec, _plan, whitening_layers

if TYPE_CHECKING:  # pragma: no cover

    from ..layers import _GradWhitenMixin

# --------------------------------------------------------------------------
# Hooks and the fold coordinator
# --------------------------------------------------------------------------
def _install_coordinator(model: nn.Module, strategy: str, fold_async: bool) -> None:
    layers = [m for _, m in whitening_layers(model)]
    if not layers:
        return
    existing = _coordinators(model)
    if existing:
        _, coord = existing[0]
        if coord.fold_async and not fold_async:
            coord.wait()  # its folds in flight are written at the layers' next block ends, as loaded ones are
        coord.strategy = strategy
        coord.fold_async = fold_async
    else:
        coord = FoldCoordinator(strategy, fold_async)
        # always called: a forward that raises still folds the layers whose block ended in it
        coord.handle = model.register_forward_hook(coord, always_call=True)
    if not any(getattr(h, "__self__", None) is coord for h in model._forward_pre_hooks.values()):
        coord.begin_handle = model.register_forward_pre_hook(coord.begin_forward)
    for layer in layers:
        layer._fold_coordinator = coord
    coord.layers = layers
    coord.checked = False  # the first fold checks that every layer is called (FoldCoordinator)




# --------------------------------------------------------------------------
# convert_model
# --------------------------------------------------------------------------
def _check_existing(model: nn.Module, method: str, layer_kwargs: Dict[str, Any]) -> None:
    """``ValueError`` when ``model`` holds whitening layers of another method or with other hyper-parameters.

    Converting again with the same method and arguments converts the targets
    that are still plain (e.g. after a partial conversion) and leaves the
    whitening layers as they are; anything else would silently mix layers.
    """
    owner = f"convert_model(method={method!r})"
    rule, config = get_method(method).rule_and_config(owner, layer_kwargs)
    group = layer_kwargs.get("process_group")
    for name, m in model.named_modules():
        if isinstance(m, DirectWhitenWrapper):
            layer = m.whiten
        elif isinstance(m, GRAD_LAYER_TYPES):
            layer = m
        else:
            continue
        have = layer.method
        where = f"'{name}'" if name else "the model"
        if have != method:
            raise ValueError(
                f"convert_model: the model is already converted with method={have!r} ({where} is a "
                f"{type(m).__name__}), so method={method!r} cannot be applied on top of it. Convert the plain model "
                "instead, or fold the whitening out first with to_plain_model(model) and convert that."
            )
        if type(layer.rule) is not rule:
            raise ValueError(
                f"convert_model: {where} was converted with the rule {layer.rule.name!r} "
                f"({type(layer.rule).__name__}), and this call asks for {rule.name!r} ({rule.__name__}); converting "
                "again would leave it as it is. Convert the plain model with the new rule instead."
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
    spec = get_method(method)
    linear = isinstance(module, nn.Linear)
    new: nn.Module
    if spec.wrapper is not None:  # direct: DirectWhiten in front of the unchanged layer
        weight = module.weight
        num = module.in_features if linear else module.in_channels
        groups = 1 if linear else module.groups
        whiten = spec.wrapper(num, device=weight.device, dtype=weight.dtype, groups=groups, **layer_kwargs)
        whiten.layer_name = f"{name}.whiten" if name else "whiten"
        new = DirectWhitenWrapper(whiten, module)
        _share_hooks(module, new, _CALL_HOOKS, move=True)
    else:
        cls = cast(Any, spec.layer_class(module))
        new = cls.from_linear(module, **layer_kwargs) if linear else cls.from_conv(module, **layer_kwargs)
        cast(WhiteningLayer, new).layer_name = name or None
        _share_hooks(module, new, _CALL_HOOKS + _STATE_HOOKS)
    new.train(module.training)
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
    stem_patches: bool = False,
    example_input: Any = None,
    report: bool = False,
    fold_strategy: str = "auto",
    fold_async: bool = False,
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
    * ``"direct"``: the target is wrapped as ``DirectWhitenWrapper(DirectWhiten(C, groups=G), target)``,
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

    Patch whitening of the stem (an extension beyond the paper; :mod:`whitenlayers.patches`).
    ``stem_patches=True`` (with ``include_stem=True``, method ``"grad"`` or
    ``"recursive"``, a 2-D stem with ``groups=1`` and zero padding) makes the
    stem whiten its unfolded ``C k^2`` input patches instead of its ``C``
    channels (``features="patches"``). Its state is ``C k^2 x C k^2``: a stem
    with more than ``max_features`` patch features (default
    ``PATCH_MAX_FEATURES``, 1024) raises ``ValueError``.

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
    :func:`to_plain_model` stay exact, and the export keeps the original keys
    (bias-free convs stay bias-free). ``layer.centring`` says which layers
    absorb. ``absorb_centring=False`` keeps every layer centring its input.
    Ignored for ``direct``.

    Folding. One :class:`~whitenlayers.coordinator.FoldCoordinator` is registered as a
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

    ``fold_async=True`` takes the folds off the training thread: a block's
    fold runs in a worker thread (on CUDA, on a stream of its own) while the
    next block trains, and is written at the end of that next block, so the
    transform built from block ``i`` is in force from block ``i + 2`` on (one
    block later than the default). Training waits there if the fold has not
    finished, so the result never depends on timing (two runs are
    bit-identical); the bias compensation still keeps the function unchanged
    when it is written, ranks stay bit-identical (every rank folds every
    layer: ``fold_strategy="owner"`` is refused), and a checkpoint taken
    while a fold is in flight saves its result. ``layer.fold()`` still folds
    at once (a pending fold written first). What it buys: on a CPU with a
    spare core, grad's fold leaves the step; on a GPU (an H200) the steps
    that run beside the worker pay most of it back, so it is not a GPU
    setting; on Fashion-MNIST the lag cost grad no measurable accuracy
    (docs/CONVERGENCE.md, finding 14). See the performance guide.

    The root. A bare conv / ``nn.Linear`` passed as ``model`` is converted
    only if ``predicate("", model)`` selects it, or with ``include_stem`` /
    ``include_classifier`` (it is both; the default rule never converts it:
    it is inside no block); the new layer is returned, and it folds on its own
    (no coordinator). Check the result with :func:`whitening_layers`.

    Args:
        model: the model to convert, in place (not wrapped in ``DistributedDataParallel`` yet).
        method: ``"grad"`` (default: EVD gradient whitening, the cheapest), ``"recursive"`` (rank-one
            ``O(M^2)`` steps for ``T`` and ``Q``, no EVD; each fold tracks ``Phi_y = T Phi_x T^T`` with two ``M^3``
            products, about half an EVD fold's time for wide layers) or
            ``"direct"`` (whitens the activations themselves; costs an extra pass and memory).
        targets: ``"blocks"`` (default: the convolutions inside residual blocks, the paper's placement) or
            ``"all"`` (every convertible conv / linear layer but the stem and the classifier): for models
            without residual blocks.
        predicate: ``predicate(qualified_name, module) -> bool`` choosing the targets alone; default
            ``None`` (the rule of ``targets``). Cannot be combined with ``block_types``, ``targets="all"``,
            ``include_stem`` or ``include_classifier``.
        block_types: the residual-block classes or class names that replace ``DEFAULT_BLOCK_TYPES``
            (default ``None``): for your own block class with another name.
        include_linear: whether ``nn.Linear`` layers are targets (default ``None``: no for ``"blocks"``,
            yes for ``"all"``).
        include_stem: also convert the model's first conv / linear layer (default ``False``).
        include_classifier: also convert the model's last conv / linear layer (default ``False``).
        max_features: the largest number of input features per group a target may have (default
            ``None``: 8192 for ``"all"``, no limit for ``"blocks"``, 1024 patch features for
            ``stem_patches``), an integer >= 1: a bound on the ``M x M`` state and ``O(M^3)`` fold.
        stem_patches: whiten the stem's unfolded input patches instead of its channels (default
            ``False``; needs ``include_stem=True`` and a ``grad`` / ``recursive`` method).
        example_input: a tensor, a tuple of positional arguments or a dict of keyword arguments for one
            eval-mode forward that finds the layers the model actually calls (default ``None``: none).
            Pass it for models that use some layers' weights without calling them.
        report: also return a :class:`ConversionReport` (default ``False``: return the model alone).
        fold_strategy: ``"auto"`` (default), ``"replicated"`` or ``"owner"``: how the transforms are
            computed under ``torch.distributed`` (ignored on one process).
        fold_async: fold in a worker thread, one block late (default ``False``; above). Needs a model with a
            coordinator (not a bare layer) and a strategy other than ``"owner"``.
        absorb_centring: let a BatchNorm that alone consumes a converted layer's output absorb its
            centring (default ``True``: faster, same training up to rounding); ``False`` keeps every layer
            centring. Ignored for ``"direct"``.
        **layer_kwargs: for every new layer: the whitening hyper-parameters (the fields of
            :class:`~whitenlayers.EVDConfig` for ``grad`` / ``direct``, of
            :class:`~whitenlayers.RecursiveConfig` for ``recursive``, each documented there), ``config=``,
            ``process_group=``, ``rule=`` (a :class:`~whitenlayers.TransformRule` subclass or a registered name,
            each layer getting its own instance; the fields of the rule's config class are keyword arguments
            then). Default: none (the paper's values, the built-in rules).

    Returns:
        ``model`` (the new layer when ``model`` itself is a converted conv / linear layer), or
        ``(model, report)`` with ``report=True``.

    Example:
        >>> import whitenlayers as wl
        >>> model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=5)
        >>> len(wl.whitening_layers(model))
        18
        >>> type(model.layer1[0].conv1).__name__, model.layer1[0].conv1.layer_name
        ('GradWhitenConv2d', 'layer1.0.conv1')
    """
    _check_arguments(model, method, fold_strategy, layer_kwargs)
    check_fold_async(fold_async, fold_strategy)
    # Reading a parametrized weight (shapes, dtypes) must not advance a parametrization's training step (spectral
    # norm's power iteration): they run in eval mode while the model is converted.
    with _parametrizations_in_eval(model):
        plan = _plan(model, TargetSpec(targets, predicate, block_types, include_linear, include_stem,
                                       include_classifier, max_features, example_input))
        selected = [(name, module) for name, module, decision in plan if decision.status == "to convert"]
        patch_stem = _patch_stem(plan, method, include_stem, max_features) if stem_patches else None
        # Build every new layer first, so an error leaves the model untouched (by the id of the module it replaces;
        # the stem whitens its patches when it is patch_stem).
        new_by_id = {id(module): _make_layer(method, module, name, dict(layer_kwargs, features="patches")
                                             if module is patch_stem else layer_kwargs) for name, module in selected}
        if absorb_centring and method != "direct":  # each BatchNorm that alone consumes a new layer's output
            for key, (bn, parent) in absorbing_batchnorms(model, selected).items():
                cast("_GradWhitenMixin", new_by_id[key]).absorb_centring(bn, parent=parent)
        result = ConversionReport(method, [d._replace(status="converted") if d.status == "to convert" else d
                                           for _, _, d in plan])
        _warn_left_out(result, targets=targets, predicate=predicate, model_has_whitening=bool(whitening_layers(model)))
        if id(model) in new_by_id:  # a bare layer passed as the model
            if fold_async:
                raise ValueError(f"convert_model: fold_async=True needs a model that contains the layers it converts "
                                 f"(their fold coordinator writes each asynchronous fold), but the model itself is the "
                                 f"target (a bare {type(model).__name__}), which folds on its own: convert it with "
                                 "fold_async=False, or wrap it in a module")
            model = new_by_id[id(model)]
        else:
            _swap_in(model, lambda m: new_by_id.get(id(m)))
            _install_coordinator(model, fold_strategy, fold_async)
        return (model, result) if report else model


def _check_arguments(model: nn.Module, method: str, fold_strategy: str, layer_kwargs: Dict[str, Any]) -> None:
    """:func:`convert_model`'s checks before anything is built: a known method and strategy, keyword arguments
    that method takes, a model not wrapped in DDP yet, no whitening of another kind already in it."""
    get_method(method)
    check_strategy(fold_strategy, "fold_strategy")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("convert_model: convert the model before wrapping it in DistributedDataParallel")
    _check_existing(model, method, layer_kwargs)  # (the keyword arguments checked as the layers' config is made)
    _check_not_quantized(model)
    register_if_loaded()  # Opacus' validator refuses the layers this makes, where Opacus is loaded (privacy.py)


def _check_not_quantized(model: nn.Module) -> None:
    """A model prepared for quantization (fake quantization or observers: ``prepare_qat`` / ``prepare``) is refused:
    converting its convolutions would drop their fake quantization without a word."""
    for name, m in model.named_modules():
        if "weight_fake_quant" in m._modules or "activation_post_process" in m._modules:
            where = f"'{name}'" if name else "the model"
            raise ValueError(
                f"convert_model: {where} ({type(m).__name__}) is prepared for quantization (fake quantization or "
                "observers, torch.ao.quantization.prepare_qat / prepare); whitening layers have no quantized form "
                "and converting would drop it. Convert the float model, train it, then quantize the plain model: "
                "wl.to_plain_model(copy.deepcopy(model)), prepare_qat and fine-tune (or prepare and calibrate)."
            )


@contextlib.contextmanager
def _parametrizations_in_eval(model: nn.Module) -> Iterator[None]:
    """Every parametrization of ``model`` (``torch.nn.utils.parametrize``) in eval mode inside the block."""
    mods = [p for m in model.modules() if isinstance(m, parametrize.ParametrizationList) for p in m.modules()]
    with modes_kept(mods):
        for p in mods:
            p.training = False
        yield


def _patch_stem(plan, method: str, include_stem: bool, max_features: Optional[int]) -> Optional[nn.Module]:
    """The stem that ``stem_patches=True`` converts with patch features (``ValueError`` when it cannot)."""
    if not include_stem:
        raise ValueError("convert_model: stem_patches=True needs include_stem=True (it changes how the stem whitens)")
    if method == "direct":
        raise ValueError("convert_model: stem_patches=True needs method 'grad' or 'recursive', not 'direct'")
    name, stem, decision = next((entry for entry in plan if entry[2].role == "stem"), ("", None, None))
    if decision is None or decision.status != "to convert":
        return None  # no stem, or one left out (the report says why)
    where = f"stem '{name or '<root>'}'"
    if type(stem) is not nn.Conv2d or stem.groups != 1 or stem.padding_mode != "zeros":
        raise ValueError(f"convert_model: stem_patches=True needs a 2-D convolution with groups=1 and zero padding as "
                         f"the stem, but the {where} is {stem!r}")
    k = stem.in_channels * stem.kernel_size[0] * stem.kernel_size[1]
    cap = max_features if max_features is not None else PATCH_MAX_FEATURES
    if k > cap:
        raise ValueError(f"convert_model: the {where} has {k} patch features (C k^2), more than max_features={cap}: "
                         f"a {k} x {k} whitening state and product per output position; pass a larger max_features "
                         "to convert it anyway")
    return stem


def _warn_left_out(report: ConversionReport, *, targets: str, predicate, model_has_whitening: bool) -> None:
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
        counts = collections.Counter(d.reason for d in decisions)
        reasons = "; ".join(f"{n} x {r}" for r, n in counts.items())
        msg = f"{len(decisions)} conv/linear layer(s) found, none converted: {reasons}"
        if targets == "blocks":
            msg += (". Pass targets='all' to convert every conv and linear layer, block_types=... to name your "
                    "residual block classes, or a predicate")
    warnings.warn(f"convert_model found no layer to convert: {msg}", UserWarning, stacklevel=3)
