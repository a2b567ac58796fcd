"""Whitening layers: the equivalence of paper section 3.1 (docs/PAPER.md), folds, gradients, construction."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import whitenlayers as wl
from whitenlayers import functional as F

GRAD_CONVS = [wl.GradWhitenConv2d, wl.RecursiveWhitenConv2d]
GRAD_LINEARS = [wl.GradWhitenLinear, wl.RecursiveWhitenLinear]


def random_transform(m, seed):
    """A symmetric positive-definite ZCA-like T from a random covariance."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, 3 * m, generator=g, dtype=torch.float64)
    t, _ = F.evd_transform(a @ a.t() / (3 * m), eps=1e-6, gmax=10.0)
    return t


# ---------------------------------------------------------------- equivalence
@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(1, 5),
    s=st.integers(1, 4),
    k=st.sampled_from([1, 2, 3]),
    stride=st.sampled_from([1, 2]),
    pad=st.integers(0, 2),
    bias=st.booleans(),
    nesterov=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_grad_whitening_equals_direct_whitening_under_sgd(m, s, k, stride, pad, bias, nesterov, seed):
    """GradWhitenConv2d with W T == ZeroPad2d(p) -> DirectWhiten -> Conv2d(padding=0) with W, step after step."""
    torch.manual_seed(seed)
    dt = torch.float64
    t = random_transform(m, seed)
    mu = torch.randn(m, dtype=dt)
    big = 10**9  # fixed statistics: no fold during the test
    direct = wl.DirectWhiten(m, block_size=big, dtype=dt)
    direct.whitening_matrix.copy_(t)
    direct.running_mean.copy_(mu)
    conv = nn.Conv2d(m, s, k, stride=stride, padding=0, bias=bias, dtype=dt)
    model_d = nn.Sequential(nn.ZeroPad2d(pad), direct, conv)

    gw = wl.GradWhitenConv2d(m, s, k, stride=stride, padding=pad, bias=bias, dtype=dt, block_size=big)
    with torch.no_grad():
        gw.weight.copy_(torch.einsum("oihw,ij->ojhw", conv.weight, t))
        if bias:
            gw.bias.copy_(conv.bias)
    gw.running_mean.copy_(mu)
    gw.grad_transform.copy_(t.t() @ t)

    opt_kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    opt_d = torch.optim.SGD(model_d.parameters(), **opt_kw)
    opt_g = torch.optim.SGD(gw.parameters(), **opt_kw)
    size = k + 3
    for step in range(4):
        x = torch.randn(3, m, size, size, dtype=dt) + 0.5
        target = torch.randn(3, s, (size + 2 * pad - k) // stride + 1, (size + 2 * pad - k) // stride + 1, dtype=dt)
        out_d, out_g = model_d(x), gw(x)
        torch.testing.assert_close(out_g, out_d, rtol=1e-9, atol=1e-9)
        for out, opt in ((out_d, opt_d), (out_g, opt_g)):
            opt.zero_grad()
            ((out - target) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(gw.weight, torch.einsum("oihw,ij->ojhw", conv.weight, t), rtol=1e-9, atol=1e-9)
        if bias:
            torch.testing.assert_close(gw.bias, conv.bias, rtol=1e-9, atol=1e-9)


def test_equivalence_test_detects_a_wrong_transform():
    """The comparison above is sharp: with Q_s = T instead of T^T T the weights diverge."""
    torch.manual_seed(0)
    m, t = 3, random_transform(3, 0).double()
    conv = nn.Conv2d(m, 2, 3, bias=False, dtype=torch.float64)
    gw = wl.GradWhitenConv2d(m, 2, 3, bias=False, dtype=torch.float64, block_size=10**9)
    with torch.no_grad():
        gw.weight.copy_(torch.einsum("oihw,ij->ojhw", conv.weight, t))
    gw.grad_transform.copy_(t)  # wrong on purpose
    direct = wl.DirectWhiten(m, block_size=10**9, dtype=torch.float64)
    direct.whitening_matrix.copy_(t)
    x = torch.randn(2, m, 5, 5, dtype=torch.float64)
    for mod, params in ((nn.Sequential(direct, conv), conv.parameters()), (gw, gw.parameters())):
        opt = torch.optim.SGD(params, lr=0.1)
        mod(x).square().mean().backward()
        opt.step()
    assert not torch.allclose(gw.weight, torch.einsum("oihw,ij->ojhw", conv.weight, t), rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------- folds
@pytest.mark.parametrize("cls", GRAD_CONVS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_fold_keeps_every_output_position(cls, bias, padding_mode):
    torch.manual_seed(0)
    layer = cls(4, 5, 3, padding=1, stride=2, bias=bias, padding_mode=padding_mode, block_size=2)
    probe = torch.randn(2, 4, 7, 7) * 2 + 3
    for i in range(6):
        x = torch.randn(8, 4, 7, 7) * torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, 4, 1, 1) + 3 + i
        layer.eval()
        before = layer(probe)
        layer.train()
        layer(x)
        layer.eval()
        after = layer(probe)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)
    assert int(layer.num_blocks) == 3
    assert layer.running_mean.abs().min() > 1.0  # the mean really moved
    assert layer.bias_correction.abs().max() > 0  # the compensation, in a buffer with or without a bias
    assert [n for n, _ in layer.named_parameters()] == (["weight", "bias"] if bias else ["weight"])


@pytest.mark.parametrize("cls", GRAD_LINEARS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fold_keeps_function(cls, bias):
    torch.manual_seed(0)
    layer = cls(6, 3, bias=bias, block_size=1)
    probe = torch.randn(5, 6) + 2
    for i in range(4):
        layer.eval()
        before = layer(probe)
        layer.train()
        layer(torch.randn(16, 6) * 3 + i)
        layer.eval()
        torch.testing.assert_close(layer(probe), before, rtol=1e-5, atol=1e-5)
    assert int(layer.num_blocks) == 4


def test_bias_compensation_never_writes_the_bias_parameter():
    """A fold leaves the bias parameter alone (a sharded wrapper or a pending backward may hold it); the compensation
    ``c`` is the buffer ``bias_correction``: z = conv(pad0(x) - mu, W) + b + c."""
    torch.manual_seed(0)
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=1)
    bias, version = layer.bias.detach().clone(), layer.bias._version
    for _ in range(3):
        layer(torch.randn(4, 3, 6, 6) + 5)
    assert torch.equal(layer.bias.detach(), bias) and layer.bias._version == version
    assert int(layer.num_blocks) == 3 and layer.bias_correction.abs().max() > 0.1
    x = torch.randn(2, 3, 6, 6)
    mu = layer.running_mean.view(1, 3, 1, 1)
    ref = Fn.conv2d(Fn.pad(x, (1, 1, 1, 1)) - mu, layer.weight, layer.bias + layer.bias_correction)
    layer.eval()
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- gradients
@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_weight_grad_is_centred_grad_times_q(cls):
    torch.manual_seed(0)
    dt = torch.float64
    layer = cls(3, 4, 3, padding=1, dtype=dt, block_size=1)
    for _ in range(3):  # a few folds: non-trivial mu and Q_s
        layer(torch.randn(6, 3, 5, 5, dtype=dt) * torch.tensor([1.0, 0.2, 3.0], dtype=dt).view(1, 3, 1, 1) + 2)
    q, mu = layer.grad_transform.clone(), layer.running_mean.clone()
    layer.eval()  # no fold during this step
    x = torch.randn(2, 3, 5, 5, dtype=dt)
    dy = torch.randn(2, 4, 5, 5, dtype=dt)
    layer.zero_grad()
    layer(x).backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    Fn.conv2d(Fn.pad(x, (1, 1, 1, 1)) - mu.view(1, 3, 1, 1), w, b).backward(dy)
    torch.testing.assert_close(layer.weight.grad, torch.einsum("oihw,ij->ojhw", w.grad, q))
    torch.testing.assert_close(layer.bias.grad, b.grad)
    assert not torch.allclose(q, torch.eye(3, dtype=dt))


def test_backward_uses_transform_in_force_during_forward():
    """The batch that ends a block is back-propagated with the Q_s of its forward, not the new one."""
    torch.manual_seed(0)
    layer = wl.GradWhitenLinear(3, 2, block_size=2, beta=0.0)
    layer(torch.randn(32, 3) * torch.tensor([1.0, 5.0, 0.1]))  # batch 1 of block 0
    q_before = layer.grad_transform.clone()
    x = torch.randn(32, 3) * torch.tensor([1.0, 5.0, 0.1])
    y = layer(x)  # ends the block: fold after the output is computed
    assert int(layer.num_blocks) == 1 and not torch.allclose(layer.grad_transform, q_before)
    layer.zero_grad()
    dy = torch.randn_like(y)
    y.backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    Fn.linear(x - torch.zeros(3), w).backward(dy)  # mu in force during the forward was 0
    torch.testing.assert_close(layer.weight.grad, w.grad @ q_before)


@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_gradient_accumulation_equals_big_batch(cls):
    torch.manual_seed(0)
    dt = torch.float64
    a = cls(3, 4, 3, padding=1, dtype=dt, block_size=1)
    for _ in range(2):
        a(torch.randn(5, 3, 6, 6, dtype=dt) * torch.tensor([1.0, 0.3, 2.0], dtype=dt).view(1, 3, 1, 1) + 1)
    a.eval()
    b = copy.deepcopy(a)
    x = torch.randn(8, 3, 6, 6, dtype=dt)
    a.zero_grad()
    for part in x.split([3, 5]):
        a(part).square().sum().backward()
    b.zero_grad()
    b(x).square().sum().backward()
    torch.testing.assert_close(a.weight.grad, b.weight.grad)
    torch.testing.assert_close(a.bias.grad, b.bias.grad)


def test_grad_layer_saves_no_more_than_plain_conv():
    """Centring costs no activation memory: the saved tensors match nn.Conv2d's, plus M x M / M-sized constants."""

    def saved_numels(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sorted(sizes)

    torch.manual_seed(0)
    x = torch.randn(8, 16, 12, 12, requires_grad=True)
    plain = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    gw = wl.GradWhitenConv2d.from_conv(plain, block_size=1)
    gw(x.detach())  # fold once: non-zero mean
    act = x.numel()
    plain_big = [n for n in saved_numels(lambda: plain(x)) if n >= act]
    grad_big = [n for n in saved_numels(lambda: gw(x)) if n >= act]
    assert grad_big == plain_big


# --------------------------------------------------------------- DirectWhiten
def test_direct_whiten_gradcheck():
    torch.manual_seed(0)
    layer = wl.DirectWhiten(3, dtype=torch.float64)
    layer.whitening_matrix.copy_(random_transform(3, 1) + 0.1 * torch.randn(3, 3, dtype=torch.float64))
    layer.running_mean.copy_(torch.randn(3, dtype=torch.float64))
    layer.eval()
    for shape in [(4, 3), (2, 3, 3, 2)]:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(layer, (x,))


def test_direct_whiten_forward_and_backward_formula():
    torch.manual_seed(0)
    layer = wl.DirectWhiten(3, dtype=torch.float64, block_size=10**9)
    t = torch.randn(3, 3, dtype=torch.float64)  # not symmetric: catches T vs T^T mix-ups
    mu = torch.randn(3, dtype=torch.float64)
    layer.whitening_matrix.copy_(t)
    layer.running_mean.copy_(mu)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, torch.einsum("ij,bjhw->bihw", t, x - mu.view(1, 3, 1, 1)))
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, torch.einsum("ji,bjhw->bihw", t, dy))


def test_direct_whiten_saves_no_activation():
    layer = wl.DirectWhiten(8)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    assert all(n < x.numel() for n in sizes)


def test_direct_whiten_channels_last_and_2d():
    layer = wl.DirectWhiten(3, block_size=1)
    x = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    layer(x)
    y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = torch.einsum("ij,bjhw->bihw", layer.whitening_matrix, x - layer.running_mean.view(1, 3, 1, 1))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(6, 3)).shape == (6, 3)


