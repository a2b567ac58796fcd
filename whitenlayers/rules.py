"""Transform rules: how a layer's ``T`` and ``Q`` are computed from its statistics at a fold.

A rule is stateless apart from its hyper-parameters (a frozen config of
:mod:`whitenlayers.config`); the state (running statistics, buffers, counters,
checkpoints) is :class:`~whitenlayers.WhiteningLayer`'s. At a fold
the state hands the rule a :class:`Fold` (the block's statistics and the new
moments), checks what the rule returns (:class:`RuleResult`) and writes it.
A new rule is a :class:`TransformRule` subclass (and, for extra
hyper-parameters, a config subclass), passed as ``rule=`` to
:func:`~whitenlayers.convert_model` or a layer; nothing here is edited
(``docs/writing-a-rule.md``).

* :class:`EVDRule` (paper section 3): ZCA ``T = V diag(g)^(1/2) V^T`` from an
  eigendecomposition of ``Phi_x``, ``Q = T^T T``. Layers folding together
  share one batched ``eigh`` per width (``EVDRule.batch_key``). With
  ``gains="damped"``: ``Q = c (Phi_x + d I)^-1`` and the Cholesky whitening
  ``T``, one batched Cholesky factorisation instead.
* :class:`RecursiveRule` (paper section 4): ``Phi_y`` tracked on the whitened
  features (two ``M^3`` products per fold), then one ``O(M^2)`` rank-one power reduction plus leakage.

Grouped layers (``groups > 1``) hand in their statistics as ``(G, k, k)``
diagonal blocks (:mod:`whitenlayers.functional`, "Grouped features"): the EVD
rule decomposes all blocks in one batched ``eigh`` (layers whose blocks have
one size share it) with layer-wide gains; the recursive rule takes one step per
group, vectorised over the groups.
"""
from __future__ import annotations

import dataclasses
import json
import weakref
from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Type, Union, cast

import torch
from torch import Tensor

from . import functional as F_w
from .config import EVDConfig, RecursiveConfig, WhiteningConfig, make_config
from .functional import BlockSummary

__all__ = ["Fold", "RuleResult", "TransformRule", "EVDRule", "RecursiveRule", "register_rule", "resolve_rule",
           "rule_for", "NOT_COMPUTED"]

class _NotComputed:
    """The type of :data:`NOT_COMPUTED` (a sentinel that says what it is in signatures and messages)."""

    def __repr__(self) -> str:
        return "NOT_COMPUTED"


#: ``update``'s ``precomputed`` when nothing was computed for the layer in a batched call (:meth:`TransformRule.
#: compute_batched`): a layer folded alone, or a rule that does not batch.
NOT_COMPUTED: Any = _NotComputed()


class Fold(NamedTuple):
    """What a rule gets at a fold: the block (summed over ranks) and the layer's moments after it.

    Every tensor is float64, on the layer's device. A dense layer's matrices are ``(M, M)``; a grouped layer's
    (``groups = G > 1``) are its ``G`` diagonal blocks ``(G, k, k)``, ``k = M / G`` (vectors stay ``(M,)``).
    In :meth:`TransformRule.compute_batched` every tensor has a leading layer dimension and ``first`` is one flag
    per layer.
    """

    #: The block's statistics (:class:`~whitenlayers.functional.BlockSummary`: row count, mean, scatter about
    #: the mean, uncentred power), summed over ranks.
    block: BlockSummary
    #: ``mu(i)``, the new running mean ``(M,)``.
    mean: Tensor
    #: ``Phi_x(i)``, the new running covariance (eq. ``vPhixi``): what the EVD rules decompose.
    cov: Tensor
    #: The block's covariance about ``mu(i)``: the new term of eq. ``vPhixi``.
    block_cov: Tensor
    #: ``True`` for the layer's first counted block (block 0: no recursion, eqs. ``vmuxnz``, ``vPhixnz``).
    first: Union[bool, List[bool]]


