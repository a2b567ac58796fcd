"""Everything the package uses of torch that is private or differs across the torch versions it supports
(``setup.cfg``: torch 2.4 and later), in one place. Imports nothing of the package.

Private names (each used only here, with its fallback; ``tests/test_torch_compat.py`` runs every fallback and checks
that no other module of the package names a private torch attribute):

* ``torch._C._are_functorch_transforms_active`` (:func:`transforms_active`): a C call per forward; its fallback asks
  the same question through public API (an autograd Function without ``setup_context``, which torch refuses inside
  a transform), at the cost of a Function call.
* ``torch._C._current_graph_task_id`` (:func:`in_backward`): whether autograd is running a backward, i.e. a forward
  is being recomputed (activation checkpointing). torch's own modules ask it so (``torch.utils.module_tracker``); a
  torch without it is refused at import, by name, rather than miscounting recomputed forwards.
* ``torch.autograd.Variable._execution_engine.queue_callback`` (:func:`queue_after_backward`): a callback at the end
  of the running backward, as DistributedDataParallel queues its own; without it, :func:`queue_after_backward`
  raises, by name.
* ``DistributedDataParallel._active_ddp_module`` and its ``_join_config`` (:func:`ddp_forward`): the DDP module
  whose forward is running, and whether it runs inside ``Join``; without them, no DDP forward is seen (a forward of
  the wrapped module alone is then not told from DDP's), which a warning says once.
* dynamo's ``_disable_side_effect_safety_checks_for_current_subtracer`` (:func:`unchecked_side_effect`): a Python
  list append that a compiled activation checkpoint may replay; without it, the plain call (which dynamo refuses
  inside a checkpoint: that region then runs eagerly).
* ``torch._C._FunctionBase``'s ``apply`` (:func:`function_apply`): what ``torch.autograd.Function.apply`` ends in,
  called directly on a training step (``Function.apply`` first checks for torch.func transforms, which the package
  asks once per forward itself: about 10 us a call on a CPU); its fallback is ``Function.apply``, the same call.
* ``torch._foreach_copy_`` (:func:`copy_all_`): a fold's writes into every layer's buffers, a few kernels for all
  of them (one per buffer on a GPU is a launch each); its fallback is a ``copy_`` per tensor, the same values.

Nothing here imports ``torch._dynamo``: :func:`graph_break` applies ``torch.compiler.disable`` at the first call.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, List, Tuple, TypeVar

import torch
from torch.torch_version import TorchVersion

__all__ = ["no_autocast", "compiling", "exporting", "graph_break", "transforms_active",
           "in_backward", "queue_after_backward", "ddp_forward", "unchecked_side_effect", "copy_all_",
           "function_apply", "TRAINING_EXPORT"]

F = TypeVar("F", bound=Callable[..., Any])


def no_autocast(device: torch.device) -> Any:
    """Statistics and transforms are computed in their own dtype, never in autocast's lower precision: a context in
    which autocast is off for ``device``'s type. Inside a compiled graph ``torch.autocast(enabled=False)``, which
    dynamo traces; elsewhere :class:`_AutocastOff`, the same for the operations inside at a fraction of the host
    time (it runs in a layer's step)."""
    if torch.compiler.is_compiling():
        return torch.autocast(device_type=device.type, enabled=False)
    return _AutocastOff(device.type)


class _AutocastOff:
    """Autocast switched off for one device type inside the block and restored after it
    (``torch.set_autocast_enabled``): the operations inside run in their inputs' dtypes, as inside
    ``torch.autocast(enabled=False)``, without that context's bookkeeping (its dtype, cache and nesting level, and the
    torch function modes it tells)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        self.was_enabled = torch.is_autocast_enabled(self.device_type)
        if self.was_enabled:
            torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc: Any) -> None:
        if self.was_enabled:
            torch.set_autocast_enabled(self.device_type, True)


#: Whether dynamo is tracing the code that calls this (``torch.compile``, ``torch.export``): torch's own function.
compiling: Callable[[], bool] = torch.compiler.is_compiling


#: Whether torch.export can trace a training-mode forward, which writes the layers' blocks (torch 2.6 and later; before,
#: a non-strict export fails on it: "mutating a non-functional tensor with a functional tensor").
TRAINING_EXPORT = TorchVersion(torch.__version__) >= "2.6"

#: Whether ``torch.export`` is tracing the code that calls this: torch's own function (2.7 and later); before, ``False``
#: (a graph ``torch.export`` makes of a training-mode forward then holds the package's ``snapshot`` operator, which
#: the ONNX exporter cannot translate).
exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)


def graph_break(fn: F) -> F:
    """``fn`` kept out of ``torch.compile``'s graphs: ``torch.compiler.disable(fn)`` where a graph calls it (a graph
    break), made by :func:`prepare_graph_breaks` (so that importing the package does not import dynamo), which puts
    it in ``fn``'s place in its module or class."""
    _GRAPH_BREAKS.append(fn)
    return fn


