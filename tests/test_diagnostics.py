"""Whitening diagnostics: kappa / rho per layer and averaged, for plain and converted models."""
import copy
import math
import warnings

import numpy as np
import pytest
import torch

import whitenlayers as wl
from whitenlayers import functional as F_w
from whitenlayers import models
from whitenlayers.convert import target_layers
from whitenlayers.diagnostics import summarize

METHODS = ["grad", "recursive", "direct"]


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


def small_resnet(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("width", 4)
    return models.cifar_resnet(8, **kw)


def correlated(g, n=16, size=16, dtype=torch.float32):
    """Three input channels sharing one strong common component, plus an offset."""
    base = torch.randn(n, 1, size, size, generator=g, dtype=dtype)
    return base + 0.3 * torch.randn(n, 3, size, size, generator=g, dtype=dtype) + 1.0


def batches(seed, count=2, **kw):
    g = torch.Generator().manual_seed(seed)
    return [correlated(g, **kw) for _ in range(count)]


def warm_up(*ms, steps=20, seed=1):
    """Training-mode forwards (no optimiser): BN running statistics and whitening folds."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(steps):
            x = correlated(g)
            for m in ms:
                m.train()(x)


def captured_covariances(model, names, data):
    """Reference: float64 covariance (about the data mean) of each named module's inputs, by torch.cov."""
    rows = {n: [] for n in names}
    mods = dict(model.named_modules())
    handles = []
    for n in names:
        def hook(m, args, n=n):
            x = args[0].detach().double()
            rows[n].append(x.transpose(0, 1).reshape(x.shape[1], -1) if x.dim() == 4 else x.t())
        handles.append(mods[n].register_forward_pre_hook(hook))
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    with torch.no_grad():
        for x in data:
            model(x)
    for h in handles:
        h.remove()
    for m, f in flags:
        m.training = f
    return {n: torch.cov(torch.cat(r, 1), correction=0) for n, r in rows.items()}


def snapshot(model):
    state = copy.deepcopy(model.state_dict())
    flags = [(n, m.training) for n, m in model.named_modules()]
    hooks = [(n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()]
    return state, flags, hooks


def assert_same_state(a, b):
    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    (sa, fa, ha), (sb, fb, hb) = a, b
    assert list(sa) == list(sb)
    for k in sa:
        assert same(sa[k], sb[k]), k
    assert fa == fb
    assert ha == hb


# --------------------------------------------------------------------------
# Plain models
# --------------------------------------------------------------------------
def test_plain_model_layers_values_and_averages():
    model = small_resnet()
    d = wl.collect_diagnostics(model, batches(0))
    assert list(d.kappa) == [n for n, _ in target_layers(model)] == list(d.rho)
    assert len(d.kappa) == 6 and set(d.kind.values()) == {"plain"}
    values_k, values_r = np.array(list(d.kappa.values())), np.array(list(d.rho.values()))
    assert ((values_k > 0) & (values_k <= 1)).all() and ((values_r > 0) & (values_r <= 1)).all()
    assert d.kappa_mean == pytest.approx(values_k.mean())
    assert d.kappa_sem == pytest.approx(values_k.std(ddof=1) / math.sqrt(6))
    assert d.rho_mean == pytest.approx(values_r.mean())
    assert d.rho_sem == pytest.approx(values_r.std(ddof=1) / math.sqrt(6))
    assert d.num_layers == 6
    assert d.as_dict() == {"kappa": d.kappa_mean, "kappa_sem": d.kappa_sem, "rho": d.rho_mean, "rho_sem": d.rho_sem}


def test_values_match_a_reference_covariance_over_all_batches():
    """Moments are summed over all samples, positions and batches (not averaged per batch)."""
    model = small_resnet()
    data = batches(3, count=3)
    data[1] = data[1] * 3 + 2  # batches with different statistics
    names = [n for n, _ in target_layers(model, include_linear=True)]
    assert "fc" in names
    ref = captured_covariances(model, names, data)
    d = wl.collect_diagnostics(model, data, include_linear=True)
    for n in names:
        assert d.kappa[n] == pytest.approx(float(F_w.normalized_rank(ref[n])), rel=1e-9)
        assert d.rho[n] == pytest.approx(float(F_w.whiteness(ref[n])), rel=1e-9)


def test_custom_targets_and_block_types():
    model = small_resnet()
    d = wl.collect_diagnostics(model, batches(0, count=1), predicate=lambda n, m: n == "conv1")
    assert list(d.kappa) == ["conv1"] and math.isnan(d.kappa_sem)  # one layer: no standard error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        empty = wl.collect_diagnostics(model, batches(0, count=1), block_types="Bottleneck")
    assert empty.kappa == {} and math.isnan(empty.kappa_mean)


def test_batch_forms_and_max_batches():
    model = small_resnet()
    data = batches(4, count=3)
    ref = wl.collect_diagnostics(model, data)
    labels = [torch.zeros(len(x), dtype=torch.long) for x in data]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(data), torch.cat(labels)),
                                         batch_size=16)
    for form in (list(zip(data, labels)), [[x, y] for x, y in zip(data, labels)], iter(data), loader):
        d = wl.collect_diagnostics(model, form)
        for n in ref.kappa:
            assert d.kappa[n] == pytest.approx(ref.kappa[n], rel=1e-9)
            assert d.rho[n] == pytest.approx(ref.rho[n], rel=1e-9)
    first = wl.collect_diagnostics(model, data[:1])
    limited = wl.collect_diagnostics(model, data, max_batches=1)
    assert limited.kappa == pytest.approx(first.kappa) and limited.kappa != pytest.approx(ref.kappa)


