"""Initialised and cast like any module (issue 33): meta-device init, ``to_empty`` + ``reset_parameters``, models
cast to low precision, and checkpoints of one method loaded into another."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import whitenlayers as wl

NAN = float("nan")


def _layers():
    """(name, factory) for every whitening layer class; the factory takes ``device``."""
    return [
        ("GradWhitenConv2d", lambda d: wl.GradWhitenConv2d(3, 4, 3, padding=1, bias=False, block_size=2, device=d)),
        ("GradWhitenConv2d-bias", lambda d: wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=2, device=d)),
        ("GradWhitenConv2d-groups", lambda d: wl.GradWhitenConv2d(4, 4, 3, padding=1, groups=2, block_size=2,
                                                                   device=d)),
        ("GradWhitenConv2d-patches", lambda d: wl.GradWhitenConv2d(2, 4, 3, padding=1, features="patches",
                                                                    block_size=2, device=d)),
        ("GradWhitenLinear", lambda d: wl.GradWhitenLinear(3, 4, block_size=2, device=d)),
        ("RecursiveWhitenConv2d", lambda d: wl.RecursiveWhitenConv2d(3, 4, 3, padding=1, block_size=2, device=d)),
        ("RecursiveWhitenLinear", lambda d: wl.RecursiveWhitenLinear(3, 4, block_size=2, device=d)),
        ("GradWhitenConv1d", lambda d: wl.GradWhitenConv1d(3, 4, 3, padding=1, block_size=2, device=d)),
        ("RecursiveWhitenConv3d", lambda d: wl.RecursiveWhitenConv3d(3, 4, 1, block_size=2, device=d)),
        ("DirectWhiten", lambda d: wl.DirectWhiten(3, block_size=2, device=d)),
        ("DirectWhiten-groups", lambda d: wl.DirectWhiten(4, groups=2, block_size=2, device=d)),
    ]


def _fill_garbage(module: nn.Module) -> None:
    """NaN in every floating parameter, buffer and partial-block accumulator; a huge count in integer buffers."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.fill_(NAN) if t.is_floating_point() else t.fill_(10**14)
        for m in module.modules():
            for name in ("_acc_s1", "_acc_s2"):
                acc = m.__dict__.get(name)
                if acc is not None:
                    acc.fill_(NAN)


def _whitening_state(module: nn.Module) -> dict:
    """Every entry of the state dict but the parameters (the whitening buffers and the packed extra state)."""
    params = {n for n, _ in module.named_parameters()}
    return {k: v for k, v in module.state_dict().items() if k not in params and not k.endswith(".original")}


@pytest.mark.parametrize("name,factory", _layers(), ids=[n for n, _ in _layers()])
def test_meta_to_empty_reset_parameters_gives_a_fresh_layer(name, factory):
    with torch.device("meta"):
        layer = factory("meta")
    layer.to_empty(device="cpu")
    _fill_garbage(layer)
    layer.reset_parameters()
    fresh = factory("cpu")
    got, want = _whitening_state(layer), _whitening_state(fresh)
    assert got.keys() == want.keys()
    for key in want:  # a reset writes exact values (zeros, identities): nothing to round
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{name}: {key}")
    assert all(torch.isfinite(p).all() for p in layer.parameters()), "the conv's own reset_parameters ran"
    x = torch.randn((4, 4 if "groups" in name else 2 if "patches" in name else 3)
                    + {"Linear": (), "Conv1d": (5,), "Conv3d": (2, 3, 3)}.get(name.split("Whiten")[-1], (5, 5)))
    if name.startswith("DirectWhiten"):
        x = x.flatten(2) if x.dim() > 2 else x
    for _ in range(2):
        layer(x)
    assert int(layer.num_blocks) == 1 and torch.isfinite(layer.whitening_matrix).all()