_GRAPH_BREAKS: list = []
#: :func:`unchecked_side_effect`'s allowance (:func:`prepare_graph_breaks`).
_SIDE_EFFECTS: list = []


@functools.lru_cache(maxsize=None)
def prepare_graph_breaks() -> None:
    """Put every :func:`graph_break` function's disabled form in its place (its module's or its class's attribute),
    and find :func:`unchecked_side_effect`'s allowance: once per process, when the first whitening layer is built
    (this imports dynamo; a graph then never traces the making)."""
    import importlib

    for fn in _GRAPH_BREAKS:
        owner: Any = importlib.import_module(fn.__module__)
        for name in fn.__qualname__.split(".")[:-1]:
            owner = getattr(owner, name)
        setattr(owner, fn.__name__, torch.compiler.disable(fn))
    import torch._dynamo.utils as dynamo_utils

    _SIDE_EFFECTS.append(getattr(dynamo_utils, "_disable_side_effect_safety_checks_for_current_subtracer",
                                 _plain_call))


class _Probe(torch.autograd.Function):
    """A Function without ``setup_context``: ``Function.apply`` refuses it inside a torch.func transform, before
    running anything (:func:`_transforms_active_public`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # pragma: no cover (never differentiated)
        return grad


def _transforms_active_public() -> bool:
    """:func:`transforms_active` through public API only."""
    try:
        _Probe.apply(torch.empty(0))
    except RuntimeError as error:
        if "setup_context" in str(error):
            return True
        raise
    return False


#: Whether a torch.func transform (vmap, grad, jacrev, ...) is active: one C call (the module docstring).
transforms_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active",
                                                _transforms_active_public)

_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", None)  # type: ignore[assignment]
if _graph_task_id is None:  # pragma: no cover (every supported torch has it)
    raise ImportError(f"whitenlayers needs torch._C._current_graph_task_id (to tell a forward recomputed by activation "
                      f"checkpointing from a new batch), which torch {torch.__version__} lacks; install torch>=2.4")


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward called now is recomputed (activation
    checkpointing, either kind). Not to be asked inside a compiled graph (which replays compiled checkpointing)."""
    return _graph_task_id() != -1


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` at the end of the running backward, after the callbacks queued before it (DDP's gradient
    all-reduce queues one)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):  # pragma: no cover (every supported torch has it)
        raise RuntimeError(f"whitenlayers: torch {torch.__version__} has no way to run a callback after a backward "
                           "(Variable._execution_engine.queue_callback), which folding under Join needs")
    engine.queue_callback(callback)


def ddp_forward() -> Tuple[Any, bool]:
    """The ``DistributedDataParallel`` module whose forward is running (``None``: none) and whether it runs inside a
    ``Join`` context (uneven inputs). A torch without DDP's record of it: ``(None, False)``, said once (a forward of
    the wrapped module alone is then not told from DDP's, and a Join without the whitening's joinable is not
    refused)."""
    global _warned_ddp
    parallel = torch.nn.parallel.DistributedDataParallel
    if not hasattr(parallel, "_active_ddp_module"):
        if not _warned_ddp:
            _warned_ddp = True
            warnings.warn(f"whitenlayers: torch {torch.__version__} has no DistributedDataParallel._active_ddp_module: "
                          "a training forward of the module inside DDP, called without DDP, is not told from DDP's "
                          "(it gathers statistics on one rank), and a Join without wl.joinable is not refused",
                          RuntimeWarning, stacklevel=3)
        return None, False
    ddp = parallel._active_ddp_module
    if ddp is None:
        return None, False
    return ddp, bool(getattr(getattr(ddp, "_join_config", None), "enable", False))


_warned_ddp = False


def _plain_call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def unchecked_side_effect(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inside a compiled graph, allowed inside a higher-order operator (a compiled activation
    checkpoint, whose forward runs once: the side effect is not to be replayed by a recomputation)."""
    return _SIDE_EFFECTS[0](fn, *args)


def _copy_all_public(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """:func:`copy_all_` through public API only: a ``copy_`` per tensor."""
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


#: ``destinations[i].copy_(sources[i])`` for every ``i`` (converting dtype and device), in one multi-tensor call.
copy_all_: Callable[[List[torch.Tensor], List[torch.Tensor]], None] = getattr(torch, "_foreach_copy_",
                                                                              _copy_all_public)


def function_apply(function: Any) -> Callable[..., Any]:
    """The C++ ``apply`` of the ``torch.autograd.Function`` subclass ``function`` (one without ``setup_context``: no
    arguments to bind), for calls outside any torch.func transform; ``function.apply`` where torch's Function is not
    built on ``torch._C._FunctionBase``."""
    if not issubclass(torch.autograd.Function, getattr(torch._C, "_FunctionBase", ())):
        return function.apply
    return super(torch.autograd.Function, function).apply
