"""The package's use of torch is public, apart from a few private names, all in ``whitenlayers/_torch_compat.py``,
each with a fallback that these tests run (on every torch the suite runs on, the floor's included: ``.ci/run``).
Importing the package imports no part of dynamo."""
from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import whitenlayers as wl
from whitenlayers import _torch_compat as compat

PACKAGE = Path(wl.__file__).parent
#: The names a module may use torch under (``import torch.nn as nn``, ``import torch.distributed as dist``, ...).
TORCH_ROOTS = {"torch", "nn", "F", "Fn", "dist", "threading"}
#: Private attributes of torch objects that a chain not rooted at a torch module can reach (a tensor's version
#: counter, a class attribute of DDP, the autograd engine).
PRIVATE_ANYWHERE = {"_version", "_active_ddp_module", "_join_config", "_execution_engine", "_foreach_copy_",
                    "_register_atexit", "_global_forward_hooks", "_forward_hooks_always_called"}
#: The most private torch names ``_torch_compat.py`` may hold (issue 79).
MAX_PRIVATE_NAMES = 8


def _chain(node: ast.AST) -> list:
    """The names of an attribute chain, root first (``torch._C._is_tracing`` -> ``["torch", "_C", "_is_tracing"]``);
    a chain rooted at a call or a subscript starts at that node's own chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def private_torch_names(source: str) -> set:
    """The private torch names ``source`` uses: a private component of an attribute chain rooted at a torch module,
    a name of :data:`PRIVATE_ANYWHERE` wherever it is reached, a private name imported from torch, or a string given
    to ``getattr`` on a torch module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in TORCH_ROOTS:
                found.update(p for p in chain[1:] if p.startswith("_") and not p.startswith("__"))
            if node.attr in PRIVATE_ANYWHERE and chain[:1] != ["self"]:  # (a module's own _version: nn.Module's)
                found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found.update(a.name for a in node.names if a.name.startswith("_"))
            found.update(p for p in (node.module or "").split(".") if p.startswith("_"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and _chain(node.args[0])[:1] and _chain(node.args[0])[0] in TORCH_ROOTS
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
            found.add(node.args[1].value)
    return found


def test_the_checker_finds_private_torch_names():
    src = ("torch._C._is_tracing()\nx._version\nfrom torch.utils._pytree import tree_leaves\nself._buffers\n"
           "getattr(torch._C, '_current_graph_task_id', None)\nnn.modules.module._global_forward_hooks\n")
    assert private_torch_names(src) == {"_C", "_is_tracing", "_version", "_pytree", "_current_graph_task_id",
                                        "_global_forward_hooks"}


def test_no_module_but_the_compat_module_names_a_private_torch_attribute():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_torch_compat.py" and "experiment" not in path.parts:
            names = private_torch_names(path.read_text())
            if names:
                found[str(path.relative_to(PACKAGE))] = sorted(names)
    assert found == {}


def compat_private_names() -> set:
    """The private names ``_torch_compat.py`` reaches: as :func:`private_torch_names` finds them, and every private
    name it asks ``getattr`` / ``hasattr`` for (on DDP's module, dynamo's utilities), less the modules they are in."""
    source = (PACKAGE / "_torch_compat.py").read_text()
    asked = {node.args[1].value for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
             and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
             and str(node.args[1].value).startswith("_")}
    return (private_torch_names(source) | asked) - {"_C", "_dynamo"}


def test_the_compat_module_holds_few_private_names():
    names = compat_private_names()
    assert {"_current_graph_task_id", "_foreach_copy_"} <= names  # (the count sees them)
    assert len(names) <= MAX_PRIVATE_NAMES, sorted(names)


def test_importing_the_package_imports_no_dynamo():
    """``torch.compiler.disable`` is applied when the first whitening layer is built, not at import."""
    code = ("import sys, whitenlayers as wl\nassert 'torch._dynamo' not in sys.modules, 'at import'\n"
            "wl.GradWhitenConv2d(2, 2, 1)\nassert 'torch._dynamo' in sys.modules, 'after a layer'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------- fallbacks
def test_the_transforms_fallback_answers_as_torch():
    assert compat._transforms_active_public() is compat.transforms_active() is False
    seen = []
    torch.func.vmap(lambda x: seen.append((compat._transforms_active_public(), compat.transforms_active())) or x)(
        torch.ones(2, 3))
    assert seen == [(True, True)]


def test_the_copy_fallback_writes_what_torch_writes():
    sources = [torch.randn(3, dtype=torch.float64), torch.randn(2, 2)]
    a = [torch.empty(3), torch.empty(2, 2, dtype=torch.float64)]  # (converting the dtypes)
    b = [t.clone() for t in a]
    compat.copy_all_(a, sources)
    compat._copy_all_public(b, sources)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_torch_without_ddps_forward_record_is_said_once(monkeypatch):
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", raising=False)
    monkeypatch.setattr(compat, "_warned_ddp", False)
    with pytest.warns(RuntimeWarning, match="_active_ddp_module"):
        assert compat.ddp_forward() == (None, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.ddp_forward() == (None, False)  # (said once)


def test_a_torch_without_a_callback_queue_says_so(monkeypatch):
    monkeypatch.delattr(torch.autograd.Variable, "_execution_engine", raising=False)
    with pytest.raises(RuntimeError, match="queue_callback"):
        compat.queue_after_backward(lambda: None)


def test_the_side_effect_fallback_calls_the_function(monkeypatch):
    monkeypatch.setattr(compat, "_SIDE_EFFECTS", [compat._plain_call])
    seen = []
    compat.unchecked_side_effect(seen.append, 3)
    assert seen == [3]


def test_a_torch_without_the_backward_query_is_refused_at_import():
    """The one name without a public equivalent: a torch that lacks it is refused, by name, at import."""
    code = ("import torch\ndel torch._C._current_graph_task_id\n"
            "try:\n    import whitenlayers\nexcept ImportError as e:\n    assert '_current_graph_task_id' in str(e)\n"
            "else:\n    raise SystemExit('imported')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("outer", [False, True])
def test_no_autocast_switches_autocast_off_and_back(outer):
    """Eager, ``no_autocast`` switches autocast off by ``torch.set_autocast_enabled`` (not ``torch.autocast``): inside,
    a product runs in its inputs' dtype as under ``torch.autocast(enabled=False)``; after it, or after an exception
    inside it, autocast is as it was (on, with its dtype, inside a user's region; off outside one)."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if outer else contextlib.nullcontext()
    with context:
        assert torch.mm(a, b).dtype == (torch.bfloat16 if outer else torch.float32)
        with compat.no_autocast(a.device):
            assert not torch.is_autocast_enabled("cpu")
            inside = torch.mm(a, b)
        with torch.autocast("cpu", enabled=False):
            assert torch.equal(inside, torch.mm(a, b))  # what torch.autocast(enabled=False) gives
        with pytest.raises(ValueError, match="inside"), compat.no_autocast(a.device):
            raise ValueError("inside")
        assert torch.is_autocast_enabled("cpu") == outer
        assert torch.mm(a, b).dtype == (torch.bfloat16 if outer else torch.float32)


def test_no_autocast_is_torch_autocast_inside_a_compiled_graph():
    """Inside a graph dynamo traces, ``no_autocast`` is ``torch.autocast(enabled=False)``, which dynamo knows: one
    graph, and the product in float32 inside bf16 autocast."""
    pytest.importorskip("torch._dynamo")
    import torch._dynamo.testing

    def f(a, b):
        with compat.no_autocast(a.device):
            return torch.mm(a, b)

    counter = torch._dynamo.testing.CompileCounter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(f, backend=counter, fullgraph=True)(torch.randn(4, 4), torch.randn(4, 4))
    assert out.dtype == torch.float32 and counter.frame_count == 1