def test_reset_running_stats_resets_counters_and_the_partial_block():
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=3)
    x = torch.randn(4, 3, 6, 6) + 2
    for _ in range(4):
        layer(x)
    layer.transform_failures = 3
    assert layer.batches_in_block == 1 and int(layer.num_blocks) == 1
    layer.reset_running_stats()
    fresh = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=3)
    for key, value in _whitening_state(fresh).items():
        torch.testing.assert_close(_whitening_state(layer)[key], value, rtol=0, atol=0, msg=key)
    assert layer.batches_in_block == 0 and layer.transform_failures == 0


def test_reset_running_stats_keep_function():
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=1, bias=False)
    x = torch.randn(4, 3, 6, 6) + 4
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):  # the weight changes between folds: c no longer equals sum_k W_k mu
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    layer.eval()
    y = layer(x)
    layer.reset_running_stats(keep_function=True)
    assert int(layer.num_blocks) == 0 and not layer.running_mean.any()
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-5)
    layer.reset_running_stats()
    assert not layer.bias_correction.any()
    torch.testing.assert_close(layer(x), layer.to_conv()(x))  # a fresh layer computes the plain conv


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("order", ["convert-then-materialise", "materialise-then-convert"])
def test_meta_device_model_init(method, order):
    """The large-model recipe: build on meta, to_empty, reset_parameters() on every module that has one."""
    def build():
        return wl.models.cifar_resnet(8, width=4)

    torch.manual_seed(0)
    fresh = wl.convert_model(build(), method)
    with torch.device("meta"):
        model = build()
    if order == "convert-then-materialise":
        model = wl.convert_model(model, method)
        model.to_empty(device="cpu")
    else:
        model.to_empty(device="cpu")
        model = wl.convert_model(model, method)
    _fill_garbage(model)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    got, want = _whitening_state(model), _whitening_state(fresh)
    assert got.keys() == want.keys()
    for key in want:
        if "running_var" in key or "running_mean" in key and "bn" in key or "num_batches_tracked" in key:
            continue  # BatchNorm's own state, reset by BatchNorm
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    x = torch.randn(4, 3, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(10):
        opt.zero_grad()
        model(x).logsumexp(1).mean().backward()
        opt.step()
    layer = wl.whitening_layers(model)[0][1]
    assert int(layer.num_blocks) == 1
    assert all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())
    assert torch.isfinite(model.eval()(x)).all()


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                  lambda m: m.to("cpu", torch.bfloat16)], ids=["to-bf16", "half", "to-cpu-bf16"])
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_low_precision_cast_keeps_whitening_state_float32(method, cast):
    model = cast(wl.convert_model(wl.models.cifar_resnet(8, width=4), method))
    low = next(model.parameters()).dtype
    assert low in (torch.bfloat16, torch.float16)
    for _, layer in wl.whitening_layers(model):
        for name, buf in layer.named_buffers():
            if buf.is_floating_point():
                assert buf.dtype == torch.float32, (name, buf.dtype)
        assert layer._block.s1.dtype == torch.float32  # the block's sums stay float32 too (not bf16)
    for name, module in model.named_modules():  # everything else is cast as PyTorch casts it
        if isinstance(module, nn.BatchNorm2d):
            assert module.running_mean.dtype == low, name
    float64 = wl.convert_model(wl.models.cifar_resnet(8, width=4), method).double()
    layer = wl.whitening_layers(float64)[0][1]
    assert layer.running_cov.dtype == torch.float64  # float32 <-> float64 casts as before


@pytest.mark.parametrize("method,cls", [("grad", wl.GradWhitenConv2d), ("recursive", wl.RecursiveWhitenConv2d)],
                         ids=["grad", "recursive"])
