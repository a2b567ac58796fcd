"""Model surgery: convert_model, to_plain_model, checkpoint helpers, whitening_layers."""
import copy
import io
import pickle
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import whitenlayers as wl
from whitenlayers import models
from whitenlayers.convert import DirectWhitenWrapper, target_layers
from whitenlayers.coordinator import FoldCoordinator

METHODS = ["grad", "recursive", "direct"]


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


# --------------------------------------------------------------------------
# A structural stand-in for torchvision's ResNet-50 (no torchvision needed)
# --------------------------------------------------------------------------
class Bottleneck(nn.Module):
    """torchvision's Bottleneck layout: conv1 (1x1), conv2 (3x3, stride), conv3 (1x1), optional downsample."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNetStandIn(nn.Module):
    """torchvision.models.resnet50's structure (layers [3, 4, 6, 3]) at a small width."""

    def __init__(self, layers=(3, 4, 6, 3), width=4, num_classes=10):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def small_resnet(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("width", 4)
    return models.cifar_resnet(8, **kw)


def block_conv_names(model):
    return {n for n, m in model.named_modules() if type(m) is nn.Conv2d and n.startswith("layer")}


def coordinator_hooks(module):
    return [h for h in module._forward_hooks.values() if isinstance(h, FoldCoordinator)]


def train_steps(model, steps, *, seed=1, lr=0.05, size=16, channels=3, num_classes=10):
    """A few SGD steps on correlated data; returns the data used."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        base = torch.randn(8, 1, size, size, generator=g, dtype=dtype)
        x = base + 0.3 * torch.randn(8, channels, size, size, generator=g, dtype=dtype) + 2.0
        y = torch.randint(0, num_classes, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# --------------------------------------------------------------------------
# Counts and targets
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_resnet110_gets_108_whitening_layers(method):
    model = models.resnet110(width=2)
    expected = block_conv_names(model)
    assert len(expected) == 108
    wl.convert_model(model, method=method)
    layers = wl.whitening_layers(model)
    assert len(layers) == 108
    if method == "direct":
        assert {n[: -len(".whiten")] for n, _ in layers} == expected
        assert all(isinstance(m, wl.DirectWhiten) for _, m in layers)
    else:
        cls = wl.GradWhitenConv2d if method == "grad" else wl.RecursiveWhitenConv2d
        assert {n for n, _ in layers} == expected
        assert all(type(m) is cls for _, m in layers)
    assert type(model.conv1) is nn.Conv2d and type(model.fc) is nn.Linear  # stem and classifier untouched


@pytest.mark.parametrize("method", METHODS)
def test_resnet50_standin_gets_52_whitening_layers(method):
    model = ResNetStandIn(width=1)
    wl.convert_model(model, method=method)
    layers = wl.whitening_layers(model)
    assert len(layers) == 52
    down = [n for n, _ in layers if ".downsample." in n]
    assert len(down) == 4  # the first block of each stage
    assert type(model.conv1) is nn.Conv2d and type(model.fc) is nn.Linear
    assert len(coordinator_hooks(model)) == 1


def test_target_layers_matches_conversion():
    model = ResNetStandIn(width=1)
    names = [n for n, _ in target_layers(model)]
    wl.convert_model(model)
    assert names == [n for n, _ in wl.whitening_layers(model)]
    assert target_layers(model) == []


def test_layer_names_are_qualified_names():
    model = wl.convert_model(small_resnet(), method="grad")
    for name, layer in wl.whitening_layers(model):
        assert layer.layer_name == name
    with pytest.raises(ValueError, match="'layer2.0.conv1'"):
        model.layer2[0].conv1(torch.randn(1, 3, 8, 8))  # wrong channel count names the layer
    direct = wl.convert_model(small_resnet(), method="direct")
    assert direct.layer1[0].conv1.whiten.layer_name == "layer1.0.conv1.whiten"


def test_custom_predicate():
    model = small_resnet()
    wl.convert_model(model, predicate=lambda name, m: name == "conv1" or name.startswith("layer3"))
    names = {n for n, _ in wl.whitening_layers(model)}
    assert names == {"conv1", "layer3.0.conv1", "layer3.0.conv2"}


def test_block_types_by_class_and_by_name():
    class MyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 3, 3, padding=1)
            self.b = nn.Sequential(nn.Conv2d(3, 3, 1))

        def forward(self, x):
            return self.b[0](self.a(x))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 3, 1), MyBlock(), models.BasicBlock(3, 3))

    with pytest.warns(UserWarning, match="no layer to convert"):
        wl.convert_model(nn.Sequential(MyBlock()), block_types="Bottleneck")
    for spec in (MyBlock, "MyBlock", (MyBlock,), ["MyBlock"]):
        model = wl.convert_model(make(), block_types=spec)
        assert {n for n, _ in wl.whitening_layers(model)} == {"1.a", "1.b.0"}
    model = wl.convert_model(make(), block_types=(MyBlock, "BasicBlock"))
    assert {n for n, _ in wl.whitening_layers(model)} == {"1.a", "1.b.0", "2.conv1", "2.conv2"}

    class SubBlock(models.BasicBlock):  # a subclass of a recognised block class counts
        pass

    model = wl.convert_model(nn.Sequential(SubBlock(3, 3)))
    assert len(wl.whitening_layers(model)) == 2
    with pytest.raises(ValueError, match="predicate or block_types"):
        wl.convert_model(make(), predicate=lambda n, m: True, block_types=MyBlock)
    with pytest.raises(TypeError, match="block_types"):
        wl.convert_model(make(), block_types=(3,))


def test_grouped_and_subclassed_convs():
    class StdConv2d(nn.Conv2d):
        def forward(self, x):
            w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
            return self._conv_forward(x, w, self.bias)

    class Bottleneck(nn.Module):
        def __init__(self):
            super().__init__()
            self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
            self.std = StdConv2d(4, 4, 1)
            self.plain = nn.Conv2d(4, 4, 1)

    with pytest.warns(UserWarning, match=r"left out 1 layer.*'std' \(StdConv2d: a subclass of nn.Conv2d"):
        model = wl.convert_model(Bottleneck())
    assert [n for n, _ in wl.whitening_layers(model)] == ["grouped", "plain"]  # grouped convs whiten per group
    assert type(model.std) is StdConv2d and model.grouped.groups == 2
    assert tuple(model.grouped.grad_transform.shape) == (2, 2, 2)
    # a predicate may select a subclass
    model = wl.convert_model(Bottleneck(), predicate=lambda n, m: True)
    assert sorted(n for n, _ in wl.whitening_layers(model)) == ["grouped", "plain", "std"]


@pytest.mark.parametrize("method", METHODS)
def test_include_linear(method):
    model = small_resnet()
    plain = copy.deepcopy(model)
    wl.convert_model(model, method=method, include_linear=True)
    names = {n for n, _ in wl.whitening_layers(model)}
    fc_name = "fc.whiten" if method == "direct" else "fc"
    assert fc_name in names and len(names) == 7
    if method != "direct":
        assert isinstance(model.fc, wl.GradWhitenLinear)
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(model.eval()(x), plain.eval()(x))
    # a predicate sees linear layers only with include_linear
    with pytest.warns(UserWarning, match="no layer to convert"):
        m2 = wl.convert_model(small_resnet(), method=method, predicate=lambda n, m: n == "fc")
    assert wl.whitening_layers(m2) == [] and type(m2.fc) is nn.Linear


# --------------------------------------------------------------------------
# What is kept
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_parameters_are_shared_and_an_old_optimizer_keeps_working(method):
    model = small_resnet()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old_conv = model.layer1[0].conv1
    wl.convert_model(model, method=method, block_size=1)
    assert len(list(model.parameters())) == len(params)
    assert all(a is b for a, b in zip(model.parameters(), params))
    new_conv = model.layer1[0].conv1
    target = new_conv.layer if method == "direct" else new_conv
    if method == "direct":
        assert target is old_conv
    else:
        assert target is not old_conv and target.weight is old_conv.weight
    assert any(p is target.weight for p in opt.param_groups[0]["params"])
    before = target.weight.detach().clone()
    x = torch.randn(8, 3, 16, 16) + 1.0
    model(x).square().mean().backward()
    assert target.weight.grad is not None
    opt.step()
    assert not torch.equal(target.weight.detach(), before)
    assert int(wl.whitening_layers(model)[0][1].num_blocks) == 1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_same_function_right_after_conversion(method, mode):
    for make in (lambda: small_resnet(seed=3), lambda: ResNetStandIn(width=2)):
        model = make()
        getattr(model, mode)()
        plain = copy.deepcopy(model)
        wl.convert_model(model, method=method, include_linear=True, block_size=1)
        x = torch.randn(4, 3, 32, 32) * 2 + 1
        torch.testing.assert_close(model(x), plain(x))
        if mode == "train":  # the first block folded after the forward, statistics were gathered
            assert all(int(m.num_blocks) == 1 for _, m in wl.whitening_layers(model))
        else:
            assert all(int(m.num_blocks) == 0 for _, m in wl.whitening_layers(model))


@pytest.mark.parametrize("method", METHODS)
def test_device_dtype_training_and_requires_grad_kept(method):
    model = small_resnet().double()
    model.layer1[0].conv1.weight.requires_grad_(False)
    model.layer2.eval()
    wl.convert_model(model, method=method)
    for name, m in model.named_modules():
        if isinstance(m, wl.DirectWhiten):
            m = dict(model.named_modules())[name[: -len(".whiten")]]
        elif not isinstance(m, wl.WhiteningLayer):
            continue
        assert m.training == (not name.startswith("layer2"))
        for layer in ([m.whiten, m.layer] if isinstance(m, DirectWhitenWrapper) else [m]):
            assert layer.training == m.training
        conv = m.layer if isinstance(m, DirectWhitenWrapper) else m
        assert conv.weight.dtype == torch.float64 and conv.weight.device == torch.device("cpu")
        assert conv.weight.requires_grad == (not name.startswith("layer1.0.conv1"))
        stats = m.whiten if isinstance(m, DirectWhitenWrapper) else m
        assert stats.running_cov.dtype == torch.float64 and stats.whitening_matrix.device == conv.weight.device
    assert model.training and model.layer1.training and not model.layer2.training


@pytest.mark.parametrize("method", METHODS)
def test_hooks_are_kept_and_removable(method):
    """Hooks registered before the conversion still fire, on the same input and output as before, and remove."""
    model = small_resnet()
    conv = model.layer1[0].conv1
    calls = []
    h1 = conv.register_forward_pre_hook(lambda m, args: calls.append(("pre", args[0].clone())))
    h2 = conv.register_forward_hook(lambda m, args, out: calls.append(("fwd", out.clone())))
    h3 = conv.register_full_backward_hook(lambda m, gi, go: calls.append(("bwd", go[0].clone())))
    wl.convert_model(model, method=method, block_size=1)
    train_steps(model, 2)  # folds: mu != 0 and, for direct, T != I
    if method == "direct":
        assert not torch.allclose(model.layer1[0].conv1.whiten.whitening_matrix, torch.eye(4))
    ref = {}
    model.layer1[0].register_forward_pre_hook(lambda m, args: ref.__setitem__("block_in", args[0].clone()))
    model.layer1[0].bn1.register_forward_pre_hook(lambda m, args: ref.__setitem__("conv_out", args[0].clone()))
    model.eval()
    calls.clear()
    model(torch.randn(2, 3, 16, 16) + 3).sum().backward()
    assert [c[0] for c in calls] == ["pre", "fwd", "bwd"]
    torch.testing.assert_close(calls[0][1], ref["block_in"], rtol=0, atol=0)
    torch.testing.assert_close(calls[1][1], ref["conv_out"], rtol=0, atol=0)
    for h in (h1, h2, h3):
        h.remove()
    calls.clear()
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert calls == []


def test_one_coordinator_folds_all_layers_after_the_forward():
    model = wl.convert_model(small_resnet(), block_size=1)
    coords = coordinator_hooks(model)
    assert len(coords) == 1
    layers = [m for _, m in wl.whitening_layers(model)]
    assert all(layer._fold_coordinator is coords[0] for layer in layers)
    during = []
    model.layer3.register_forward_hook(lambda *a: during.append(int(layers[0].num_blocks)))
    model(torch.randn(4, 3, 16, 16))
    assert during == [0]  # layer1's block ended but it waits for the model's forward to finish
    assert all(int(layer.num_blocks) == 1 for layer in layers)


@pytest.mark.parametrize("first, second", [("grad", "grad"), ("direct", "direct"), ("recursive", "recursive")])
def test_converting_twice_does_not_double_wrap(first, second):
    model = wl.convert_model(small_resnet(), method=first)
    layers = wl.whitening_layers(model)
    keys = list(model.state_dict().keys())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wl.convert_model(model, method=second) is model
    assert [(n, id(m)) for n, m in wl.whitening_layers(model)] == [(n, id(m)) for n, m in layers]
    assert list(model.state_dict().keys()) == keys
    assert len(coordinator_hooks(model)) == 1
    assert not any(isinstance(m.layer, (DirectWhitenWrapper, wl.WhiteningLayer))
                   for m in model.modules() if isinstance(m, DirectWhitenWrapper))


def test_partially_converted_model_gets_the_existing_coordinator():
    model = wl.convert_model(small_resnet(), predicate=lambda n, m: n.startswith("layer1"))
    coord = coordinator_hooks(model)[0]
    wl.convert_model(model)
    assert coordinator_hooks(model) == [coord]
    assert len(wl.whitening_layers(model)) == 6
    assert all(m._fold_coordinator is coord for _, m in wl.whitening_layers(model))


def test_shared_module_converted_once():
    conv = nn.Conv2d(3, 3, 3, padding=1)
    block = models.BasicBlock(3, 3)
    block.conv2 = conv
    model = nn.Sequential(block, nn.Sequential(models.BasicBlock(3, 3)))
    model[1][0].conv1 = conv
    wl.convert_model(model)
    assert model[0].conv2 is model[1][0].conv1
    assert isinstance(model[0].conv2, wl.GradWhitenConv2d)


def test_bare_conv_root():
    conv = nn.Conv2d(3, 4, 3)
    with pytest.warns(UserWarning, match="no layer"):
        assert wl.convert_model(conv) is conv
    plain = copy.deepcopy(conv)
    new = wl.convert_model(conv, method="recursive", predicate=lambda n, m: True, block_size=1)
    assert isinstance(new, wl.RecursiveWhitenConv2d) and new.weight is conv.weight
    assert new._fold_coordinator is None
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(new(x), plain(x))
    assert int(new.num_blocks) == 1  # folds on its own
    exported = wl.to_plain_model(new)
    assert type(exported) is nn.Conv2d
    torch.testing.assert_close(exported(x), new.eval()(x))


def test_bad_arguments_leave_the_model_untouched():
    model = small_resnet()
    keys = list(model.state_dict().keys())
    with pytest.raises(ValueError, match="method"):
        wl.convert_model(model, method="zca")
    with pytest.raises(TypeError, match="beta"):
        wl.convert_model(model, method="direct", beta=0.9)
    with pytest.raises(TypeError, match="gamma"):
        wl.convert_model(model, method="grad", gamma=0.9)
    with pytest.raises(ValueError, match="block_size"):
        wl.convert_model(model, block_size=0)
    assert list(model.state_dict().keys()) == keys and wl.whitening_layers(model) == []
    assert coordinator_hooks(model) == []
    wl.convert_model(model, method="recursive", gamma=0.9, delta=0.5)
    assert all(m.gamma == 0.9 and m.delta == 0.5 for _, m in wl.whitening_layers(model))


@pytest.mark.parametrize("method", METHODS)
def test_deepcopy_and_pickle_keep_folding(method):
    model = wl.convert_model(small_resnet(), method=method, block_size=1)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        coords = coordinator_hooks(clone)
        assert len(coords) == 1 and coords[0] is not coordinator_hooks(model)[0]
        assert all(m._fold_coordinator is coords[0] for _, m in wl.whitening_layers(clone))
        clone(torch.randn(4, 3, 16, 16))
        assert all(int(m.num_blocks) == 1 for _, m in wl.whitening_layers(clone))
    assert all(int(m.num_blocks) == 0 for _, m in wl.whitening_layers(model))


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_export_is_exact_after_training_with_folds(method):
    torch.manual_seed(0)
    model = ResNetStandIn(width=2).double()
    wl.convert_model(model, method=method, include_linear=True, block_size=1)
    train_steps(model, 3)
    layers = wl.whitening_layers(model)
    assert all(int(m.num_blocks) == 3 for _, m in layers)
    eye = torch.eye(layers[0][1].num_features, dtype=torch.float64)
    assert not torch.allclose(layers[0][1].whitening_matrix, eye)  # the whitening is not trivial
    assert any(float(m.running_mean.abs().max()) > 0.1 for _, m in layers)
    model.eval()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64) + 1
    want = model(x)
    exported = wl.to_plain_model(model)
    assert exported is model and wl.whitening_layers(model) == []
    assert not any(isinstance(m, DirectWhitenWrapper) for m in model.modules())
    assert all(type(m).__module__.startswith("torch.nn") or type(m) in (ResNetStandIn, Bottleneck)
               for m in model.modules())
    assert all(coordinator_hooks(m) == [] for m in model.modules())
    torch.testing.assert_close(model(x), want)
    if method == "direct":  # 1x1 convs merged; padded 3x3 convs keep a 1x1 whitening conv in front
        assert type(model.layer1[0].conv1) is nn.Conv2d and type(model.layer1[0].downsample[0]) is nn.Conv2d
        assert isinstance(model.layer1[0].conv2, nn.Sequential)
        assert model.layer1[0].conv2[0].kernel_size == (1, 1)
        assert type(model.fc) is nn.Linear
    else:
        assert all(type(m) is nn.Conv2d for n, m in model.named_modules() if n.endswith("conv2"))
    # the exported model trains as an ordinary model
    train_steps(model, 1)


@pytest.mark.parametrize("absorb", [False, True])
def test_export_float32_grad_model_is_bitwise_equal(absorb):
    """Centring layers export bit for bit; absorbed ones move their offset into the BatchNorm's running mean,
    which changes the rounding order (BN computes (z + s) - rm there, z - (rm - s) after the export)."""
    model = wl.convert_model(small_resnet(), block_size=1, absorb_centring=absorb)
    assert all(m.centring == ("absorbed" if absorb else "input") for _, m in wl.whitening_layers(model))
    train_steps(model, 2)
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    want = model(x)
    tol = dict(rtol=1e-5, atol=1e-6) if absorb else dict(rtol=0, atol=0)
    torch.testing.assert_close(wl.to_plain_model(model)(x), want, **tol)


def test_export_keeps_training_flag_and_hooks():
    model = wl.convert_model(small_resnet(), method="direct")
    model.layer1.eval()
    seen = []
    handle = model.layer1[0].conv1.register_forward_hook(lambda *a: seen.append(1))
    wl.to_plain_model(model)
    assert not model.layer1[0].conv1.training and model.layer2[0].conv1.training
    model(torch.randn(2, 3, 16, 16))
    assert seen == [1]
    handle.remove()
    model(torch.randn(2, 3, 16, 16))
    assert seen == [1]


@given(
    cin=st.integers(1, 5),
    cout=st.integers(1, 5),
    k=st.sampled_from([1, 2, 3]),
    stride=st.sampled_from([1, 2]),
    padding=st.sampled_from([0, 1, 2]),
    bias=st.booleans(),
    method=st.sampled_from(METHODS),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_convert_train_export_property(cin, cout, k, stride, padding, bias, method, seed):
    """For any conv geometry: same function at conversion, and the export equals the trained model."""
    torch.manual_seed(seed)

    class BasicBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, bias=bias)

        def forward(self, x):
            return self.conv(x)

    model = nn.Sequential(BasicBlock()).double()
    plain = copy.deepcopy(model)
    wl.convert_model(model, method=method, block_size=1, alpha=0.5)
    mix = torch.randn(cin, cin, dtype=torch.float64)
    data = [torch.einsum("ij,bjhw->bihw", mix, torch.randn(6, cin, 7, 7, dtype=torch.float64)) + 1.5
            for _ in range(3)]
    torch.testing.assert_close(model(data[0]), plain(data[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for x in data[1:]:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model.eval()
    want = model(data[0])
    torch.testing.assert_close(wl.to_plain_model(model)(data[0]), want)


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_plain_checkpoint_loads_into_converted_model(method):
    plain = small_resnet(seed=5)
    train_steps(plain, 1)  # BN statistics that differ from a fresh model
    plain.eval()
    model = wl.convert_model(small_resnet(seed=6), method=method, block_size=1)
    train_steps(model, 2)  # whitening state far from the identity
    result = wl.load_plain_state_dict(model, plain.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for _, layer in wl.whitening_layers(model):
        assert int(layer.num_blocks) == 0 and layer.batches_in_block == 0
        torch.testing.assert_close(layer.whitening_matrix, torch.eye(layer.num_features))
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(model(x), plain(x))
    # training resumes from the identity state
    model.train()
    model(x)
    assert all(int(m.num_blocks) == 1 for _, m in wl.whitening_layers(model))


def test_load_plain_state_dict_strict_errors_change_nothing():
    plain = small_resnet(seed=5)
    model = wl.convert_model(small_resnet(seed=6), method="direct", block_size=1)
    train_steps(model, 1)
    before = copy.deepcopy(model.state_dict())
    sd = plain.state_dict()
    bad = dict(sd)
    bad["layer1.0.conv1.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=re.escape("layer1.0.conv1.extra")):
        wl.load_plain_state_dict(model, bad)
    short = {k: v for k, v in sd.items() if k != "fc.bias"}
    with pytest.raises(RuntimeError, match="fc.bias"):
        wl.load_plain_state_dict(model, short)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor))
    result = wl.load_plain_state_dict(model, short, strict=False)
    assert result.missing_keys == ["fc.bias"]


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_plain_state_dict_round_trip_after_training(method, absorb):
    kw = dict(method=method, include_linear=True, absorb_centring=absorb)
    model = wl.convert_model(small_resnet(seed=7), block_size=1, **kw)
    train_steps(model, 3)
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    want = model(x)
    # keys: the plain architecture's, plus a bias for each bias-free whitening conv that centres its input (its
    # folded mean); with the centring absorbed by the BatchNorms (the default) exactly the plain keys
    plain_keys = set(small_resnet().state_dict())
    conv_names = {n for n, m in wl.whitening_layers(model) if m.bias is None and m.centring == "input"}
    assert bool(conv_names) != absorb
    if not absorb:  # the original architecture cannot hold these layers: strict (the default) says which
        with pytest.raises(ValueError, match=r"cannot hold the function of 6 converted layer\(s\): 'layer1.0.conv1'.*"
                                             r"bias-free layer that centres its input.*to_plain_model"):
            wl.plain_state_dict(model)
    sd = plain_sd = wl.plain_state_dict(model, strict=absorb)
    assert set(plain_sd) == plain_keys | {f"{n}.bias" for n in conv_names}
    assert not any("running_cov" in k or "whitening_matrix" in k or "absorbed" in k for k in plain_sd)
    torch.testing.assert_close(model(x), want)  # model itself unchanged
    assert len(wl.whitening_layers(model)) == 7
    # back into a converted model: exact, bias folded into bias_correction
    other = wl.convert_model(small_resnet(seed=8), **kw)
    wl.load_plain_state_dict(other, sd)
    torch.testing.assert_close(other.eval()(x), want)
    # into the exported architecture
    exported = wl.to_plain_model(wl.convert_model(small_resnet(seed=9), **kw))
    exported.load_state_dict(sd)
    torch.testing.assert_close(exported.eval()(x), want)
    if absorb:  # into the user's own, never converted architecture, strictly
        plain = small_resnet(seed=10)
        plain.load_state_dict(sd, strict=True)
        torch.testing.assert_close(plain.eval()(x), want)
    # a checkpoint file round trip works too
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    wl.load_plain_state_dict(other, torch.load(buf, weights_only=True))
    torch.testing.assert_close(other(x), want)


@pytest.mark.parametrize("method", METHODS)
def test_plain_state_dict_has_original_keys_for_layers_with_bias(method):
    """With biases (and unpadded direct convs) the plain checkpoint loads into the original architecture."""

    class BasicBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 4, 1, bias=True)
            self.conv2 = nn.Conv2d(4, 2, 2, stride=2, bias=True)

        def forward(self, x):
            return self.conv2(torch.relu(self.conv1(x)))

    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(BasicBlock(), nn.Flatten(), nn.Linear(8, 3))

    model = wl.convert_model(make(0), method=method, include_linear=True, block_size=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        x = torch.randn(16, 3, 4, 4) @ torch.randn(4, 4) + 1
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model.eval()
    x = torch.randn(5, 3, 4, 4)
    sd = wl.plain_state_dict(model)
    original = make(1)
    assert set(sd) == set(original.state_dict())
    original.load_state_dict(sd)
    torch.testing.assert_close(original(x), model(x))
    # and back into a converted model (direct: the weight W T goes to the layer, T resets to I)
    other = wl.convert_model(make(2), method=method, include_linear=True)
    wl.load_plain_state_dict(other, sd)
    torch.testing.assert_close(other.eval()(x), model(x))


def test_state_dict_keys_documented_for_direct():
    model = wl.convert_model(small_resnet(), method="direct")
    keys = set(model.state_dict())
    assert "layer1.0.conv1.layer.weight" in keys and "layer1.0.conv1.weight" not in keys
    assert {"layer1.0.conv1.whiten.running_mean", "layer1.0.conv1.whiten.whitening_matrix",
            "layer1.0.conv1.whiten.num_blocks", "layer1.0.conv1.whiten._extra_state"} <= keys
    grad = wl.convert_model(small_resnet(), method="grad")
    gkeys = set(grad.state_dict())
    assert {"layer1.0.conv1.weight", "layer1.0.conv1.grad_transform", "layer1.0.conv1.bias_correction"} <= gkeys