class RuleResult(NamedTuple):
    """What a rule returns: the new ``T``, the unsmoothed ``Q`` and the rule's own buffers.

    The layer checks a result before writing it (shapes, a float32 / float64 dtype, finite values, ``gram``
    symmetric to the dtype's rounding); a result that fails is dropped like a failed update (the previous
    transform is kept, counted in ``transform_failures``) and the layer warns once, naming the rule and the problem.
    """

    #: ``T`` (the layer's matrix shape: ``(M, M)`` or ``(G, k, k)``): applied to the features by ``DirectWhiten``,
    #: read by the diagnostics (``T Phi_x T^T``) and by the recursive rule.
    transform: Tensor
    #: ``Q = T^T T``, unsmoothed (symmetric): the grad layers smooth it into ``Q_s = beta Q_s + (1 - beta) Q``
    #: (eq. 35) outside the rule and train on ``Q_s`` alone.
    gram: Tensor
    #: New values of the rule's own buffers (:meth:`TransformRule.initial_buffers`), by name; ``{}`` for none.
    buffers: Dict[str, Tensor]
    #: Whether the update was clamped (counted in the layer's ``clamped_steps``).
    clamped: bool = False


class TransformRule:
    """The base class of a transform rule: how a layer's ``T`` and ``Q`` follow from its statistics at a fold.

    A rule is to a whitening layer what an optimizer class is to ``torch.optim``: subclass it, set :attr:`name`
    (the rule's name in checkpoints and messages) and :attr:`config_class`, implement :meth:`update`, and
    pass the class as ``rule=`` to :func:`~whitenlayers.convert_model` or to a layer's constructor (or
    :func:`register_rule` it and pass its name). Each layer gets its own instance, built with the layer's config
    (``self.config``, a frozen :attr:`config_class`; a subclass of :class:`~whitenlayers.EVDConfig` for ``grad``
    and ``direct`` layers, of :class:`~whitenlayers.RecursiveConfig` for ``recursive`` ones, with any extra
    hyper-parameters as fields). State that must survive a checkpoint lives in the layer's buffers: the contract
    buffers, and the rule's own (:meth:`initial_buffers`), which :meth:`update` reads from ``state`` and returns
    new values of. The rule's name and config are saved in the layer's checkpoint (``whitening_rule``), and a
    checkpoint of another rule does not load.

    A subclass that overrides :meth:`update` but not :meth:`compute_batched` folds each layer alone: batched
    results reach only the class that computed them. ``docs/writing-a-rule.md`` walks through an example.
    """

    #: The name of the rule, saved in checkpoints, shown in messages and the key of :func:`register_rule`'s
    #: registry. Every rule class sets its own.
    name: str = ""
    #: The config class its instances take (exactly this class).
    config_class: Type[WhiteningConfig] = WhiteningConfig
    #: The failure the state warns about when :meth:`update` returns ``None``.
    failure_message: str = "the transform update failed; the previous transform is kept"

    def __init__(self, config: WhiteningConfig) -> None:
        if type(config) is not self.config_class:
            raise TypeError(f"{type(self).__name__} expects a {self.config_class.__name__}, "
                            f"but got {type(config).__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # Buffers of the rule's own, registered on the layer beside the contract buffers.
    def initial_buffers(self, m: int, factory_kwargs: Dict[str, Any], groups: int = 1) -> Dict[str, Tensor]:
        """The rule's own buffers of a fresh layer with ``m`` features (``groups``), by name, made with
        ``factory_kwargs`` (``device``, ``dtype``: the layer's statistics dtype); default none. They are saved in
        checkpoints and moved with the layer; :meth:`update` gets their current values in ``state``."""
        return {}

    def work_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """The dtype a rule computes its transform in, for layers whose statistics are ``state_dtype``: float32, or
        float64 for float64 layers (the fold hands :meth:`update` float64 moments either way)."""
        return F_w.stats_dtype(state_dtype)

    def gram_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """The dtype the layer smooths ``Q_s = beta Q_s + (1 - beta) Q`` in (:attr:`RuleResult.gram` is converted to
        it first): :meth:`work_dtype` by default."""
        return self.work_dtype(state_dtype)

    def cost(self, num_features: int, groups: int = 1) -> float:
        """Relative cost of one :meth:`update` (for spreading layers over ranks): ``M^3``, or ``G (M/G)^3`` for
        ``groups=G`` (one ``M/G x M/G`` block per group)."""
        return float(groups) * float(num_features // groups) ** 3

    # Batching across layers (one call for many layers that fold together).
    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        """Layers with equal keys may share :meth:`compute_batched`; ``None`` (default): fold this layer alone."""
        return None

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]], state_dtype: torch.dtype) -> List[Any]:
        """The precomputed part of :meth:`update` for stacked layers, one item per layer: ``fold`` holds their
        folds stacked (a leading layer dimension on every tensor, ``first`` one flag per layer), ``states`` their
        buffers."""
        raise NotImplementedError

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        """The new transform from ``fold`` and the layer's current ``state``; ``None`` on failure.

        Called once per layer at every fold (on the rank that folds the layer), under ``torch.no_grad``, never
        inside a compiled graph. ``None`` (or a result that fails the layer's check, :class:`RuleResult`) keeps
        the previous transform and counts the failure in ``transform_failures``.

        Args:
            fold: this layer's :class:`Fold`.
            state: the layer's buffers by name (``running_mean``, ``running_cov`` (the previous ``Phi_x``),
                ``whitening_matrix`` (the ``T`` in force), ``grad_transform`` (``Q_s``, grad layers) and the
                rule's own); read them, do not write them.
            precomputed: this layer's item of a :meth:`compute_batched` result, when there was one, else
                ``whitenlayers.rules.NOT_COMPUTED``.
        """
        raise NotImplementedError


