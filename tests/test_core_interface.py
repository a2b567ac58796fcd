"""The fold and the layers talk through a small named interface (docs/development.md, "How a fold runs"): fold.py
reaches into no layer's private state, the layers import no private name of fold.py, and a layer's config fields
are real properties (no ``__getattr__`` / ``__setattr__`` fallback)."""
import ast
import inspect
import pathlib
from dataclasses import dataclass

import pytest
import torch

import whitenlayers as wl
from whitenlayers.layers import WhiteningLayer

PACKAGE = pathlib.Path(wl.__file__).parent

#: Private attributes fold.py may read that are not a layer's: torch's multi-tensor ops, a tensor's ``_base`` and a
#: NamedTuple's ``_replace``.
NOT_A_LAYERS = {"_foreach_add_", "_foreach_copy_", "_foreach_zero_", "_base", "_replace"}
#: The most private attributes of layers fold.py reads or writes (issue 73: 25 before the interface, 0 with it).
MAX_FOLD_PRIVATE_REACH = 5


def _private_reach(tree: ast.AST, skip_self: bool = False) -> list:
    """Every ``x._name`` in ``tree`` (not a dunder, not one of :data:`NOT_A_LAYERS`; ``skip_self``: not on
    ``self``), as ``"x._name"``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in NOT_A_LAYERS
                and not (skip_self and isinstance(node.value, ast.Name) and node.value.id == "self")):
            found.append(f"{ast.unparse(node.value)}.{node.attr}")
    return found


def test_fold_reaches_into_few_private_attributes_of_layers():
    reach = _private_reach(ast.parse((PACKAGE / "fold.py").read_text()))
    assert len(reach) <= MAX_FOLD_PRIVATE_REACH, sorted(reach)


def test_the_coordinators_fold_reaches_into_no_private_attribute_of_its_layers():
    """The coordinator's fold (its flush, the asynchronous fold and its worker) goes through the same interface."""
    tree = ast.parse((PACKAGE / "coordinator.py").read_text())
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for name in ("flush", "wait", "_fold_async", "_compute_jobs"):
        assert _private_reach(functions[name], skip_self=True) == [], name


def test_the_reach_counter_counts_a_layers_private_attribute():
    src = "def f(layers):\n    layers[0]._block.restart()\n    layer._pending_fold = None\n    torch._foreach_zero_(x)\n"
    assert sorted(_private_reach(ast.parse(src))) == ["layer._pending_fold", "layers[0]._block"]


def test_layers_import_no_private_name_of_fold():
    for path in sorted((PACKAGE / "layers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "fold":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, private)


# ------------------------------------------------------------------------------------------ config fields
def test_no_attribute_fallback_on_the_layers():
    for cls in inspect.getmro(WhiteningLayer):
        if cls is torch.nn.Module or cls is object:
            continue
        assert "__getattr__" not in vars(cls) and "__setattr__" not in vars(cls), cls


def test_config_fields_are_properties_read_from_the_config():
    grad, rec = wl.GradWhitenLinear(3, 2, alpha=0.8), wl.RecursiveWhitenLinear(3, 2)
    for name in wl.EVDConfig.field_names() + wl.RecursiveConfig.field_names():
        assert isinstance(inspect.getattr_static(grad, name), property), name
    assert grad.alpha == grad.config.alpha == 0.8 and rec.delta == rec.config.delta
    assert not hasattr(grad, "delta") and "delta" not in dir(grad) and "delta" in dir(rec)


def test_assigning_a_field_replaces_the_config_validated():
    layer = wl.GradWhitenLinear(3, 2)
    before = layer.config
    layer.alpha = 0.5
    assert layer.config == before.replace(alpha=0.5) and layer.rule.config is layer.config
    assert "alpha" not in layer.__dict__
    with pytest.raises(ValueError, match="alpha"):
        layer.alpha = 1.5
    assert layer.alpha == 0.5


def test_a_field_of_another_config_is_refused_not_stored():
    layer = wl.GradWhitenLinear(3, 2)
    with pytest.raises(AttributeError, match="'gamma'"):
        layer.gamma = 0.5  # a recursive config's field: an EVD layer has none (before: stored as a plain attribute)
    assert "gamma" not in layer.__dict__ and not hasattr(layer, "gamma")


def test_a_rule_of_ones_own_adds_its_configs_fields():
    @dataclass(frozen=True)
    class WiderConfig(wl.EVDConfig):
        widen_interface_test: float = 2.0

    class WiderRule(wl.rules.EVDRule):
        name = "wider_interface_test"
        config_class = WiderConfig

    layer = wl.GradWhitenLinear(3, 2, config=WiderConfig(), rule=WiderRule)
    assert layer.widen_interface_test == 2.0
    layer.widen_interface_test = 3.0
    assert layer.config.widen_interface_test == 3.0
    assert not hasattr(wl.GradWhitenLinear(3, 2), "widen_interface_test")
