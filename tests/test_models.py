"""CIFAR ResNets (He et al. 2016, option-A shortcuts) and the torchvision ResNet-50 entry point."""
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import whitenlayers as wl
from whitenlayers import models
from whitenlayers.models import BasicBlock, ShortcutA


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


def _convs_in_blocks(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and ".conv" in n and n.startswith("layer")]


@pytest.mark.parametrize("depth", [20, 32, 44, 56, 110])
def test_depth_counts_weighted_layers(depth):
    model = models.cifar_resnet(depth, width=4)
    n = (depth - 2) // 6
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(blocks) == 3 * n
    assert len(convs) + len(linears) == depth  # 6n convs in blocks + stem conv + fc
    assert len(_convs_in_blocks(model)) == 6 * n
    assert len([s for s in model.modules() if isinstance(s, ShortcutA)]) == 2  # one per stage change


@pytest.mark.parametrize(
    "fn, millions", [(models.resnet20, 0.27), (models.resnet32, 0.46), (models.resnet44, 0.66),
                     (models.resnet56, 0.85), (models.resnet110, 1.7)]
)
def test_parameter_counts_match_he_et_al_table6(fn, millions):
    model = fn(num_classes=10)
    count = sum(p.numel() for p in model.parameters())
    digits = 1 if millions >= 1 else 2
    assert round(count / 1e6, digits) == millions


def test_shortcuts_are_parameter_free_option_a():
    model = models.resnet20()
    shortcut = model.layer2[0].shortcut
    assert isinstance(shortcut, ShortcutA) and not list(shortcut.parameters())
    assert isinstance(model.layer1[0].shortcut, nn.Identity)
    x = torch.randn(2, 16, 8, 8)
    y = shortcut(x)
    assert y.shape == (2, 32, 4, 4)
    torch.testing.assert_close(y[:, :16], x[:, :, ::2, ::2], rtol=0, atol=0)
    assert torch.count_nonzero(y[:, 16:]) == 0
    with pytest.raises(ValueError, match="in_channels"):
        ShortcutA(8, 4, 1)


@pytest.mark.parametrize("in_channels, size", [(3, 32), (1, 28)])
def test_forward_shapes_and_feature_maps(in_channels, size):
    torch.manual_seed(0)
    model = models.resnet20(num_classes=7, in_channels=in_channels, width=4)
    seen = {}
    for name in ("layer1", "layer2", "layer3"):
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, tuple(o.shape)))
    out = model(torch.randn(2, in_channels, size, size))
    assert out.shape == (2, 7)
    half, quarter = math.ceil(size / 2), math.ceil(math.ceil(size / 2) / 2)
    assert seen == {"layer1": (2, 4, size, size), "layer2": (2, 8, half, half), "layer3": (2, 16, quarter, quarter)}


def test_kaiming_init_and_bn_init():
    torch.manual_seed(0)
    model = models.resnet20()
    w = model.layer3[1].conv2.weight.detach()  # 64 x 64 x 3 x 3
    expected = math.sqrt(2.0 / (64 * 9))  # fan-out, ReLU gain
    assert abs(float(w.std()) / expected - 1) < 0.03
    assert abs(float(w.mean())) < 0.05 * expected
    bn = model.layer3[1].bn2
    assert torch.equal(bn.weight, torch.ones(64)) and torch.equal(bn.bias, torch.zeros(64))
    z = models.resnet20(zero_init_residual=True)
    assert torch.count_nonzero(z.layer1[0].bn2.weight) == 0


def test_trains_one_step():
    torch.manual_seed(0)
    model = models.cifar_resnet(8, width=4, num_classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 3, (8,))
    loss0 = nn.functional.cross_entropy(model(x), y)
    loss0.backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    assert nn.functional.cross_entropy(model(x), y) < loss0


@given(st.integers(min_value=-20, max_value=130))
@settings(max_examples=40, deadline=None)
def test_depth_validation(depth):
    if depth >= 8 and (depth - 2) % 6 == 0:
        assert isinstance(models.cifar_resnet(depth, width=1), models.CifarResNet)
    else:
        with pytest.raises(ValueError, match="depth"):
            models.cifar_resnet(depth)


@pytest.mark.parametrize("bad", [20.0, "20", True, None])
def test_depth_must_be_an_integer(bad):
    with pytest.raises(ValueError, match="depth"):
        models.cifar_resnet(bad)


@pytest.mark.parametrize("arg", ["num_classes", "in_channels", "width"])
def test_other_arguments_validated(arg):
    with pytest.raises(ValueError, match=arg):
        models.cifar_resnet(20, **{arg: 0})


def test_convenience_constructors_pass_keywords():
    model = models.resnet32(num_classes=5, in_channels=1, width=2)
    assert model.conv1.in_channels == 1 and model.conv1.out_channels == 2 and model.fc.out_features == 5
    assert len(_convs_in_blocks(model)) == 30
    assert wl.models is models


def test_resnet50_without_torchvision_raises_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    with pytest.raises(ImportError, match="torchvision"):
        models.resnet50()


def test_resnet50_with_torchvision_converts_52_layers():
    pytest.importorskip("torchvision")
    model = models.resnet50(num_classes=10, in_channels=1)
    assert model.conv1.in_channels == 1 and model.fc.out_features == 10
    wl.convert_model(model)
    assert len(wl.whitening_layers(model)) == 52
