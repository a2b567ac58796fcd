"""Edges of real use (issue 34): BatchNorm subclasses with a forward of their own (timm's BatchNormAct2d),
``inference_mode``, converting on the meta device, parametrized convolutions."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import whitenlayers as wl
import stand_ins as testing


# ------------------------------------------------------------------ BatchNorm subclasses
def _train(model, steps=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=gen) * 2 + 1
        opt.zero_grad()
        model(x).logsumexp(1).mean().backward()
        opt.step()
    return model


def test_timm_batchnormact_absorbs_the_centring_and_trains_like_the_centred_layers():
    torch.manual_seed(0)
    plain = testing.timm_mobilenet_like()
    absorbed = wl.convert_model(copy.deepcopy(plain), "grad", targets="all", block_size=2)
    centred = wl.convert_model(copy.deepcopy(plain), "grad", targets="all", block_size=2, absorb_centring=False)
    layers = wl.whitening_layers(absorbed)
    assert len(layers) == 6 and all(layer.centring == "absorbed" for _, layer in layers)
    _train(absorbed)
    _train(centred)
    for (name, a), (_, c) in zip(absorbed.named_parameters(), centred.named_parameters()):
        # the same training up to rounding: float32, 6 steps of SGD with momentum on O(1) weights
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5, msg=name)
    x = torch.randn(4, 3, 16, 16)
    absorbed.eval()
    exported = wl.to_plain_model(copy.deepcopy(absorbed))  # no layer is left unexportable
    torch.testing.assert_close(exported(x), absorbed(x), rtol=1e-5, atol=1e-5)
    assert set(wl.plain_state_dict(absorbed)) == set(plain.state_dict())


class _BatchNormUsingRunningStats(nn.BatchNorm2d):
    """A BatchNorm2d subclass whose forward normalises with its running statistics even in training mode: it does
    not remove the batch mean, so it must not absorb a layer's centring."""

    def forward(self, x):
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                        self.eps)


class _BatchNormWithDropout(testing.BatchNormAct2d):
    def __init__(self, num_features):
        super().__init__(num_features, drop=0.5)


@pytest.mark.parametrize("bn_class", [_BatchNormUsingRunningStats, _BatchNormWithDropout])
def test_batchnorm_subclass_that_fails_the_probe_is_left_centred(bn_class):
    model = nn.Sequential(testing.Bottleneck(8, 2))
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is nn.BatchNorm2d:
                setattr(parent, name, bn_class(child.num_features))
    converted = wl.convert_model(model, "grad")
    assert wl.whitening_layers(converted)
    assert all(layer.centring == "input" for _, layer in wl.whitening_layers(converted))


def test_batchnormact_on_the_meta_device_is_probed_on_a_copy():
    with torch.device("meta"):
        model = testing.timm_mobilenet_like()
    converted = wl.convert_model(model, "grad", targets="all")
    layers = wl.whitening_layers(converted)
    assert len(layers) == 6 and all(layer.centring == "absorbed" for _, layer in layers)


# ------------------------------------------------------------------ inference_mode and no_grad
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_training_forward_under_inference_mode_gathers_nothing(method):
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4), method, block_size=2)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    with torch.inference_mode():
        model.train()
        model(x)
        model(x)  # would end a block
    layer = wl.whitening_layers(model)[0][1]
    assert int(layer.num_blocks) == 0 and layer.batches_in_block == 0
    for key, value in model.state_dict().items():
        if "bn" not in key and "downsample.1" not in key:  # BatchNorm updates its running statistics, as always
            assert not value.is_inference(), key
            torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    model(x).sum().backward()  # the next training step works (it used to raise on inference tensors)
    model(x).sum().backward()
    assert int(layer.num_blocks) == 1
    assert not any(t.is_inference() for t in model.state_dict().values())


def test_absorbed_offset_follows_batchnorm_under_inference_mode():
    """The BatchNorm updates its running mean under inference_mode: the absorbed offset follows (in place), so the
    eval output stays the centred model's."""
    torch.manual_seed(0)
    plain = wl.models.cifar_resnet(8, width=4)
    absorbed = wl.convert_model(copy.deepcopy(plain), "grad", block_size=50)
    centred = wl.convert_model(copy.deepcopy(plain), "grad", block_size=50, absorb_centring=False)
    x = torch.randn(8, 3, 8, 8) + 1
    for model in (absorbed, centred):
        _train_steps = [model(x).sum().backward() for _ in range(2)]
        del _train_steps
        with torch.inference_mode():
            model(x)
    assert not any(t.is_inference() for t in absorbed.state_dict().values())
    torch.testing.assert_close(absorbed.eval()(x), centred.eval()(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_training_forward_under_no_grad_gathers_as_usual(method):
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4), method, block_size=2)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        model(x)
        model(x)  # a block ends here and folds (BatchNorm, too, updates its statistics under no_grad)
    layer = wl.whitening_layers(model)[0][1]
    assert int(layer.num_blocks) == 1
    model(x).sum().backward()


# ------------------------------------------------------------------ converting on meta
def test_convert_on_meta_then_materialise_trains():
    with torch.device("meta"):
        model = wl.models.cifar_resnet(8, width=4)
    model = wl.convert_model(model, "grad", block_size=2)
    layer = wl.whitening_layers(model)[0][1]
    assert layer._block.s1.is_meta
    model.to_empty(device="cpu")
    assert layer._block.s1.device.type == "cpu" and layer._block.s1.dtype == torch.float32  # moved with the layer
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert int(layer.num_blocks) == 0 and not layer.running_mean.any()
    x = torch.randn(4, 3, 8, 8)
    for _ in range(2):
        model(x).sum().backward()
    assert int(layer.num_blocks) == 1 and torch.isfinite(model.eval()(x)).all()


