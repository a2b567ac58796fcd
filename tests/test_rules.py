"""The public rule contract: a researcher's rule (docs/writing-a-rule.md, ``tests/rule_example.py``) passed to
``convert_model`` or a layer, called for every layer at every fold, its result checked before it is written, its
name and hyper-parameters in the checkpoint."""
from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Dict

import pytest
import torch
from rule_example import EigenbasisConfig, EigenbasisRule

import whitenlayers as wl
from whitenlayers import rules
from whitenlayers.fold import fold_layers
from whitenlayers.layers.checkpoint import decode_identity, encode_identity


def _x(m: int = 16, seed: int = 0, n: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(m, m, generator=g) * torch.logspace(0, -1.5, m).view(1, m)
    return torch.einsum("bchw,cd->bdhw", torch.randn(n, m, 6, 6, generator=g), mix.T) + 1.0


@pytest.fixture
def registered():
    """Rules registered by a test, unregistered after it."""
    before = dict(rules._RULES)
    yield
    rules._RULES.clear()
    rules._RULES.update(before)


# --------------------------------------------------------------------------- the example rule of the docs page
def test_the_docs_example_rule_trains_through_convert_model_with_its_own_hyper_parameter():
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1, rule=EigenbasisRule,
                             power_iterations=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        loss = model(torch.randn(4, 3, 8, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    layers = [layer for _, layer in wl.whitening_layers(model)]
    assert all(type(layer.rule) is EigenbasisRule and layer.config.power_iterations == 2 for layer in layers)
    assert all(int(layer.num_blocks) == 3 and layer.transform_failures == 0 for layer in layers)
    assert all(hasattr(layer, "eigenbasis") and "eigenbasis" in layer.state_dict() for layer in layers)
    assert layers[0].rule_name == "eigenbasis"


def test_the_example_rule_converges_to_the_eigenbasis_of_a_fixed_covariance():
    """Power iteration from the previous basis, fold after fold, reaches the eigenbasis: ``Q`` then equals
    ``V diag(min(mean / lambda, gmax)) V^T`` from ``eigh`` (well separated spectrum: fast convergence)."""
    layer = wl.GradWhitenLinear(6, 3, rule=EigenbasisRule, block_size=1, alpha=0.0, beta=0.0)
    g = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    scales = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    x = (torch.randn(4000, 6, generator=g, dtype=torch.float64) * scales) @ basis.T
    for _ in range(40):
        layer(x.float())
    lam, vec = torch.linalg.eigh(layer.running_cov.double())
    gains = torch.clamp(lam.mean() / lam, max=layer.gmax)
    torch.testing.assert_close(layer.grad_transform.double(), (vec * gains) @ vec.T, rtol=1e-4, atol=1e-4)


def test_a_layer_takes_the_rule_as_a_class_or_a_registered_name(registered):
    wl.register_rule(EigenbasisRule)
    wl.register_rule(EigenbasisRule)  # again: a no-op
    a = wl.GradWhitenConv2d(4, 4, 3, rule="eigenbasis")
    b = wl.DirectWhiten(4, rule=EigenbasisRule, power_iterations=3)
    c = wl.GradWhitenConv2d(4, 4, 3, config=EigenbasisConfig(power_iterations=4))  # the registered rule of a config
    assert type(a.rule) is type(b.rule) is type(c.rule) is EigenbasisRule
    assert b.config.power_iterations == 3 and c.config.power_iterations == 4
    d = wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, config=wl.EVDConfig(gmax=5.0))  # lifted to its config
    assert type(d.config) is EigenbasisConfig and d.config.gmax == 5.0


def test_bad_rules_and_arguments_are_refused_with_clear_errors(registered):
    class NoName(rules.EVDRule):  # inherits "evd": its checkpoints would load as EVD's
        pass

    class Other(rules.TransformRule):
        name = "eigenbasis"
        config_class = wl.EVDConfig

    with pytest.raises(TypeError, match="NoName must set a name of its own.*inherits name='evd'"):
        wl.GradWhitenConv2d(4, 4, 3, rule=NoName)
    with pytest.raises(ValueError, match="no rule is registered as 'nope'; registered: 'evd', 'recursive'"):
        wl.convert_model(wl.models.resnet20(), method="grad", rule="nope")
    with pytest.raises(TypeError, match="rule EigenbasisRule takes a EigenbasisConfig, but this layer needs a "
                                        "RecursiveConfig"):
        wl.convert_model(wl.models.resnet20(), method="recursive", rule=EigenbasisRule)
    with pytest.raises(TypeError, match="unexpected whitening argument.*'power_iterations'"):
        wl.convert_model(wl.models.resnet20(), method="grad", power_iterations=2)
    with pytest.raises(ValueError, match=r"^GradWhitenConv2d: EigenbasisConfig: power_iterations \(power iterations "
                                         r"per fold\) must be an integer >= 1, but got power_iterations=0$"):
        wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, power_iterations=0)
    with pytest.raises(TypeError, match="a TransformRule subclass or a registered name"):
        wl.GradWhitenConv2d(4, 4, 3, rule=object)
    wl.register_rule(EigenbasisRule)
    with pytest.raises(ValueError, match="a rule named 'eigenbasis' is already registered"):
        wl.register_rule(Other)


# --------------------------------------------------------------------------- every layer, every fold
class _CountingEVD(rules.EVDRule):
    """A subclass that overrides ``update`` alone (what a researcher does first): it must see every layer."""

    name = "counting-evd"
    calls: list = []

    def update(self, fold, state, precomputed=rules.NOT_COMPUTED):
        type(self).calls.append(precomputed is rules.NOT_COMPUTED)
        return super().update(fold, state, precomputed)


def test_a_subclass_overriding_only_update_gets_every_layer_unbatched():
    _CountingEVD.calls = []
    layers = [wl.GradWhitenConv2d(8, 4, 1, rule=_CountingEVD, block_size=10**6) for _ in range(3)]
    evd = [wl.GradWhitenConv2d(8, 4, 1, block_size=10**6) for _ in range(3)]
    assert rules.batch_key_of(evd[0].rule, 8, torch.float32, torch.device("cpu")) is not None  # EVD batches
    for fold in range(2):
        for layer in layers + evd:
            layer(_x(8, seed=fold))
        fold_layers(layers)
        fold_layers(evd)  # EVD's batched eigh
    assert _CountingEVD.calls == [True] * 6  # 3 of 3 layers, at each of the 2 folds, with nothing precomputed
    for a, b in zip(layers, evd):  # the same maths (batched against single eigh: float tolerance)
        torch.testing.assert_close(a.grad_transform, b.grad_transform, rtol=16 * 8 * 1.2e-7, atol=1e-6)
    assert rules.batches_own_results(rules.EVDRule) and not rules.batches_own_results(_CountingEVD)


# --------------------------------------------------------------------------- results checked before written
class _Broken(rules.TransformRule):
    name = "broken"
    config_class = wl.EVDConfig
    mode = "shape"

    def update(self, fold, state: Dict[str, torch.Tensor], precomputed: Any = None):
        m = fold.cov.shape[-1]
        t = torch.eye(m)
        if self.mode == "shape":
            return wl.RuleResult(torch.eye(m + 1), torch.eye(m + 1), {})
        if self.mode == "nan":
            return wl.RuleResult(t * float("nan"), t, {})
        if self.mode == "asymmetric":
            return wl.RuleResult(t, t + torch.triu(torch.ones(m, m), 1), {})
        if self.mode == "dtype":
            return wl.RuleResult(t.half(), t.half(), {})
        if self.mode == "buffer":
            return wl.RuleResult(t, t, {"running_mean": torch.zeros(m)})
        return (t, t)  # not a RuleResult


@pytest.mark.parametrize("mode, problem", [
    ("shape", r"transform has shape \(5, 5\), but the layer needs \(4, 4\)"),
    ("nan", "non-finite values"),
    ("asymmetric", r"a gram \(Q\) that is not symmetric"),
    ("dtype", "transform has dtype torch.float16, but must be float32 or float64"),
    ("buffer", r"RuleResult.buffers holds 'running_mean', which are not among the rule's buffers \(none: "
               r"initial_buffers\)"),
    ("tuple", "update returned a tuple, not a RuleResult"),
])
def test_a_bad_result_keeps_the_previous_transform_is_counted_and_warns_once(monkeypatch, mode, problem):
    monkeypatch.setattr(_Broken, "mode", mode)
    layer = wl.GradWhitenConv2d(4, 4, 3, rule=_Broken, block_size=1)
    layer.layer_name = "features.3"
    with pytest.warns(RuntimeWarning, match=f"GradWhitenConv2d 'features.3' .*rule 'broken' \\(_Broken\\) returned an "
                                            f"invalid result: {problem}; the previous transform is kept"):
        layer(_x(4))
    assert layer.transform_failures == 1 and int(layer.num_blocks) == 1
    assert torch.equal(layer.whitening_matrix, torch.eye(4)) and torch.equal(layer.grad_transform, torch.eye(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        layer(_x(4, seed=1))
    assert layer.transform_failures == 2


# --------------------------------------------------------------------------- the rule in the checkpoint
def test_the_checkpoint_holds_the_rules_name_and_hyper_parameters():
    layer = wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, power_iterations=2, gmax=5.0)
    text = decode_identity(layer.state_dict()["whitening_rule"])
    assert text is not None and text.startswith('{"rule":"eigenbasis","block_size":10,')
    assert '"gmax":5.0' in text and '"power_iterations":2' in text
    layer.config = layer.config.replace(power_iterations=3)  # written from the rule in force at each save
    assert '"power_iterations":3' in decode_identity(layer.state_dict()["whitening_rule"])
    shape = layer.state_dict()["whitening_rule"].shape
    assert shape == wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule).state_dict()["whitening_rule"].shape == (512,)


def test_a_checkpoint_of_another_rule_does_not_load_and_names_both():
    model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
    model(torch.randn(2, 3, 8, 8))
    state = copy.deepcopy(model.state_dict())
    other = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1, rule=EigenbasisRule)
    with pytest.warns(UserWarning) as record:
        # (strict: the checkpoint's identity of another rule is an unexpected key, not loaded)
        with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "layer1.0.conv1.whitening_rule"'):
            other.load_state_dict(state)
    said = [str(w.message) for w in record]
    assert len(said) == len(wl.whitening_layers(other)), said  # one for each layer, naming it
    assert all(re.search("the checkpoint at '[\\w.]+' was saved with the rule 'evd', but this layer's rule is "
                         "'eigenbasis' \\(EigenbasisRule\\); build the model with rule='evd'", m) for m in said), said
    assert any("the checkpoint at 'layer1.0.conv1' was saved" in m for m in said), said
    with pytest.warns(UserWarning, match="saved with the rule 'evd'.*strict=False: loaded into this layer's rule"):
        other.load_state_dict(state, strict=False)
    assert '"rule":"eigenbasis"' in decode_identity(other.state_dict()["layer1.0.conv1.whitening_rule"])