# --------------------------------------------------------------- construction
@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_from_conv_shares_parameters_and_function(cls):
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    conv.weight.requires_grad_(False)
    conv.eval()
    new = cls.from_conv(conv, block_size=3)
    assert new.weight is conv.weight and new.bias is conv.bias
    assert not new.training and new.weight.dtype == torch.float64 and not new.weight.requires_grad
    assert new.block_size == 3 and new.running_mean.dtype == torch.float64
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(new(x), conv(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", GRAD_LINEARS)
def test_from_linear_shares_parameters(cls):
    lin = nn.Linear(4, 2, bias=False)
    new = cls.from_linear(lin)
    assert new.weight is lin.weight and new.bias is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(new(x), lin(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_to_conv_is_exact(cls):
    torch.manual_seed(0)
    layer = cls(3, 4, 3, padding=1, bias=False, block_size=1)
    for _ in range(3):
        layer(torch.randn(4, 3, 6, 6) + 2)
    layer.eval()
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(layer.to_conv()(x), layer(x), rtol=1e-6, atol=1e-6)
    assert type(layer.to_conv()) is nn.Conv2d


def test_bad_groups_rejected_and_padding_modes_supported():
    with pytest.raises(ValueError, match="groups"):
        wl.GradWhitenConv2d(4, 4, 3, groups=3)  # nn.Conv2d's own check
    with pytest.raises(ValueError, match="groups must be a positive integer that divides num_features=4"):
        wl.DirectWhiten(4, groups=3)
    assert tuple(wl.GradWhitenConv2d(4, 4, 3, groups=2).grad_transform.shape) == (2, 2, 2)
    for mode in ["zeros", "reflect", "replicate", "circular"]:
        wl.GradWhitenConv2d(4, 4, 3, padding=1, padding_mode=mode)(torch.randn(1, 4, 5, 5))


def test_wrong_input_errors_name_layer_and_sizes():
    layer = wl.GradWhitenConv2d(3, 4, 3)
    layer.layer_name = "layer1.0.conv1"
    with pytest.raises(ValueError, match=r"layer1\.0\.conv1.*expected 3 .*got 5"):
        layer(torch.randn(1, 5, 6, 6))
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(3, 6))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(1, 3, 6, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="expected 4 input features.*got 3"):
        wl.DirectWhiten(4)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="expected 5 input features"):
        wl.GradWhitenLinear(5, 2)(torch.randn(2, 4))


def test_extra_repr_shows_non_defaults():
    r = repr(wl.GradWhitenConv2d(3, 4, 3, block_size=7, beta=0.5))
    assert "block_size=7" in r and "beta=0.5" in r and "alpha" not in r
    r = repr(wl.RecursiveWhitenConv2d(3, 4, 3, gamma=0.9))
    assert "gamma=0.9" in r and "delta" not in r
    assert repr(wl.DirectWhiten(3)) == "DirectWhiten(3)"


@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_deepcopy_and_pickle_keep_behaviour(cls):
    torch.manual_seed(0)
    layer = cls(3, 4, 3, padding=1, block_size=2)
    for _ in range(3):  # mid-block: one batch accumulated
        layer(torch.randn(4, 3, 6, 6) * torch.tensor([1.0, 3.0, 0.2]).view(1, 3, 1, 1) + 1)
    clones = [copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))]
    x = torch.randn(4, 3, 6, 6)
    layer(x).square().sum().backward()
    for c in clones:
        c(x).square().sum().backward()
        torch.testing.assert_close(c.weight.grad, layer.weight.grad)
        for name, buf in layer.named_buffers():
            torch.testing.assert_close(dict(c.named_buffers())[name], buf)
        assert int(c.num_blocks) == 2
