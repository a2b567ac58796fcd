"""The core hands records over by name: few subscripts of a plain name by an integer constant (``kept[3]``,
``shared[0]``: a positional record, or a first element) in ``whitenlayers/layers/``, ``fold.py`` and
``coordinator.py`` (issue 73: 89 before the records were named), and none in the step's and the direct layers'
modules, whose hand-offs are all named (``Step``, ``InForce``, ``CentringRef``)."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import whitenlayers as wl

PACKAGE = Path(wl.__file__).parent
#: The whole core's bound (issue 73's goal).
MAX_RECORD_SUBSCRIPTS = 25
#: Files whose hand-offs are all named records (a subscript there would be a new positional record).
NAMED_ONLY = ("layers/step.py", "layers/direct.py")


def record_subscripts() -> Counter:
    """Per file of the core (relative to the package): its subscripts of a plain name by an int constant."""
    files = sorted((PACKAGE / "layers").glob("*.py")) + [PACKAGE / "fold.py", PACKAGE / "coordinator.py"]
    counts: Counter = Counter()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                    and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int):
                counts[path.relative_to(PACKAGE).as_posix()] += 1
    return counts


def test_the_counter_counts_positional_subscripts():
    """The counter sees ``kept[3]`` (and not ``kept.offset``, ``x[i]``, ``x[:2]`` or ``d["a"]``)."""
    tree = ast.parse("kept[3]\nkept.offset\nx[i]\nx[:2]\nd['a']\nself.parts[0]\n")
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
             and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int]
    assert [ast.unparse(node) for node in found] == ["kept[3]"]
    assert sum(record_subscripts().values()) > 0  # the files are found


def test_the_step_and_direct_modules_hand_over_named_records():
    counts = record_subscripts()
    assert {name: counts[name] for name in NAMED_ONLY} == dict.fromkeys(NAMED_ONLY, 0)


def test_few_positional_subscripts_in_the_core():
    counts = record_subscripts()
    assert sum(counts.values()) <= MAX_RECORD_SUBSCRIPTS, dict(counts)


def test_one_predicate_decides_whether_a_layer_gathers(monkeypatch):
    """``gathers_now`` is the one place: a layer whose predicate says no gathers, counts and folds nothing, by a
    training forward, an explicit ``accumulate`` or a joined rank's batch without data; with the predicate as it
    is, each of them does."""
    import warnings

    import torch

    def run():
        torch.manual_seed(0)
        model = wl.convert_model(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3)), "grad",
                                 block_size=2, targets="all", include_stem=True, include_classifier=True)
        layers = [layer for _, layer in wl.whitening_layers(model)]
        model(torch.randn(2, 3, 8, 8))
        layers[0].accumulate(torch.randn(5, 3))
        coordinator = next(h for h in model._forward_hooks.values() if isinstance(h, wl.coordinator.FoldCoordinator))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            coordinator._shadow_forward()  # a second batch, without data: the blocks end and fold
        return layers, caught

    layers, caught = run()
    assert [int(layer.num_blocks) for layer in layers] == [1, 1]
    monkeypatch.setattr(wl.WhiteningLayer, "gathers_now", lambda self, *args, **kwargs: False)
    layers, caught = run()
    assert [(int(layer.num_blocks), layer.batches_in_block) for layer in layers] == [(0, 0), (0, 0)]
    assert all(float(layer._block.rows) == 0 for layer in layers)
