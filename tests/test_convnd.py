"""Conv1d and Conv3d grad / recursive layers (issue 14): the Conv2d layers' contract in one and three dimensions."""
import copy

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn

import whitenlayers as wl
from whitenlayers import functional as F

DT = torch.float64
CASES = [
    (wl.GradWhitenConv1d, nn.Conv1d, Fn.conv1d, 1),
    (wl.RecursiveWhitenConv1d, nn.Conv1d, Fn.conv1d, 1),
    (wl.GradWhitenConv3d, nn.Conv3d, Fn.conv3d, 3),
    (wl.RecursiveWhitenConv3d, nn.Conv3d, Fn.conv3d, 3),
]


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


def data(b, m, nd, seed, size=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (b, m) + (size,) * nd
    base = torch.randn((b, 1) + (size,) * nd, generator=g)
    x = (base + 0.3 * torch.randn(shape, generator=g)) * torch.linspace(0.5, 2.0, m).view((1, m) + (1,) * nd) + 2.0
    return x.to(dtype)


@pytest.mark.parametrize("cls, plain, conv_fn, nd", CASES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_fold_keeps_function_and_export_is_exact(cls, plain, conv_fn, nd, groups, bias):
    torch.manual_seed(0)
    layer = cls(4, 6, 3, padding=1, stride=2, groups=groups, bias=bias, block_size=2)
    probe = data(2, 4, nd, 99)
    for i in range(4):
        layer.eval()
        before = layer(probe)
        layer.train()
        layer(data(6, 4, nd, i) + i)
        layer.eval()
        torch.testing.assert_close(layer(probe), before, rtol=1e-5, atol=1e-4)
    assert int(layer.num_blocks) == 2 and layer.running_mean.abs().min() > 1.0
    conv = layer.to_conv()
    assert type(conv) is plain
    torch.testing.assert_close(conv(probe), layer(probe), rtol=1e-6, atol=1e-6)
    # z = conv(pad0(x) - mu, W) + b
    mu = layer.running_mean.view((1, 4) + (1,) * nd)
    b = layer._layer_bias(layer.weight) + F.weight_mean_product(layer.weight, layer.running_mean)
    ref = conv_fn(Fn.pad(probe, (1, 1) * nd) - mu, layer.weight, b, stride=2, groups=groups)
    torch.testing.assert_close(layer(probe), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls, plain, conv_fn, nd", CASES)
def test_weight_grad_is_centred_grad_times_q(cls, plain, conv_fn, nd):
    torch.manual_seed(0)
    layer = cls(3, 4, 3, padding=1, dtype=DT, block_size=1)
    for i in range(3):
        layer(data(5, 3, nd, i, dtype=DT))
    q, mu = layer.grad_transform.clone(), layer.running_mean.clone()
    assert not torch.allclose(q, torch.eye(3, dtype=DT))
    layer.eval()
    x = torch.randn((2, 3) + (5,) * nd, dtype=DT)
    dy = torch.randn((2, 4) + (5,) * nd, dtype=DT)
    layer.zero_grad()
    layer(x).backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    conv_fn(Fn.pad(x, (1, 1) * nd) - mu.view((1, 3) + (1,) * nd), w, b).backward(dy)
    torch.testing.assert_close(layer.weight.grad, torch.einsum("oi...,ij->oj...", w.grad, q))
    torch.testing.assert_close(layer.bias.grad, b.grad)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv1d_equivalence_with_direct_whitening_under_sgd(groups):
    """GradWhitenConv1d with W T == ConstantPad1d -> DirectWhiten -> Conv1d(padding=0) with W, step after step."""
    torch.manual_seed(0)
    m, s, k, pad = 4, 6, 3, 1
    cov = torch.randn(m, 3 * m, dtype=DT)
    cov = cov @ cov.t() / (3 * m)
    if groups == 1:
        t = F.evd_transform(cov, eps=1e-6, gmax=10.0)[0]
    else:
        t = F.evd_transform_grouped(torch.stack([cov[:2, :2], cov[2:, 2:]]), eps=1e-6, gmax=10.0)[0]
    mu = torch.randn(m, dtype=DT)
    direct = wl.DirectWhiten(m, groups=groups, block_size=10**9, dtype=DT)
    direct.whitening_matrix.copy_(t)
    direct.running_mean.copy_(mu)
    conv = nn.Conv1d(m, s, k, groups=groups, dtype=DT)
    ref = nn.Sequential(nn.ConstantPad1d(pad, 0.0), direct, conv)
    gw = wl.GradWhitenConv1d(m, s, k, padding=pad, groups=groups, dtype=DT, block_size=10**9)

    def wt(w):
        if groups == 1:
            return torch.einsum("oik,ij->ojk", w, t)
        return torch.cat([torch.einsum("oik,ij->ojk", w[3 * g:3 * g + 3], t[g]) for g in range(2)])

    with torch.no_grad():
        gw.weight.copy_(wt(conv.weight))
        gw.bias.copy_(conv.bias)
    gw.running_mean.copy_(mu)
    gw.grad_transform.copy_(t.mT @ t)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
            for mod in (ref, gw)]
    for step in range(4):
        x = torch.randn(3, m, 9, dtype=DT) + 0.5
        target = torch.randn(3, s, 9, dtype=DT)
        outs = [ref(x), gw(x)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-9)
        for out, opt in zip(outs, opts):
            opt.zero_grad()
            ((out - target) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(gw.weight, wt(conv.weight), rtol=1e-9, atol=1e-9)


def test_unbatched_inputs_and_errors_name_the_layer():
    layer = wl.GradWhitenConv1d(3, 4, 3, block_size=1)
    layer.layer_name = "enc.0"
    assert layer(torch.randn(3, 10)).shape == (4, 8)
    assert int(layer.num_blocks) == 1
    with pytest.raises(ValueError, match=r"enc\.0.*expected 3 input features.*got 5"):
        layer(torch.randn(2, 5, 10))
    with pytest.raises(ValueError, match=r"\(B, C, L\) or \(C, L\)"):
        layer(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\(B, C, D, H, W\)"):
        wl.GradWhitenConv3d(3, 4, 3)(torch.randn(2, 3, 4))
    assert wl.GradWhitenConv3d(3, 4, 3, padding=1)(torch.randn(3, 4, 4, 4)).shape == (4, 4, 4, 4)
    with pytest.raises(TypeError, match="nn.Conv1d"):
        wl.GradWhitenConv1d.from_conv(nn.Conv2d(3, 4, 3))


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_conv1d_model_converts_trains_and_exports_exactly(method):
    """An audio-style model: Conv1d stem, residual BasicBlock-named blocks of Conv1d, a Conv1d head and a classifier."""

    class BasicBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv1d(c, c, 5, padding=2, bias=False)
            self.bn1 = nn.BatchNorm1d(c)
            self.conv2 = nn.Conv1d(c, c, 3, padding=1, groups=2, bias=False)
            self.bn2 = nn.BatchNorm1d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv1d(2, 8, 7, stride=2, padding=3)
            self.blocks = nn.Sequential(BasicBlock(8), BasicBlock(8))
            self.head = nn.Conv1d(8, 8, 1)
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            return self.fc(self.head(self.blocks(self.stem(x))).mean(-1))

    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    assert len(wl.conversion_report(model).converted) == 4
    wl.convert_model(model, method, targets="all", block_size=2)
    assert len(wl.whitening_layers(model)) == 5  # 4 block convs and the head conv; not the stem or classifier
    x = data(4, 2, 1, 0, size=32)
    torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=0, atol=0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        opt.zero_grad()
        Fn.cross_entropy(model(data(4, 2, 1, i + 1, size=32)), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model.eval()
    exported = wl.to_plain_model(copy.deepcopy(model))
    assert not wl.whitening_layers(exported)
    torch.testing.assert_close(exported(x), model(x), rtol=1e-5, atol=1e-5)
