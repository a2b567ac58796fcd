"""The functions a training step runs: few, in few files, short, and the ones docs/development.md ("How a step runs")
names. Counted with ``sys.setprofile`` over one SGD step of a converted CIFAR ResNet-20 inside a block (forward,
backward, step), the model's own forward (``whitenlayers/models.py``) left out."""
from __future__ import annotations

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
MAX_FUNCTIONS = {"grad": 12, "recursive": 12, "direct": 14}
MAX_FILES = 4
MAX_LINES = 80


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
    files = {path for path, _ in seen}
    assert len(seen) <= MAX_FUNCTIONS[method], sorted(seen)
    assert len(files) <= MAX_FILES, sorted(files)
    for (path, name), code in seen.items():
        lines = inspect.getsourcelines(code)[0]
        assert len(lines) <= MAX_LINES, f"{path} {name}: {len(lines)} lines"


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