class EVDRule(TransformRule):
    """ZCA from an eigendecomposition of ``Phi_x`` (paper section 3, gains per ERRATA 5 of ``docs/PAPER.md``)."""

    name = "evd"
    config_class = EVDConfig
    config: EVDConfig

    @property
    def failure_message(self) -> str:  # type: ignore[override]
        if self.config.gains == "damped":
            return "Cholesky factorisation failed (also in float64); the previous transform is kept"
        return "eigendecomposition failed (also in float64); the previous transform is kept"

    def gram_dtype(self, state_dtype: torch.dtype) -> torch.dtype:
        """float64 for the eigendecomposition's gains; the working dtype for ``gains="damped"`` (its ``Q`` has the
        working precision: smoothing it in float64 would only add two conversions of every ``M x M`` matrix)."""
        return self.work_dtype(state_dtype) if self.config.gains == "damped" else torch.float64

    #: Widest ``M`` whose eigendecompositions are batched across layers on the CPU. Measured (1 thread, MKL,
    #: process CPU time, median of 5; ``batched / looped``): M=16 0.31, 32 0.45, 64 0.65, 128 1.15,
    #: 256 1.23, 512 1.23, 1024 1.14: the batched call saves per-call overhead for small matrices and costs
    #: more than one call per matrix from M = 128 on. Grouped layers: the same bound on the block size ``M/G``
    #: for batching across layers (a grouped layer's own blocks always share one batched call: no Python loop
    #: over groups). Other devices (CUDA) batch every width (:meth:`batch_key`).
    BATCH_MAX_M = 64
    #: Off the CPU, at most this many matrix entries go into one batched ``eigh`` (and its float64
    #: temporaries): one 2048 x 2048 matrix, four of 1024, ... A fold runs after the model's forward, while
    #: its activations are alive, so its transient memory adds to the step's peak: this keeps it at what one
    #: call per layer needs for the widest layers of a ResNet-50.
    EIGH_BATCH_ELEMENTS = 1 << 22

    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        """Layers of one width (or one block size, grouped), dtype, device, ``eps``, ``gmax`` and ``gains`` share
        one batched ``eigh``: at every width on a GPU, up to :attr:`BATCH_MAX_M` on the CPU.

        On CUDA a call per layer costs more than its decomposition's own time: torch decomposes the matrices of
        a batched call one by one above 32 (pytorch#175585) but in C++, with one status check (a host
        synchronisation) per call; a call per layer adds its Python, its finiteness checks (three host
        synchronisations) and its launches of the gains and products, each a stall of the GPU (a ResNet-50
        fold: 45 calls, 159 host synchronisations one by one, 3 stacked). The CPU keeps a call per wide layer,
        where it is the faster (measured above; :func:`~whitenlayers.functional.fused_moments` takes the GPU's
        choice on a CPU, for counting)."""
        if num_features // groups > self.BATCH_MAX_M and not F_w.fused_moments_on(device):
            return None
        c = self.config
        kind = "evd" if groups == 1 else "evd-grouped"  # grouped layers with blocks of one size share one eigh
        return (kind, num_features // groups, self.work_dtype(state_dtype), device, c.eps, c.gmax, c.gains)

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]], state_dtype: torch.dtype) -> List[Any]:
        work = self.work_dtype(state_dtype)
        c = self.config
        if c.gains == "damped":  # one batched Cholesky factorisation (grouped layers: of all their blocks)
            return F_w.damped_transform_batched(fold.cov, eps=c.eps, gmax=c.gmax, dtype=work)
        covs = fold.cov.to(work)
        if covs.dim() == 4:  # grouped layers: (L, G, k, k)
            return F_w.evd_transform_grouped_batched(list(covs), eps=c.eps, gmax=c.gmax, gains=c.gains)
        per_call = max(1, self.EIGH_BATCH_ELEMENTS // (covs.shape[-1] ** 2)) if covs.shape[-1] > self.BATCH_MAX_M \
            else covs.shape[0]
        parts = covs.split(per_call)  # one batched eigh per part
        return [res for part in parts for res in F_w.evd_transform_batched(part, eps=c.eps, gmax=c.gmax, gains=c.gains)]

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        c = self.config
        if precomputed is NOT_COMPUTED:
            work = self.work_dtype(state["whitening_matrix"].dtype)
            if c.gains == "damped":
                precomputed = F_w.damped_transform(fold.cov, eps=c.eps, gmax=c.gmax, dtype=work)
            else:
                evd = F_w.evd_transform_grouped if fold.cov.dim() == 3 else F_w.evd_transform
                precomputed = evd(fold.cov.to(work), eps=c.eps, gmax=c.gmax, gains=c.gains)
        if precomputed is None:
            return None
        t, q = precomputed
        # Q_s is smoothed in float64 (gram_dtype; its buffer keeps the layer's statistics dtype).
        return RuleResult(t, q, {})


class RecursiveRule(TransformRule):
    """Recursive update (paper section 4, ERRATA 3 and 6): rank-one ``O(M^2)`` steps for ``T`` and ``Q``, no EVD; the
    fold's tracking of ``Phi_y = T Phi_x T^T`` is two ``M^3`` products (about half an EVD fold's time)."""

    name = "recursive"
    config_class = RecursiveConfig
    config: RecursiveConfig
    failure_message = "non-finite recursive step; the previous transform is kept"

    def initial_buffers(self, m: int, factory_kwargs: Dict[str, Any], groups: int = 1) -> Dict[str, Tensor]:
        return {
            "running_cov_whitened": torch.zeros(F_w.block_shape(m, groups), **factory_kwargs),  # Phi_y
            "running_power": torch.zeros(m, **factory_kwargs),  # phi_x,m (uncentred)
            "whitening_gram": F_w.block_identity(m, groups, **factory_kwargs),  # unsmoothed Q = T^T T
        }

    def batch_key(self, num_features: int, state_dtype: torch.dtype, device: torch.device,
                  groups: int = 1) -> Optional[Hashable]:
        # O(M^2) state per layer: layers of one shape always batch (the config is compared by the caller's stacks)
        return ("recursive", num_features, groups, self.work_dtype(state_dtype), device)

    def compute_batched(self, fold: Fold, states: Sequence[Dict[str, Tensor]],
                        state_dtype: torch.dtype) -> List[Optional[RuleResult]]:
        c = self.config
        # Working precision float32 (float64 for float64 layers): the recursion is contractive (gamma < 1),
        # so its round-off stays at the working precision instead of accumulating.
        wd = self.work_dtype(state_dtype)
        first = list(cast(List[bool], fold.first))  # stacked: one flag per layer
        t_prev = torch.stack([s["whitening_matrix"] for s in states]).to(wd)
        phi_y = F_w.whitened_covariance_update(torch.stack([s["running_cov_whitened"] for s in states]), t_prev,
                                               fold.block_cov, c.alpha, first)
        power_prev = torch.stack([s["running_power"] for s in states])
        n = torch.clamp(fold.block.count, min=1.0).unsqueeze(-1)
        power = F_w.recursive_average(power_prev, fold.block.power / n, c.alpha, first)
        mean_power = power.mean(-1).to(wd)
        k = t_prev.shape[-1]
        groups = t_prev.shape[1] if t_prev.dim() == 4 else 1
        if groups > 1:  # each group of a layer: the layer's mean power (as for an ungrouped layer)
            mean_power = mean_power.repeat_interleave(groups)
        step, over = F_w.recursive_step_blocks(
            t_prev.reshape(-1, k, k),
            torch.stack([s["whitening_gram"] for s in states]).to(wd).reshape(-1, k, k),
            phi_y.reshape(-1, k, k),
            mean_power,
            gamma=c.gamma,
            delta=c.delta,
            eps=c.eps,
            c_rel=c.c_rel,
            c_abs=c.c_abs,
        )
        t_new, gram = step.transform.reshape(t_prev.shape), step.gram.reshape(t_prev.shape)
        finite = F_w.finite_each(t_new, gram)
        flags = torch.stack([finite, over.view(len(states), groups).any(-1)]).tolist()
        power = power.to(state_dtype)  # as its buffer stores it: one conversion per stack, not one per layer
        # one unbind per stacked result (a call each, not one indexing call per layer and result)
        return [RuleResult(t, q, {"running_cov_whitened": y, "running_power": p, "whitening_gram": q}, bool(over))
                if ok else None
                for t, q, y, p, ok, over in zip(t_new.unbind(0), gram.unbind(0), phi_y.unbind(0), power.unbind(0),
                                                flags[0], flags[1])]

    def update(self, fold: Fold, state: Dict[str, Tensor], precomputed: Any = NOT_COMPUTED) -> Optional[RuleResult]:
        if precomputed is NOT_COMPUTED:  # one layer: a stack of one
            stacked = Fold(F_w.BlockSummary(*(t.unsqueeze(0) for t in fold.block)), fold.mean.unsqueeze(0),
                           fold.cov.unsqueeze(0), fold.block_cov.unsqueeze(0), [cast(bool, fold.first)])
            precomputed = self.compute_batched(stacked, [state], state["whitening_matrix"].dtype)[0]
        return precomputed


#: The registered rules by name (:func:`register_rule`); the built-in ones first.
_RULES: Dict[str, Type[TransformRule]] = {r.name: r for r in (EVDRule, RecursiveRule)}
#: The rules whose results the fold writes unchecked: they check their own (finite, shapes by construction).
_BUILT_IN = (EVDRule, RecursiveRule)


def _own_name(cls: Type[TransformRule]) -> str:
    """``cls.name`` when ``cls`` sets it itself, else ``TypeError``: a subclass inheriting its parent's name would
    save checkpoints that load as the parent's."""
    if not (isinstance(cls, type) and issubclass(cls, TransformRule)):
        raise TypeError(f"a rule must be a TransformRule subclass or a registered name, but got rule={cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        inherited = f" (it inherits name={cls.name!r})" if cls.name else ""
        raise TypeError(f"rule {cls.__name__} must set a name of its own as a class attribute{inherited}: the name "
                        "goes into checkpoints and tells the rule from others")
    return name


def register_rule(rule: Type[TransformRule]) -> Type[TransformRule]:
    """Register a rule class under its :attr:`~whitenlayers.TransformRule.name`, so that ``rule="<name>"`` finds it.

    Usable as a class decorator; returns ``rule``. Registering the same class again is a no-op.

    Args:
        rule: a :class:`TransformRule` subclass that sets its own ``name`` and ``config_class``.

    Raises:
        TypeError: ``rule`` is not such a class.
        ValueError: another class is registered under that name.
    """
    name = _own_name(rule)
    if not (isinstance(rule.config_class, type) and issubclass(rule.config_class, WhiteningConfig)):
        raise TypeError(f"rule {rule.__name__} must set config_class to a WhiteningConfig subclass, but got "
                        f"config_class={rule.config_class!r}")
    known = _RULES.get(name)
    if known is not None and known is not rule:
        raise ValueError(f"a rule named {name!r} is already registered ({known.__module__}.{known.__qualname__}); "
                         f"give {rule.__name__} another name")
    _RULES[name] = rule
    return rule


def resolve_rule(rule: Union[str, Type[TransformRule]], base: Type[WhiteningConfig], owner: str
                 ) -> Type[TransformRule]:
    """The rule class ``rule`` names (a registered name) or is (a subclass), checked to fit a layer whose
    config is a ``base`` (:class:`~whitenlayers.EVDConfig` for ``grad`` / ``direct`` layers,
    :class:`~whitenlayers.RecursiveConfig` for ``recursive`` ones).

    Args:
        rule: a registered name, or a :class:`TransformRule` subclass (it need not be registered).
        base: the config class the layer's method needs.
        owner: who asks, for the messages (a layer class, ``convert_model``).
    """
    if isinstance(rule, str):
        cls = _RULES.get(rule)
        if cls is None:
            raise ValueError(f"{owner}: no rule is registered as {rule!r}; registered: {', '.join(map(repr, _RULES))}"
                             " (pass a TransformRule subclass, or register_rule it first)")
    else:
        cls = rule
        _own_name(cls)
    if not (isinstance(cls.config_class, type) and issubclass(cls.config_class, base)):
        takes = getattr(cls.config_class, "__name__", cls.config_class)
        raise TypeError(f"{owner}: rule {cls.__name__} takes a {takes}, but this layer needs a {base.__name__} (or a "
                        "subclass of it)")
    return cls


def rule_for(config: WhiteningConfig, rule: Optional[Union[str, Type[TransformRule]]] = None) -> TransformRule:
    """The rule instance for a config: ``rule`` (a class or a registered name) built with it, or by default the
    built-in rule of its class (``EVDConfig`` -> :class:`EVDRule`, ``RecursiveConfig`` -> :class:`RecursiveRule`)
    or the first registered rule whose ``config_class`` it is exactly."""
    if rule is not None:
        return resolve_rule(rule, WhiteningConfig, "rule_for")(config)
    for cls in _RULES.values():
        if type(config) is cls.config_class:
            return cls(config)
    raise TypeError(f"no transform rule takes a {type(config).__name__}")


#: :func:`batches_own_results` by class (asked per layer at every fold).
_OWN_RESULTS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def batches_own_results(cls: Type[TransformRule]) -> bool:
    """Whether the :meth:`~whitenlayers.TransformRule.update` of ``cls`` is that of the class defining its
    :meth:`~whitenlayers.TransformRule.compute_batched` (or of a base of it): only then does the fold hand it
    batched results.
    A subclass that overrides ``update`` alone gets each layer's fold unbatched."""
    known = _OWN_RESULTS.get(cls)
    if known is None:
        owner_update = next(c for c in cls.__mro__ if "update" in c.__dict__)
        owner_batched = next(c for c in cls.__mro__ if "compute_batched" in c.__dict__)
        known = _OWN_RESULTS[cls] = issubclass(owner_batched, owner_update)
    return known


def batch_key_of(rule: TransformRule, num_features: int, state_dtype: torch.dtype, device: torch.device,
                 groups: int = 1) -> Optional[Hashable]:
    """``rule``'s :meth:`~whitenlayers.TransformRule.batch_key`, or ``None`` where its class does not batch its own
    results (:func:`batches_own_results`)."""
    if not batches_own_results(type(rule)):
        return None
    if groups != 1:
        return rule.batch_key(num_features, state_dtype, device, groups=groups)
    return rule.batch_key(num_features, state_dtype, device)


def rule_identity(rule: TransformRule) -> str:
    """The rule's name and config as saved in a layer's checkpoint: a JSON object, ``{"rule": <name>, <field>:
    <value>, ...}`` (fields in the config's order; a value JSON cannot hold as its ``repr``)."""
    fields = {key: value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
              for key, value in dataclasses.asdict(rule.config).items()}
    return json.dumps({"rule": rule.name, **fields}, separators=(",", ":"))


def check_result(result: Any, shape: Tuple[int, ...], buffers: Dict[str, Tensor]
                 ) -> Tuple[Optional[str], List[Tensor]]:
    """What is wrong with ``result`` for a layer whose matrices have ``shape`` and whose rule buffers are
    ``buffers`` (a text, or ``None``), and the checks left to read on the device: a bool tensor each, ``True``
    when ``transform`` and ``gram`` (and the buffers) are finite and ``gram`` symmetric to its dtype's
    rounding (``|Q - Q^T| <= 4 max(k, 16) eps max|Q|`` for ``k x k`` blocks). ``result`` ``None`` is no
    problem (a failure the rule reported)."""
    if result is None:
        return None, []
    if not isinstance(result, RuleResult):
        return f"update returned a {type(result).__name__}, not a RuleResult", []
    if not isinstance(result.buffers, dict):
        return f"RuleResult.buffers must be a dict, but got {type(result.buffers).__name__}", []
    unknown = [k for k in result.buffers if k not in buffers]
    if unknown:
        return (f"RuleResult.buffers holds {', '.join(map(repr, unknown))}, which are not among the rule's buffers "
                f"({', '.join(map(repr, buffers)) or 'none'}: initial_buffers)"), []
    tensors = [("transform", result.transform, shape), ("gram", result.gram, shape)]
    tensors += [(f"buffer {k!r}", v, tuple(buffers[k].shape)) for k, v in result.buffers.items()]
    for what, t, want in tensors:
        if not isinstance(t, Tensor):
            return f"{what} is a {type(t).__name__}, not a tensor", []
        if tuple(t.shape) != tuple(want):
            return f"{what} has shape {tuple(t.shape)}, but the layer needs {tuple(want)}", []
        if t.dtype not in (torch.float32, torch.float64):
            return f"{what} has dtype {t.dtype}, but must be float32 or float64", []
    q = result.gram
    tol = 4.0 * max(q.shape[-1], 16) * torch.finfo(q.dtype).eps
    finite = torch.stack([t.isfinite().all() for _, t, _ in tensors]).all()
    symmetric = (q - q.mT).abs().amax() <= tol * q.abs().amax()
    return None, [finite, symmetric]


def check_results(results: Sequence[Any], shapes: Sequence[Tuple[int, ...]], buffers: Sequence[Dict[str, Tensor]]
                  ) -> List[Optional[str]]:
    """:func:`check_result` of each of ``results`` (layers with matrices of ``shapes`` and rule buffers
    ``buffers``): the problem of each, or ``None``; the device checks of all read in one host synchronisation."""
    checked = [check_result(*args) for args in zip(results, shapes, buffers)]
    problems = [problem for problem, _ in checked]
    pending = [k for k, (_, checks) in enumerate(checked) if checks]  # (checks only where there is no problem)
    if pending:
        flags = torch.stack([torch.stack(checked[k][1]) for k in pending]).tolist()
        for k, (finite, symmetric) in zip(pending, flags):
            if not finite:
                problems[k] = "non-finite values"
            elif not symmetric:
                problems[k] = "a gram (Q) that is not symmetric"
    return problems


def rule_and_config(base: Type[WhiteningConfig], owner: str, config: Optional[WhiteningConfig],
                    whitening: Dict[str, Any], *, exclude: Tuple[str, ...] = ()
                    ) -> Tuple[Type[TransformRule], WhiteningConfig]:
    """A layer's rule class and config from its constructor's ``config=`` and keyword arguments.

    ``whitening`` may hold ``rule=`` (a :class:`TransformRule` subclass or a registered name; default the
    built-in rule of ``base``, or the registered rule whose ``config_class`` ``config`` is); the other keywords
    are fields of the rule's config class, which must be ``base`` or a subclass of it. A ``config`` of a base
    of the rule's config class is lifted to it (its fields kept, the extra ones at their defaults).

    Args:
        base: the config class of the layer's method (:class:`~whitenlayers.EVDConfig` or
            :class:`~whitenlayers.RecursiveConfig`).
        owner: the layer's name, for the messages.
        config: the ``config=`` argument (``None``: the defaults).
        whitening: the whitening keyword arguments (``rule`` among them, or not); not changed.
        exclude: fields the layer does not take (``DirectWhiten``: ``("beta",)``).
    """
    kwargs = dict(whitening)
    cls = layer_rule(base, owner, config, kwargs.pop("rule", None))
    wanted = cls.config_class
    if config is not None and type(config) is not wanted and isinstance(config, WhiteningConfig) \
            and issubclass(wanted, type(config)):
        config = wanted(**config.as_dict())
    return cls, make_config(wanted, owner, config, kwargs, exclude=exclude)


def layer_rule(base: Type[WhiteningConfig], owner: str, config: Optional[WhiteningConfig],
               rule: Optional[Union[str, Type[TransformRule]]]) -> Type[TransformRule]:
    """The rule class of a layer whose method takes a ``base`` config: ``rule`` (:func:`resolve_rule`), else the
    registered rule whose ``config_class`` ``config`` is, else the built-in rule of ``base``."""
    if rule is not None:
        return resolve_rule(rule, base, owner)
    for cls in _RULES.values():
        if type(config) is cls.config_class and issubclass(cls.config_class, base):
            return cls
    return RecursiveRule if issubclass(base, RecursiveConfig) else EVDRule