def test_float64_model_and_explicit_device():
    model = small_resnet().double()
    d = wl.collect_diagnostics(model, batches(0, dtype=torch.float64), device="cpu")
    assert all(0 < v <= 1 for v in d.rho.values())


def test_nonfinite_inputs_give_nan_and_a_warning():
    model = small_resnet()
    x = batches(0, count=1)[0]
    x[0, 0, 0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="no finite statistics"):
        d = wl.collect_diagnostics(model, [x])
    assert all(math.isnan(v) for v in d.kappa.values()) and math.isnan(d.rho_mean)


def test_summarize_means_skip_missing_layers():
    covs = {"a": torch.eye(3, dtype=torch.float64), "b": torch.ones(3, 3, dtype=torch.float64), "c": None}
    d = summarize(covs)
    assert d.kappa["a"] == pytest.approx(1.0) and d.kappa["b"] == pytest.approx(1 / 3)
    assert d.rho["a"] == pytest.approx(1.0) and d.rho["b"] == pytest.approx(1 / 3)
    assert math.isnan(d.kappa["c"]) and d.num_layers == 2
    assert d.rho_mean == pytest.approx(2 / 3)
    assert d.rho_sem == pytest.approx(np.std([1.0, 1 / 3], ddof=1) / math.sqrt(2))


# --------------------------------------------------------------------------
# Converted models
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_converted_model_right_after_conversion_matches_plain(method):
    plain = small_resnet()
    model = wl.convert_model(copy.deepcopy(plain), method=method)
    data = batches(5)
    dp, dm = wl.collect_diagnostics(plain, data), wl.collect_diagnostics(model, data)
    assert list(dm.kappa) == list(dp.kappa)  # same keys: the original conv names
    assert set(dm.kind.values()) == {"direct" if method == "direct" else "grad"}
    for n in dp.kappa:
        assert dm.kappa[n] == pytest.approx(dp.kappa[n], rel=1e-6)
        assert dm.rho[n] == pytest.approx(dp.rho[n], rel=1e-6)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_grad_layers_report_T_Phi_T(method):
    model = wl.convert_model(small_resnet(), method=method, block_size=1)
    warm_up(model, steps=4)
    data = batches(6)
    names = [n for n, _ in wl.whitening_layers(model)]
    ref = captured_covariances(model, names, data)
    d = wl.collect_diagnostics(model, data)
    for n, layer in wl.whitening_layers(model):
        t = layer.whitening_matrix.double()
        assert not torch.allclose(t, torch.eye(len(t), dtype=torch.float64))
        cov = t @ ref[n] @ t.t()
        assert d.kappa[n] == pytest.approx(float(F_w.normalized_rank(cov)), rel=1e-9)
        assert d.rho[n] == pytest.approx(float(F_w.whiteness(cov)), rel=1e-9)


