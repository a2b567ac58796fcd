"""Config dataclasses (one source of hyper-parameters), rules, and the layers' public state surface."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest
import torch

import whitenlayers as wl
from whitenlayers.config import EVDConfig, RecursiveConfig, WhiteningConfig, field_doc, field_range, make_config
from whitenlayers.rules import EVDRule, RecursiveRule, rule_for

INVALID = [
    ("block_size", 0), ("block_size", 2.0), ("block_size", True), ("alpha", 1.0), ("alpha", -0.1),
    ("beta", 1.0), ("eps", 0.0), ("eps", float("nan")), ("stats_fraction", 0.0), ("stats_fraction", 1.5),
]
EVD_INVALID = INVALID + [("gmax", 0.5), ("gmax", float("inf")), ("gains", "whatever")]
REC_INVALID = INVALID + [("gamma", 0.0), ("gamma", 1.5), ("delta", 0.0), ("c_rel", -1.0), ("c_abs", -1e-9)]


def test_defaults_are_the_papers_values():
    assert dataclasses.asdict(EVDConfig()) == dict(block_size=10, alpha=0.9, eps=1e-5, stats_fraction=1.0,
                                                   accumulation_steps=1, stats_every=1, beta=0.95, gmax=10.0,
                                                   gains="practical")
    assert dataclasses.asdict(RecursiveConfig()) == dict(block_size=10, alpha=0.1, eps=1e-5, stats_fraction=1.0,
                                                         accumulation_steps=1, stats_every=1, beta=0.1, gamma=0.99, delta=0.25, c_rel=0.025, c_abs=1e-6)


@pytest.mark.parametrize("name,value", EVD_INVALID)
def test_evd_config_validates_in_post_init(name, value):
    with pytest.raises(ValueError, match=rf"^EVDConfig \(methods 'grad' and 'direct'\): {name} \(.+\) must be .*, but "
                                         rf"got {name}="):
        EVDConfig(**{name: value})


@pytest.mark.parametrize("name,value", REC_INVALID)
def test_recursive_config_validates_in_post_init(name, value):
    with pytest.raises(ValueError, match=rf"^RecursiveConfig \(method 'recursive'\): {name} \(.+\) must be .*, but "
                                         rf"got {name}="):
        RecursiveConfig(**{name: value})


def test_config_is_frozen_and_replace_validates():
    c = EVDConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.alpha = 0.5
    assert c.replace(alpha=0.5).alpha == 0.5 and c.alpha == 0.9
    with pytest.raises(ValueError, match="alpha"):
        c.replace(alpha=2.0)
    assert c.replace(gmax=3.0).non_defaults() == {"gmax": 3.0}


def test_every_field_has_help_text():
    for cls in (EVDConfig, RecursiveConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), (cls.__name__, f.name)


def test_config_docstrings_are_built_from_the_field_metadata():
    """Each field's meaning, range, default and when to change it: written once (metadata), in the class
    docstring's Args section (help(), the API reference) and, less the long texts, in the runner's --help."""
    for cls in (WhiteningConfig, EVDConfig, RecursiveConfig):
        doc = " ".join(cls.__doc__.split())
        assert "Args:" in cls.__doc__
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"] and f.metadata["when"], (cls.__name__, f.name)
            entry = field_doc(f)
            assert f"Valid: {field_range(f.name)}. Default: ``{f.default!r}``." in entry
            assert f"{f.name}: {' '.join(entry.split())}" in doc, (cls.__name__, f.name)
    # the recursive rule's own alpha text, not the EVD one
    assert "Default: ``0.1``" in field_doc(next(f for f in dataclasses.fields(RecursiveConfig) if f.name == "alpha"))


def test_layer_signatures_and_defaults_come_from_the_configs():
    for cls, cfg in [(wl.GradWhitenConv2d, EVDConfig), (wl.GradWhitenLinear, EVDConfig),
                     (wl.RecursiveWhitenConv2d, RecursiveConfig), (wl.RecursiveWhitenLinear, RecursiveConfig)]:
        params = inspect.signature(cls).parameters
        for f in dataclasses.fields(cfg):
            assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default
    assert "beta" not in inspect.signature(wl.DirectWhiten).parameters
    layer = wl.RecursiveWhitenConv2d(3, 4, 3)
    assert layer.config == RecursiveConfig() and layer.method == "recursive" and isinstance(layer.rule, RecursiveRule)
    assert wl.DirectWhiten(3).config == EVDConfig() and isinstance(wl.DirectWhiten(3).rule, EVDRule)


def test_layer_takes_config_and_keywords_on_top():
    cfg = RecursiveConfig(alpha=0.3, block_size=4)
    layer = wl.RecursiveWhitenLinear(3, 2, config=cfg, gamma=0.9)
    assert layer.config == RecursiveConfig(alpha=0.3, block_size=4, gamma=0.9)
    assert (layer.alpha, layer.block_size, layer.gamma) == (0.3, 4, 0.9)
    assert "alpha=0.3" in repr(layer) and "gamma=0.9" in repr(layer) and "delta" not in repr(layer)
    with pytest.raises(TypeError, match="RecursiveWhitenLinear expects config to be a RecursiveConfig"):
        wl.RecursiveWhitenLinear(3, 2, config=EVDConfig())


@pytest.mark.parametrize("make,bad", [
    (lambda **kw: wl.GradWhitenConv2d(3, 4, 3, **kw), "gamma"),
    (lambda **kw: wl.RecursiveWhitenConv2d(3, 4, 3, **kw), "gmax"),
    (lambda **kw: wl.DirectWhiten(3, **kw), "beta"),
    (lambda **kw: wl.GradWhitenLinear(3, 4, **kw), "blocksize"),
])
def test_unknown_whitening_argument_is_a_type_error_naming_the_layer_and_valid_ones(make, bad):
    with pytest.raises(TypeError, match=rf"got unexpected whitening argument\(s\) '{bad}'; it takes block_size, alpha"):
        make(**{bad: 1.0})


def test_invalid_value_at_construction_names_the_argument():
    with pytest.raises(ValueError, match=r"^RecursiveWhitenConv2d: RecursiveConfig \(method 'recursive'\): delta "
                                         r"\(target power of the reduced direction, relative to the mean power\) "
                                         r"must be > 0, but got delta=-1$"):
        wl.RecursiveWhitenConv2d(3, 4, 3, delta=-1)


def test_assigning_a_hyperparameter_replaces_the_config_validated():
    layer = wl.GradWhitenConv2d(3, 4, 1, block_size=2)
    layer.gmax = 3.0
    assert layer.config.gmax == 3.0 and layer.rule.config is layer.config
    with pytest.raises(ValueError, match=r"gmax \(largest whitening gain\) must be >= 1"):
        layer.gmax = 0.5
    assert layer.gmax == 3.0
    with pytest.raises(AttributeError, match="has no attribute 'gamma'"):
        layer.gamma
    layer.block_size = 1  # takes effect at once: the next training forward ends a block
    layer(torch.randn(2, 3, 4, 4))
    assert int(layer.num_blocks) == 1


def test_rule_for_and_rule_type_checks():
    assert isinstance(rule_for(EVDConfig()), EVDRule) and isinstance(rule_for(RecursiveConfig()), RecursiveRule)
    with pytest.raises(TypeError, match="EVDRule expects a EVDConfig"):
        EVDRule(RecursiveConfig())
    with pytest.raises(TypeError, match="EVDConfig"):
        make_config(EVDConfig, "X", RecursiveConfig(), {})


def test_batches_in_block_is_public_and_read_only():
    layer = wl.GradWhitenConv2d(3, 4, 1, block_size=3)
    seen = []
    for _ in range(4):
        layer(torch.randn(2, 3, 4, 4))
        seen.append(layer.batches_in_block)
    assert seen == [1, 2, 0, 1]
    with pytest.raises(AttributeError):
        layer.batches_in_block = 0


def test_frozen_layer_applies_its_transform_but_updates_nothing():
    torch.manual_seed(0)
    layer = wl.GradWhitenConv2d(3, 4, 1, bias=False, block_size=2)
    for _ in range(3):  # a fold, then one batch of the next block
        layer(torch.randn(4, 3, 5, 5) * torch.tensor([1.0, 4.0, 0.5]).view(1, 3, 1, 1) + 2)
    state = copy.deepcopy(layer.state_dict())
    assert layer.freeze() is layer and layer.frozen
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    for _ in range(5):
        layer(x).sum().backward()
    after = layer.state_dict()
    for k, v in state.items():
        if torch.is_tensor(v):
            assert torch.equal(after[k], v), k
    assert layer.batches_in_block == 1
    # the gradient transform in force is still applied: the weight gradient is the plain one times Q_s
    plain = torch.nn.Conv2d(3, 4, 1, bias=False)
    plain.weight.data.copy_(layer.weight.data)
    layer.weight.grad = None
    xc = (x - layer.running_mean.view(1, 3, 1, 1)).detach()
    layer(x).sum().backward()
    plain(xc).sum().backward()
    want = torch.einsum("oikl,ij->ojkl", plain.weight.grad, layer.grad_transform)
    torch.testing.assert_close(layer.weight.grad, want)
    layer.freeze(False)
    layer(x)
    assert int(layer.num_blocks) == 2


def test_process_group_is_a_constructor_and_convert_model_argument():
    assert wl.GradWhitenConv2d(3, 4, 1, process_group="g").process_group == "g"
    assert wl.DirectWhiten(3, process_group="g").process_group == "g"
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4), method="recursive", process_group="g",
                             config=RecursiveConfig(block_size=3), alpha=0.2)
    layers = [m for _, m in wl.whitening_layers(model)]
    assert layers and all(m.process_group == "g" and m.config == RecursiveConfig(block_size=3, alpha=0.2)
                          for m in layers)
    with pytest.raises(TypeError, match="expects config to be a EVDConfig"):
        wl.convert_model(wl.models.cifar_resnet(8, width=4), method="direct", config=RecursiveConfig())


def test_make_standalone_folds_on_its_own():
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4), block_size=2)
    layer = copy.deepcopy(model.layer1[0].conv1)
    layer.train()
    x = torch.randn(2, 4, 6, 6)
    layer(x)
    assert layer.make_standalone() is layer
    layer(x)
    assert int(layer.num_blocks) == 1 and layer.batches_in_block == 0


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_config_survives_copies(how):
    layer = wl.RecursiveWhitenConv2d(3, 4, 1, alpha=0.3)
    clone = copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))
    assert clone.config == layer.config and clone.rule is not layer.rule


def test_plumbing_is_not_in_the_top_level_namespace():
    assert not hasattr(wl, "FoldCoordinator") and not hasattr(wl, "fold_layers")
    assert {"EVDConfig", "RecursiveConfig"} <= set(wl.__all__)


def test_getting_started_table_matches_the_configs():
    """docs/getting-started.md's hyper-parameter table: a row per config field, its defaults and range the
    configs' (the long texts live in the configs only)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and cells[0].strip("`") != "argument":
            rows[cells[0].strip("`")] = cells
    fields = {f.name for cls in (EVDConfig, RecursiveConfig) for f in dataclasses.fields(cls)}
    assert set(rows) == fields

    def value(cell):
        cell = cell.strip("`")
        return None if cell == "—" else cell.strip('"') if cell.startswith('"') else float(cell)

    for col, cls in ((2, EVDConfig), (3, RecursiveConfig)):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name, cells in rows.items():
            assert value(cells[col]) == defaults.get(name), (cls.__name__, name, cells[col])
    for name, cells in rows.items():
        rng = field_range(name).replace("in ", "").replace("an integer", "integer").replace("'", '"')
        assert rng.replace("`", "") == cells[4].replace("`", ""), (name, cells[4], rng)
