"""The functions a training step runs: few, in few files, short, and the ones docs/development.md ("How a step runs")
names. Counted with ``sys.setprofile`` over one SGD step of a converted CIFAR ResNet-20 inside a block (forward,
backward, step), the model's own forward (``whitenlayers/models.py``) left out.

The bound counts the step's own functions; a named helper that is the one place of something several paths share
(listed in ``SHARED_HELPERS`` with the functions that call it instead of a copy, which the test checks) is let
through on top, so that replacing a copy by a helper never fails the bound."""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

import whitenlayers as wl

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(wl.__file__).parent

#: The bounds: distinct library functions (comprehensions count as functions) and files on a step without a fold.
#: Files: the layer's forward (``layers/step.py``), its formulas (``functional/batch.py``), its autograd Function
#: (``autograd.py``) and the model's hooks (``coordinator.py``); a direct model's wrapper adds ``layers/direct.py``
#: (4 for every method while the coordinator's shared nodes did the Functions' work; issue 79 gave each layer its own
#: step, and the direct wrapper's forward is where its fused product is decided).
MAX_FUNCTIONS = {"grad": 12, "recursive": 12, "direct": 14}
MAX_FILES = {"grad": 4, "recursive": 4, "direct": 5}
MAX_LINES = 80
#: Helpers a step may call beyond ``MAX_FUNCTIONS``, each the one place of a decision or formula: the functions of
#: the package that call it (each must, in its body: a helper kept only for the step is counted in the bound).
SHARED_HELPERS = {
    # whether a layer gathers and folds: the eager and the compiled forward, accumulate, a joined rank, the fold
    "_StepMixin.gathers_now": ("_StepMixin._begin", "_StepMixin._begin_traced", "WhiteningLayer.accumulate",
                               "FoldCoordinator._shadow_forward", "_warn_uncalled"),
    # a batch's sums: the eager forward and the compiled one
    "Block.add": ("_StepMixin._add_batch", "_StepMixin._add_batch_traced"),
    # whether autograd runs a backward (the one use of a private torch name on the step, _torch_compat.py)
    "in_backward": ("_StepMixin._begin", "recomputing"),
    # a weight as the matrix of its rows, without a copy: the centring offset and its absorbed twin
    "_weight_rows": ("_GradStep._offset", "_GradStep._track_absorbed_offset"),
}
MAX_HELPERS = 4


@functools.lru_cache(maxsize=None)
def _step_functions(method: str) -> dict:
    """``{(file, qualname): code}`` of the library functions one training step inside a block calls."""
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(20, width=4), method=method)  # block_size 10
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):  # the block's shift chosen, the caches made: a step in the middle of a block
        step()
    seen: dict = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(str(PACKAGE)) and not code.co_filename.endswith(
                os.path.join("whitenlayers", "models.py")):
            seen[(os.path.relpath(code.co_filename, PACKAGE), code.co_qualname)] = code

    sys.setprofile(profile)
    threading.setprofile(profile)  # (the backward's threads)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert all(int(layer.num_blocks) == 0 for _, layer in wl.whitening_layers(model))  # no fold in it
    return seen


@pytest.mark.skipif(sys.version_info < (3, 11), reason="co_qualname: Python 3.11")
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_a_step_runs_few_short_functions_in_few_files(method):
    seen = _step_functions(method)
    own = sorted(key for key in seen if key[1] not in SHARED_HELPERS)
    files = {path for path, _ in own}  # (a shared helper's file aside, as the helper)
    assert len(own) <= MAX_FUNCTIONS[method], own
    assert len(files) <= MAX_FILES[method], sorted(files)
    for (path, name), code in seen.items():
        lines = inspect.getsourcelines(code)[0]
        assert len(lines) <= MAX_LINES, f"{path} {name}: {len(lines)} lines"


def _package_functions() -> dict:
    """``{qualname: ast node}`` of every function of the package (the runner's aside)."""
    found: dict = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found[name] = child
                walk(child, name + ".")

    for path in PACKAGE.rglob("*.py"):
        if "experiment" not in path.parts:
            walk(ast.parse(path.read_text()), "")
    return found


def test_the_shared_helpers_replace_copies():
    """Each helper let through the bound exists and is called by every function listed for it (at least two: it
    replaces a copy), and there are few of them."""
    assert len(SHARED_HELPERS) <= MAX_HELPERS
    functions = _package_functions()
    for helper, callers in SHARED_HELPERS.items():
        assert helper in functions, helper
        assert len(callers) >= 2, helper
        name = helper.rsplit(".", 1)[-1]
        for caller in callers:
            calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                     for node in ast.walk(functions[caller]) if isinstance(node, ast.Call)}
            assert name in calls, f"{caller} does not call {helper}"


def _section(title: str) -> str:
    text = (ROOT / "docs" / "development.md").read_text()
    return text[text.index(f"## {title}"):].split("\n## ")[0]


def _documented(title: str) -> set:
    """Every name the section gives in backticks."""
    return set(re.findall(r"`([^`\n]+)`", _section(title)))


def _modules() -> list:
    """Every module of the package, the runner's aside."""
    names = [p.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".") for p in PACKAGE.rglob("*.py")]
    return [importlib.import_module(n.removesuffix(".__init__")) for n in names if ".experiment" not in n]


def _resolves(name: str, modules: list) -> bool:
    """Whether a module of the package has the attribute path ``name`` (``FoldCoordinator.flush``, ``_begin``)."""
    for module in modules:
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        else:
            return True
    return False


# (probing every module for a name reads the deprecated alias whitenlayers.stats too, which warns)
@pytest.mark.filterwarnings("ignore:whitenlayers.stats is renamed whitenlayers.layers:FutureWarning")
@pytest.mark.parametrize("title", ["How a step runs", "How a fold runs"])
def test_the_documented_path_names_functions_that_exist(title):
    """Every dotted or private name the section gives exists in the package, and every file it cites."""
    section = _section(title)
    files = re.findall(r"`(whitenlayers/[\w/]+\.py)`", section)
    assert files and all((ROOT / f).exists() for f in files), files
    names = [span for span in re.findall(r"`([^`\n]+)`", section)
             if re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|_\w+", span) and not span.endswith(".py")]
    assert len(names) >= 10
    modules = _modules()
    missing = [name for name in names if not _resolves(name, modules)]
    assert not missing, missing


@pytest.mark.skipif(sys.version_info < (3, 11), reason="co_qualname: Python 3.11")
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_how_a_step_runs_names_every_function_a_step_calls(method):
    named = _documented("How a step runs")
    called = {qualname for _, qualname in _step_functions(method)}
    assert called - named == set(), sorted(called - named)