def test_direct_layers_measure_the_whitened_input():
    model = wl.convert_model(small_resnet(), method="direct", block_size=1)
    warm_up(model, steps=4)
    data = batches(6)
    inner = [f"{n}.layer" for n, m in model.named_modules() if isinstance(m, wl.DirectWhitenWrapper)]
    ref = captured_covariances(model, inner, data)
    d = wl.collect_diagnostics(model, data)
    for n in inner:
        key = n[: -len(".layer")]
        assert d.kind[key] == "direct"
        assert d.rho[key] == pytest.approx(float(F_w.whiteness(ref[n])), rel=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_whitened_model_is_whiter_than_its_plain_original(method):
    plain = small_resnet()
    model = wl.convert_model(copy.deepcopy(plain), method=method, block_size=1)
    warm_up(plain, model)  # same BN statistics; 20 folds for the whitening layers
    data = batches(2)
    dp, dm = wl.collect_diagnostics(plain, data), wl.collect_diagnostics(model, data)
    assert dm.rho_mean > dp.rho_mean + 0.03
    assert all(0 < v <= 1 for v in list(dm.rho.values()) + list(dm.kappa.values()))
    if method != "recursive":  # the EVD transform whitens the whole signal subspace: rank goes up too
        assert dm.kappa_mean > dp.kappa_mean + 0.03


@pytest.mark.parametrize("method", METHODS)
def test_layer_diagnostics_from_running_buffers(method):
    model = wl.convert_model(small_resnet(), method=method, block_size=1)
    fresh = wl.layer_diagnostics(model)
    assert len(fresh.kappa) == 6 and all(math.isnan(v) for v in fresh.kappa.values())
    assert math.isnan(fresh.kappa_mean) and fresh.num_layers == 0
    warm_up(model, steps=3)
    d = wl.layer_diagnostics(model)
    assert list(d.kappa) == [n for n, _ in target_layers(small_resnet())]
    for name, layer in wl.whitening_layers(model):
        key = name[: -len(".whiten")] if method == "direct" else name
        cov = layer.whitened_covariance()
        assert d.kappa[key] == pytest.approx(float(F_w.normalized_rank(cov)))
        assert d.rho[key] == pytest.approx(float(F_w.whiteness(cov)))
        assert 0 < d.kappa[key] <= 1 and 0 < d.rho[key] <= 1
    assert d.num_layers == 6 and 0 < d.rho_mean <= 1
    assert wl.layer_diagnostics(small_resnet()).kappa == {}


@pytest.mark.parametrize("method", [None] + METHODS)
def test_gathering_changes_no_state(method):
    model = small_resnet()
    if method is not None:
        wl.convert_model(model, method=method, block_size=3)
    model.train()
    model(batches(7, count=1)[0])  # a partial block in the accumulators (extra state)
    model.layer2.eval()  # mixed training flags
    model.layer1[0].register_forward_pre_hook(lambda *a: None)
    twin = copy.deepcopy(model)
    before = snapshot(model)
    if method is not None:
        assert any(m.batches_in_block == 1 for _, m in wl.whitening_layers(model))
    wl.collect_diagnostics(model, batches(8))
    wl.layer_diagnostics(model)
    assert_same_state(snapshot(model), before)
    # and training goes on exactly as in a copy that never ran diagnostics
    x = batches(9, count=1)[0]
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
    model(x), twin(x)
    assert_same_state(snapshot(model), snapshot(twin))
    if method is not None:
        blocks = {n: int(m.num_blocks) for n, m in wl.whitening_layers(model)}
        assert all(v == (0 if n.startswith("layer2") else 1) for n, v in blocks.items())  # layer2 is in eval


def test_exception_during_gathering_restores_the_model():
    model = wl.convert_model(small_resnet(), block_size=3)
    model.train()
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        wl.collect_diagnostics(model, [torch.randn(2, 5, 16, 16)])  # wrong channel count in the stem
    assert_same_state(snapshot(model), before)