def test_checkpoints_without_the_identity_and_plain_ones_load_as_before():
    model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
    model(torch.randn(2, 3, 8, 8))
    old = {k: v for k, v in model.state_dict().items() if not k.endswith("whitening_rule")}
    twin = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
    assert twin.load_state_dict(old) is not None  # strict: no missing key
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name
    plain = wl.models.resnet20()
    assert wl.load_plain_state_dict(twin, plain.state_dict()) == ([], [])
    assert "whitening_rule" not in "".join(wl.plain_state_dict(model))


def test_other_hyper_parameters_load_keep_the_layers_own_and_warn_once():
    a = wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, power_iterations=2)
    b = wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, power_iterations=5)
    with pytest.warns(UserWarning, match=r"power_iterations=2 \(this layer: 5\); the layer keeps its own"):
        b.load_state_dict(a.state_dict())
    assert b.config.power_iterations == 5
    assert '"power_iterations":5' in decode_identity(b.state_dict()["whitening_rule"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once for this difference
        wl.GradWhitenConv2d(4, 4, 3, rule=EigenbasisRule, power_iterations=5).load_state_dict(a.state_dict())


def test_the_identity_survives_averaging_low_precision_casts_and_to_empty():
    text = '{"rule":"evd","gmax":10.0}'
    enc = encode_identity(text)
    assert enc.shape == (512,) and decode_identity(enc.bfloat16()) == text  # bytes are exact in bf16
    assert decode_identity(torch.lerp(enc, enc.clone(), 0.1)) == text  # an EMA of equal values
    assert decode_identity(torch.full((4,), 300.0)) is None and decode_identity(torch.tensor([65.0, 0.0, 66.0])) is None
    layer = wl.GradWhitenConv2d(4, 4, 3, device="meta", rule=EigenbasisRule)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert decode_identity(layer.whitening_rule).startswith('{"rule":"eigenbasis"')


# DCP in one process (its message before torch 2.6 lacks "disabled, "; torch 2.4's own file writer warns of
# TypedStorage)
@pytest.mark.filterwarnings("ignore:torch.distributed is .*unavailable or uninitialized:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_dcp_round_trip_and_mismatch(tmp_path):
    """``torch.distributed.checkpoint`` shapes the loaded state from a fresh model: the identity has that shape."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1, rule=EigenbasisRule)
    model(torch.randn(2, 3, 8, 8))
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    fresh = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1, rule=EigenbasisRule)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.layer1[0].conv1.eigenbasis, model.layer1[0].conv1.eigenbasis)
    evd = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
    state = evd.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    with pytest.warns(UserWarning, match="saved with the rule 'eigenbasis', but this layer's rule is 'evd'"):
        with pytest.raises(RuntimeError, match="Unexpected key\\(s\\) in state_dict: .*whitening_rule"):
            evd.load_state_dict(state)


class _MyRecursive(rules.RecursiveRule):
    name = "my-recursive"  # the recursive rule's buffers, a name of its own


class _Identity(rules.TransformRule):
    name = "identity"  # a recursive layer's rule without the recursive rule's buffers
    config_class = wl.RecursiveConfig

    def update(self, fold, state, precomputed: Any = None):
        m = fold.cov.shape[-1]
        return wl.RuleResult(torch.eye(m), torch.eye(m), {})


@pytest.mark.parametrize("rule", [_MyRecursive, _Identity])
def test_a_recursive_layers_own_rule_saves_and_loads_its_checkpoint(rule):
    a = wl.RecursiveWhitenConv2d(4, 4, 3, rule=rule, block_size=1)
    a(_x(4))
    b = wl.RecursiveWhitenConv2d(4, 4, 3, rule=rule, block_size=1)
    b.load_state_dict(a.state_dict())
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    with pytest.warns(UserWarning) as record:
        with pytest.raises(RuntimeError, match="Unexpected key\\(s\\) in state_dict: .*whitening_rule"):
            b.load_state_dict(wl.RecursiveWhitenConv2d(4, 4, 3, block_size=1).state_dict())
    said = [str(w.message) for w in record]
    assert any(f"saved with the rule 'recursive', but this layer's rule is '{rule.name}'" in m for m in said), said
    # the identity rule keeps no recursive buffers, so its layer's method is 'grad' (WhiteningLayer.method): the
    # method check also complains, about the extra keys; the recursive rule's subclass keeps them and does not
    method = [m for m in said if "holds a 'recursive' whitening layer at '<root>', but this model's layer there is "
              "'grad'" in m]
    assert len(method) == (rule is _Identity) and len(said) == 1 + len(method), said


def test_converting_again_with_another_rule_is_refused():
    model = wl.convert_model(wl.models.resnet20(), method="grad", rule=EigenbasisRule)
    assert wl.convert_model(model, method="grad", rule=EigenbasisRule) is model  # the same rule: a no-op
    with pytest.raises(ValueError, match="'layer1.0.conv1' was converted with the rule 'eigenbasis' \\(EigenbasisRule\\)"
                                         ", and this call asks for 'evd' \\(EVDRule\\)"):
        wl.convert_model(model, method="grad")


def test_the_usage_snippet_of_the_rule_page_runs_as_written(tmp_path):
    """docs/writing-a-rule.md's snippet, with the example rule saved as the page says (``eigenbasis.py`` beside the
    script): its imports resolve from an installed package, it runs and prints what its comments say."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "writing-a-rule.md").read_text()
    snippet = page[page.index("Use it by passing the class"):]
    code = re.search(r"```python\n(.*?)```", snippet, flags=re.S).group(1)
    (tmp_path / "eigenbasis.py").write_text((root / "tests" / "rule_example.py").read_text())
    (tmp_path / "use.py").write_text(code)
    out = subprocess.run([sys.executable, "use.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    # each print's comment, up to a colon, is the line it prints
    said = [line.split("#", 1)[1].split(":")[0].strip() for line in code.splitlines() if line.startswith("print(")]
    assert len(said) == 3 and out.stdout.splitlines() == said