def test_bf16_model_trains_with_float32_accurate_whitening_state(method, cls):
    """100 steps of a bf16-cast converted ResNet; one layer's state checked against a float64 twin on its inputs.

    The twin (a float64 layer) sees the very bf16 activations the layer sees (bf16 -> float64 is exact), so the
    two differ only by the precision the state is kept in. Kept in float32: within float32 rounding of the
    statistics (1e-4 here); a bf16 state (8 bits of mantissa) would be off by about 1e-2, which the check shows.
    """
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=8), method, block_size=10).to(torch.bfloat16)
    name, layer = wl.whitening_layers(model)[2]
    twin = cls(layer.in_channels, layer.out_channels, 3, padding=1, bias=False, block_size=10,
                               dtype=torch.float64)
    twin_inputs = []
    handle = layer.register_forward_pre_hook(lambda m, args: twin_inputs.append(args[0].detach().double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    data = torch.randn(20, 16, 3, 8, 8).to(torch.bfloat16)
    labels = torch.randint(0, 10, (20, 16))
    for step in range(100):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data[step % 20]).float(), labels[step % 20])
        loss.backward()
        opt.step()
        twin(twin_inputs.pop())
    handle.remove()
    assert torch.isfinite(loss) and int(layer.num_blocks) == 10 == int(twin.num_blocks)
    assert layer.running_cov.dtype == layer.whitening_matrix.dtype == layer.grad_transform.dtype == torch.float32

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    cov_err = rel(layer.running_cov, twin.running_cov)
    t_err, q_err = rel(layer.whitening_matrix, twin.whitening_matrix), rel(layer.grad_transform, twin.grad_transform)
    assert cov_err < 1e-5 and t_err < 1e-4 and q_err < 1e-4, (cov_err, t_err, q_err)
    bf16_err = rel(twin.running_cov.to(torch.bfloat16), twin.running_cov)  # what a bf16 state would hold
    assert bf16_err > 10 * 1e-4, bf16_err


# ------------------------------------------------------------------ checkpoints of another method
def _model(method):
    torch.manual_seed(0)
    return wl.convert_model(wl.models.cifar_resnet(8, width=4), method)


@pytest.mark.parametrize("saved,loaded", [("grad", "recursive"), ("recursive", "grad"), ("grad", "direct"),
                                          ("direct", "recursive")])
def test_strict_load_across_methods_names_both(saved, loaded):
    """The warning names the cause and the fix; the strict load fails on the other method's keys (torch tells a
    layer no caller's ``strict``: layers/checkpoint.py ``_report_cause``)."""
    state = _model(saved).state_dict()
    model = _model(loaded)
    with pytest.warns(UserWarning) as record:
        with pytest.raises(RuntimeError, match="(Missing|Unexpected) key\\(s\\) in state_dict"):
            model.load_state_dict(state)
    said = [str(w.message) for w in record]
    # one warning for each converted layer, each naming its place, both methods and the fix
    assert len(said) == len(wl.whitening_layers(model)), said
    assert all(re.search(f"holds a '{saved}' whitening layer at '[\\w.]+'.*is '{loaded}'.*method='{saved}'", m)
               for m in said), said
    assert any("at 'layer1.0.conv1', but" in m for m in said), said


@pytest.mark.parametrize("saved,loaded", [("grad", "recursive"), ("recursive", "grad"), ("direct", "grad")])
def test_non_strict_load_across_methods_warns(saved, loaded):
    state = _model(saved).state_dict()
    model = _model(loaded)
    with pytest.warns(UserWarning, match=f"holds a '{saved}' whitening layer.*strict=False"):
        model.load_state_dict(state, strict=False)


def test_plain_checkpoint_into_converted_model_points_to_load_plain_state_dict():
    torch.manual_seed(0)
    plain = wl.models.cifar_resnet(8, width=4)
    model = _model("grad")
    with pytest.warns(UserWarning, match="plain \\(unconverted\\) layer.*load_plain_state_dict"):
        with pytest.raises(RuntimeError, match="Missing key\\(s\\) in state_dict"):
            model.load_state_dict(plain.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the translation of load_plain_state_dict warns about nothing
        wl.load_plain_state_dict(model, plain.state_dict())


def test_same_method_load_is_silent():
    state = _model("recursive").state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _model("recursive").load_state_dict(state)
        _model("recursive").load_state_dict(state, strict=False)