def _trained_blocks(model, blocks=3, block_size=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    for _ in range(blocks * block_size):
        x = torch.randn(4, 3, 8, 8, generator=gen) * 2 + 1
        opt.zero_grad()
        model(x).logsumexp(1).mean().backward()
        opt.step()
    return model


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_built_on_meta_and_loaded_with_assign_trains_and_saves_as_built_on_the_cpu(method):
    """The low-memory loading pattern: build on the meta device, ``load_state_dict(sd, assign=True)``, train 3
    blocks, save, load into a fresh model: every tensor equal to the same run built on the CPU, none left on meta."""
    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return wl.convert_model(wl.models.cifar_resnet(8, width=4), method, block_size=2)

    start = build("cpu").state_dict()
    cpu = build("cpu")
    cpu.load_state_dict(start)
    meta = build("meta")
    meta.load_state_dict(start, assign=True)
    _trained_blocks(cpu), _trained_blocks(meta)
    saved = meta.state_dict()
    assert not [k for k, v in saved.items() if v.is_meta]
    fresh = build("cpu")
    fresh.load_state_dict(saved)
    for a, b in ((cpu.state_dict(), saved), (cpu.state_dict(), fresh.state_dict())):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_a_forward_on_meta_state_names_the_layer_and_the_fix():
    with torch.device("meta"):
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4), "grad")
    with pytest.raises(RuntimeError, match=r"layer1.0.conv1.*meta device.*assign=True.*to_empty"):
        model(torch.randn(2, 3, 8, 8, device="meta"))


# ------------------------------------------------------------------ parametrized convolutions
class _Counting(nn.Module):
    """An identity parametrization that counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, w):
        self.calls += 1
        return w * 1.0


def _select_all(name, module):
    return isinstance(module, (nn.Conv2d, nn.Linear))


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "counting"])
def test_parametrized_conv_converts_sharing_parametrizations(kind, method):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    if kind == "weight_norm":
        parametrizations.weight_norm(conv)
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(conv)
    else:
        parametrize.register_parametrization(conv, "weight", _Counting())
    reference = copy.deepcopy(conv)
    originals = list(conv.parametrizations.weight.parameters())
    model = wl.convert_model(nn.Sequential(conv), method, predicate=_select_all, block_size=2)
    new = model[0]
    layer = new if method != "direct" else new.layer
    assert parametrize.is_parametrized(layer, "weight")
    assert all(a is b for a, b in zip(layer.parametrizations.weight.parameters(), originals))  # shared Parameters
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)  # one training forward each
    if kind == "spectral_norm":  # one power iteration per forward, as the plain layer does
        torch.testing.assert_close(layer.parametrizations.weight[0]._u, reference.parametrizations.weight[0]._u)
    if kind == "counting":
        counter = layer.parametrizations.weight[0]
        counter.calls = 0
        model(x).sum().backward()
        assert counter.calls == 1
    model(x).sum().backward()
    assert all(p.grad is not None for p in originals)
    if method != "direct":
        assert int(new.num_blocks) >= 1


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")  # on purpose
def test_hook_based_weight_norm_is_left_out_with_a_reason():
    conv = torch.nn.utils.weight_norm(nn.Conv2d(4, 6, 3, padding=1))
    with pytest.warns(UserWarning, match="forward pre-hook.*apply it after convert_model.*parametrizations"):
        wl.convert_model(nn.Sequential(conv), "grad", predicate=_select_all)


def test_parametrization_applied_after_conversion_computes_the_weight_once():
    model = wl.convert_model(nn.Sequential(nn.Conv2d(4, 6, 3, padding=1)), "grad", predicate=_select_all)
    counter = _Counting()
    parametrize.register_parametrization(model[0], "weight", counter)
    counter.calls = 0
    model(torch.randn(2, 4, 5, 5)).sum().backward()
    assert counter.calls == 1


class _SamePadConv(nn.Conv2d):
    """timm's ``Conv2dSame``: pads by a rule on the input's shape, which ``torch.fx`` cannot trace."""

    def forward(self, x):
        if x.shape[-1] % 2 == 1:
            x = nn.functional.pad(x, (0, 1, 0, 1))
        return super().forward(x)


class _BlockWithSamePadConv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv_pw = nn.Conv2d(c, 2 * c, 1, bias=False)
        self.bn1 = testing.BatchNormAct2d(2 * c)
        self.conv_dw = _SamePadConv(2 * c, 2 * c, 3, stride=2, groups=2 * c, bias=False)  # not converted
        self.bn2 = testing.BatchNormAct2d(2 * c)
        self.conv_pwl = nn.Conv2d(2 * c, c, 1, bias=False)
        self.bn3 = testing.BatchNormAct2d(c, apply_act=False)

    def forward(self, x):
        return self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))


def test_an_untraceable_module_outside_the_targets_does_not_stop_absorption():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _BlockWithSamePadConv(4))
    converted = wl.convert_model(model, "grad", predicate=lambda name, m: type(m) is nn.Conv2d and name != "0")
    layers = dict(wl.whitening_layers(converted))
    assert set(layers) == {"1.conv_pw", "1.conv_pwl"}
    assert all(layer.centring == "absorbed" for layer in layers.values())
    wl.plain_state_dict(converted.eval())  # exportable: no bias-free layer left centring its input
