"""Grouped and depthwise convolutions (issue 14; docs/PAPER.md, "Conventions").

Whitening per group: block-diagonal ``T`` and ``Q_s`` stored as ``(G, k, k)``,
statistics per group, the equivalence of paper section 3.1 per group. The
reference throughout is the ungrouped maths applied to the dense
block-diagonal matrix (``functional.block_diagonal``).
"""
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stand_ins
import whitenlayers as wl
from whitenlayers import functional as F
from whitenlayers.fold import fold_layers

GRAD_CONVS = [wl.GradWhitenConv2d, wl.RecursiveWhitenConv2d]
DT = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


def random_blocks(g, k, seed, scale=True):
    """``(G, k, k)`` random covariances, with different powers per group."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(g, k, 3 * k, generator=gen, dtype=DT)
    c = a @ a.mT / (3 * k)
    if scale:
        c = c * (0.1 + 5 * torch.rand(g, 1, 1, generator=gen, dtype=DT))
    return c


def dense_blocks(mat, g):
    """The ``(G, k, k)`` diagonal blocks of a dense ``(M, M)`` matrix."""
    k = mat.shape[0] // g
    return torch.stack([mat[i * k:(i + 1) * k, i * k:(i + 1) * k] for i in range(g)])


def grouped_einsum(w, t):
    """``W_g T_g`` per group of output channels for a grouped weight ``(S, k, *kernel)``."""
    g = t.shape[0]
    out = torch.einsum("gsi...,gij->gsj...", w.reshape((g, w.shape[0] // g) + tuple(w.shape[1:])), t.to(w.dtype))
    return out.reshape(w.shape)


# --------------------------------------------------------------------------
# Functional
# --------------------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 2, 3, 6])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "rows", "conv1d"])
def test_grouped_moments_are_the_diagonal_blocks(groups, layout):
    torch.manual_seed(0)
    shape = {"contiguous": (4, 6, 5, 5), "channels_last": (4, 6, 5, 5), "rows": (30, 6), "conv1d": (4, 6, 7)}[layout]
    x = torch.randn(shape, dtype=DT) * torch.linspace(0.5, 3, 6, dtype=DT).view((1, 6) + (1,) * (len(shape) - 2)) + 10
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    shift = x.mean([0] + list(range(2, x.dim()))) + 0.1
    s1, s2 = F.batch_moments(x, shift, groups=groups)
    r1, r2 = F.batch_moments(x.contiguous(), shift)
    torch.testing.assert_close(s1, r1, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(s2, r2 if groups == 1 else dense_blocks(r2, groups), rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("groups", [4, 64])
def test_grouped_moments_float32_large_input_accurate_when_mean_dominates(groups):
    """The CPU fast paths (unshifted product; var_mean for depthwise) stay accurate with |mean| >> std."""
    torch.manual_seed(0)
    x = torch.randn(16, 64, 32, 32) * 0.5 + torch.linspace(-20, 20, 64).view(1, 64, 1, 1)
    shift = x.mean((0, 2, 3)).double() + 0.01
    s1, s2 = F.batch_moments(x, shift, groups=groups)
    r1, r2 = F.batch_moments(x.double(), shift)
    torch.testing.assert_close(s1.double(), r1, rtol=1e-4, atol=0.5)
    torch.testing.assert_close(s2.double(), dense_blocks(r2, groups), rtol=1e-4, atol=0.5)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("gains", ["practical", "zca"])
@pytest.mark.parametrize("gmax", [10.0, 2.0])
def test_grouped_evd_equals_evd_of_the_block_diagonal_matrix(k, gains, gmax):
    covs = random_blocks(6, k, seed=k)
    t, q = F.evd_transform_grouped(covs, eps=1e-6, gmax=gmax, gains=gains)
    td, qd = F.evd_transform(F.block_diagonal(covs), eps=1e-6, gmax=gmax, gains=gains)
    torch.testing.assert_close(F.block_diagonal(t), td, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(F.block_diagonal(q), qd, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q, t.mT @ t, rtol=1e-10, atol=1e-10)


def test_depthwise_gains_are_a_capped_per_channel_standardisation():
    """k = 1: T = diag(sqrt(g)), g_c = min(mean var / var_c, gmax) for the round(M_s) strongest channels, else 1."""
    var = torch.tensor([4.0, 1.0, 0.25, 0.01, 2.0, 1e-4], dtype=DT)
    t, q = F.evd_transform_grouped(var.view(6, 1, 1), eps=1e-6, gmax=10.0)
    ms = int(torch.round(F.effective_rank(var)))
    order = torch.argsort(var, descending=True)
    expected = torch.ones(6, dtype=DT)
    for c in order[:ms]:
        expected[c] = min(float(var.mean() / var[c]), 10.0)
    torch.testing.assert_close(q.view(6), expected)
    torch.testing.assert_close(t.view(6), expected.sqrt())
    t, q = F.evd_transform_grouped(var.view(6, 1, 1), eps=1e-6, gmax=10.0, gains="zca")
    torch.testing.assert_close(q.view(6), 1.0 / var)  # plain standardisation, no cap


def test_grouped_evd_batched_across_layers_and_robust():
    covs = [random_blocks(3, 2, 0), random_blocks(5, 2, 1), torch.full((2, 2, 2), float("nan"), dtype=DT)]
    out = F.evd_transform_grouped_batched(covs, eps=1e-6, gmax=10.0)
    for c, res in zip(covs[:2], out[:2]):
        ref = F.evd_transform_grouped(c, eps=1e-6, gmax=10.0)
        torch.testing.assert_close(res[0], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[1], ref[1], rtol=1e-12, atol=1e-12)
    assert out[2] is None
    # a zero block and an identical pair of eigenvalues decompose without trouble
    z = torch.zeros(3, 2, 2, dtype=DT)
    z[1] = torch.eye(2, dtype=DT)
    t, q = F.evd_transform_grouped(z, eps=1e-5, gmax=10.0)
    assert torch.isfinite(t).all() and torch.isfinite(q).all()


@pytest.mark.parametrize("k", [1, 3])
def test_grouped_recursive_step_is_the_step_of_each_group(k):
    g = 5
    phi = random_blocks(g, k, seed=3)
    phi[2] = 0.0  # a zero block takes e_0 and the leakage only
    t = torch.eye(k, dtype=DT) + 0.1 * torch.randn(g, k, k, dtype=DT, generator=torch.Generator().manual_seed(1))
    q = t.mT @ t
    mean_power = torch.tensor(0.8, dtype=DT)
    kw = dict(gamma=0.99, delta=0.25, eps=1e-5, c_rel=0.025, c_abs=1e-6)
    step = F.recursive_step(t, q, phi, mean_power, **kw)  # (G, k, k): a step per block
    clamped = False
    for i in range(g):
        ref = F.recursive_step(t[i], q[i], phi[i], mean_power, **kw)
        torch.testing.assert_close(step.transform[i], ref.transform, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step.gram[i], ref.gram, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step.direction[i], ref.direction, rtol=1e-12, atol=1e-12)
        clamped |= ref.clamped
    assert step.clamped == clamped
    torch.testing.assert_close(step.gram, step.transform.mT @ step.transform, rtol=1e-12, atol=1e-12)


def test_grouped_weight_grad_and_weight_mean_product():
    gen = torch.Generator().manual_seed(0)
    for s, k, g, kernel in [(8, 3, 2, (3, 3)), (6, 1, 6, (3, 3)), (12, 1, 6, (5,)), (4, 2, 2, (1, 2, 2))]:
        w = torch.randn((s, k) + kernel, generator=gen, dtype=DT)
        q = random_blocks(g, k, 1)
        ref = torch.cat([torch.einsum("oi...,ij->oj...", w[i * s // g:(i + 1) * s // g], q[i]) for i in range(g)])
        torch.testing.assert_close(F.transform_weight_grad(w, q), ref, rtol=1e-12, atol=1e-12)
        mu = torch.randn(g * k, generator=gen, dtype=DT)
        ref_b = torch.cat([w[i * s // g:(i + 1) * s // g].reshape(s // g, k, -1).sum(-1) @ mu[i * k:(i + 1) * k]
                           for i in range(g)])
        torch.testing.assert_close(F.weight_mean_product(w, mu), ref_b, rtol=1e-12, atol=1e-12)
    w = torch.randn(8, 2, 3, 3).to(memory_format=torch.channels_last)
    for q in (torch.rand(4, 2, 2), torch.rand(8, 1, 1)):
        wq = w if q.shape[-1] == 2 else torch.randn(8, 1, 3, 3).to(memory_format=torch.channels_last)
        assert F.transform_weight_grad(wq, q).is_contiguous(memory_format=torch.channels_last)


def test_grouped_diagnostics_are_those_of_the_block_diagonal_matrix():
    covs = random_blocks(4, 3, 7)
    torch.testing.assert_close(F.grouped_normalized_rank(covs), F.normalized_rank(F.block_diagonal(covs)))
    torch.testing.assert_close(F.grouped_whiteness(covs), F.whiteness(F.block_diagonal(covs)))
    assert float(F.grouped_whiteness(torch.rand(9, 1, 1, dtype=DT))) == 1.0  # depthwise: rho = 1


# --------------------------------------------------------------------------
# The equivalence property, per group
# --------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(
    groups=st.integers(1, 3),
    k=st.integers(1, 3),
    per_group_out=st.integers(1, 2),
    kernel=st.sampled_from([1, 2, 3]),
    stride=st.sampled_from([1, 2]),
    pad=st.integers(0, 2),
    bias=st.booleans(),
    nesterov=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_grouped_grad_whitening_equals_grouped_direct_whitening_under_sgd(groups, k, per_group_out, kernel, stride,
                                                                          pad, bias, nesterov, seed):
    """GradWhitenConv2d(groups=G) with W_g T_g == ZeroPad2d(p) -> DirectWhiten(groups=G) -> Conv2d(groups=G, padding=0)
    with W, step after step (fixed statistics; SGD with momentum, Nesterov, weight decay)."""
    torch.manual_seed(seed)
    m, s = groups * k, groups * per_group_out
    t = F.evd_transform_grouped(random_blocks(groups, k, seed), eps=1e-6, gmax=10.0)[0]
    mu = torch.randn(m, dtype=DT)
    big = 10**9  # fixed statistics: no fold during the test
    stored = t[0] if groups == 1 else t  # groups=1 layers keep the (M, M) layout
    direct = wl.DirectWhiten(m, groups=groups, block_size=big, dtype=DT)
    direct.whitening_matrix.copy_(stored)
    direct.running_mean.copy_(mu)
    conv = nn.Conv2d(m, s, kernel, stride=stride, padding=0, groups=groups, bias=bias, dtype=DT)
    model_d = nn.Sequential(nn.ZeroPad2d(pad), direct, conv)

    gw = wl.GradWhitenConv2d(m, s, kernel, stride=stride, padding=pad, groups=groups, bias=bias, dtype=DT,
                             block_size=big)
    with torch.no_grad():
        gw.weight.copy_(grouped_einsum(conv.weight, t))
        if bias:
            gw.bias.copy_(conv.bias)
    gw.running_mean.copy_(mu)
    gw.grad_transform.copy_(stored.mT @ stored)

    opt_kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    opt_d = torch.optim.SGD(model_d.parameters(), **opt_kw)
    opt_g = torch.optim.SGD(gw.parameters(), **opt_kw)
    size = kernel + 3
    out_size = (size + 2 * pad - kernel) // stride + 1
    for step in range(4):
        x = torch.randn(3, m, size, size, dtype=DT) + 0.5
        target = torch.randn(3, s, out_size, out_size, dtype=DT)
        out_d, out_g = model_d(x), gw(x)
        torch.testing.assert_close(out_g, out_d, rtol=1e-9, atol=1e-9)
        for out, opt in ((out_d, opt_d), (out_g, opt_g)):
            opt.zero_grad()
            ((out - target) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(gw.weight, grouped_einsum(conv.weight, t), rtol=1e-9, atol=1e-9)
        if bias:
            torch.testing.assert_close(gw.bias, conv.bias, rtol=1e-9, atol=1e-9)


def test_grouped_equivalence_test_detects_a_wrong_group_transform():
    """Sharp per group: swapping two groups' Q_s breaks the equality."""
    torch.manual_seed(0)
    t = F.evd_transform_grouped(random_blocks(2, 3, 0), eps=1e-6, gmax=10.0)[0]
    conv = nn.Conv2d(6, 4, 3, groups=2, bias=False, dtype=DT)
    gw = wl.GradWhitenConv2d(6, 4, 3, groups=2, bias=False, dtype=DT, block_size=10**9)
    with torch.no_grad():
        gw.weight.copy_(grouped_einsum(conv.weight, t))
    gw.grad_transform.copy_((t.mT @ t).flip(0))  # wrong on purpose
    direct = wl.DirectWhiten(6, groups=2, block_size=10**9, dtype=DT)
    direct.whitening_matrix.copy_(t)
    x = torch.randn(2, 6, 5, 5, dtype=DT)
    for mod, params in ((nn.Sequential(direct, conv), conv.parameters()), (gw, gw.parameters())):
        opt = torch.optim.SGD(params, lr=0.1)
        mod(x).square().mean().backward()
        opt.step()
    assert not torch.allclose(gw.weight, grouped_einsum(conv.weight, t), rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------
def correlated(b, m, size, seed, groups):
    """Inputs whose channels are correlated within each group, with unequal powers and non-zero means."""
    g = torch.Generator().manual_seed(seed)
    k = m // groups
    base = torch.randn(b, groups, 1, size, size, generator=g).expand(b, groups, k, size, size).reshape(b, m, size, size)
    scale = torch.linspace(0.3, 3.0, m).view(1, m, 1, 1)
    return (base + 0.4 * torch.randn(b, m, size, size, generator=g)) * scale + 2.0


@pytest.mark.parametrize("cls", GRAD_CONVS)
@pytest.mark.parametrize("groups, m", [(2, 6), (8, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_fold_keeps_function_and_state_is_block_diagonal(cls, groups, m, bias):
    torch.manual_seed(0)
    layer = cls(m, 2 * m, 3, padding=1, stride=2, groups=groups, bias=bias, block_size=2)
    k = m // groups
    assert tuple(layer.whitening_matrix.shape) == (groups, k, k) == tuple(layer.running_cov.shape)
    assert tuple(layer.running_mean.shape) == (m,)
    probe = correlated(2, m, 7, 99, groups)
    for i in range(6):
        layer.eval()
        before = layer(probe)
        layer.train()
        layer(correlated(8, m, 7, i, groups) + i)
        layer.eval()
        torch.testing.assert_close(layer(probe), before, rtol=1e-5, atol=1e-4)
    assert int(layer.num_blocks) == 3
    assert not torch.allclose(layer.grad_transform, F.block_identity(m, groups))
    if cls is wl.GradWhitenConv2d:  # T is the ungrouped rule on the block-diagonal part of Phi_x
        ref = F.evd_transform(F.block_diagonal(layer.running_cov), eps=1e-5, gmax=10.0)[0]
        torch.testing.assert_close(F.block_diagonal(layer.whitening_matrix), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", GRAD_CONVS)
def test_grouped_weight_grad_is_centred_grad_times_q_per_group(cls):
    torch.manual_seed(0)
    layer = cls(6, 4, 3, padding=1, groups=2, dtype=DT, block_size=1)
    for i in range(3):
        layer(correlated(6, 6, 5, i, 2).double())
    q, mu = layer.grad_transform.clone(), layer.running_mean.clone()
    layer.eval()
    x = torch.randn(2, 6, 5, 5, dtype=DT)
    dy = torch.randn(2, 4, 5, 5, dtype=DT)
    layer.zero_grad()
    layer(x).backward(dy)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    Fn.conv2d(Fn.pad(x, (1, 1, 1, 1)) - mu.view(1, 6, 1, 1), w, b, groups=2).backward(dy)
    torch.testing.assert_close(layer.weight.grad, grouped_einsum(w.grad, q))
    torch.testing.assert_close(layer.bias.grad, b.grad)


def test_depthwise_layer_keeps_no_m_by_m_state_and_scales_per_channel():
    m = 96
    layer = wl.RecursiveWhitenConv2d(m, m, 3, padding=1, groups=m, bias=False, block_size=1)
    # (the rule's identity, a fixed-width buffer whatever M, aside)
    big = [name for name, buf in layer.named_buffers() if buf.numel() > 2 * m and name != "whitening_rule"]
    assert big == []
    layer(correlated(4, m, 6, 0, m))
    assert tuple(layer.grad_transform.shape) == (m, 1, 1)
    grad = wl.GradWhitenConv2d(m, 2 * m, 3, padding=1, groups=m, block_size=1)
    x = correlated(4, m, 6, 1, m)
    grad(x)
    var = x.var((0, 2, 3), unbiased=False).double()
    t = F.evd_transform_grouped(var.view(m, 1, 1), eps=1e-5, gmax=10.0)[0]
    torch.testing.assert_close(grad.whitening_matrix.double(), t, rtol=1e-4, atol=1e-6)


def test_grouped_layers_fold_together_like_alone():
    """Layers with blocks of one size share one batched eigh; the results equal folding each alone."""
    torch.manual_seed(0)
    layers = [wl.GradWhitenConv2d(6, 6, 3, padding=1, groups=3, block_size=10**9),
              wl.GradWhitenConv2d(8, 4, 1, groups=4, block_size=10**9),
              wl.GradWhitenConv2d(4, 4, 3, padding=1, groups=4, block_size=10**9)]
    for i, layer in enumerate(layers):
        layer(correlated(4, layer.in_channels, 5, i, layer.groups))
    alone = copy.deepcopy(layers)
    fold_layers(layers)
    for layer in alone:
        layer.fold()
    for a, b in zip(layers, alone):
        assert torch.equal(a.running_cov, b.running_cov) and torch.equal(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.whitening_matrix, b.whitening_matrix, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.grad_transform, b.grad_transform, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", GRAD_CONVS + [wl.DirectWhiten])
def test_grouped_checkpoint_mid_block_resumes_bit_for_bit_and_copies_behave(cls):
    torch.manual_seed(0)
    layer = cls(6, groups=3, block_size=3) if cls is wl.DirectWhiten else cls(6, 6, 3, padding=1, groups=3, block_size=3)
    xs = [correlated(4, 6, 5, i, 3) for i in range(7)]
    for x in xs[:4]:
        layer(x)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    resumed = cls(6, groups=3, block_size=3) if cls is wl.DirectWhiten else cls(6, 6, 3, padding=1, groups=3, block_size=3)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    copies = [copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))]
    for x in xs[4:]:
        for mod in [layer, resumed] + copies:
            mod(x)
    for mod in [resumed] + copies:
        for (name, a), (_, b) in zip(layer.state_dict().items(), mod.state_dict().items()):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name


def test_groups_mismatch_in_checkpoint_is_a_clear_error():
    dense = wl.GradWhitenConv2d(4, 4, 3)
    grouped = wl.GradWhitenConv2d(4, 4, 3, groups=2)
    with pytest.raises(RuntimeError, match=r"running_cov' has shape \(4, 4\) \(groups=1\).*needs \(2, 2, 2\) "
                                           r"\(groups=2 of 2 features\)"):
        grouped.load_state_dict(dense.state_dict(), strict=False)


def test_grouped_direct_whiten_matches_dense_block_diagonal_and_keeps_layout():
    torch.manual_seed(0)
    d = wl.DirectWhiten(6, groups=2, block_size=1, dtype=DT)
    d(correlated(8, 6, 4, 0, 2).double())
    dense = F.block_diagonal(d.whitening_matrix)
    for x in (torch.randn(3, 6, 4, 4, dtype=DT), torch.randn(5, 6, dtype=DT), torch.randn(2, 6, 7, dtype=DT),
              torch.randn(3, 6, 4, 4, dtype=DT).to(memory_format=torch.channels_last)):
        x.requires_grad_()
        d.eval()
        y = d(x)
        ref = torch.einsum("ij,bj...->bi...", dense, x - d.running_mean.view((1, 6) + (1,) * (x.dim() - 2)))
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, dy)
        torch.testing.assert_close(gx, torch.einsum("ji,bj...->bi...", dense, dy))
        if x.dim() == 4 and not x.is_contiguous():
            assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("padding", [0, 1])
def test_grouped_export_is_exact(method, padding):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 1), models_block(padding))
    plain = copy.deepcopy(model)
    wl.convert_model(model, method, predicate=lambda n, m: m.groups > 1, block_size=1)
    assert len(wl.whitening_layers(model)) == 2
    x = correlated(4, 4, 6, 0, 1)
    torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=0, atol=0)  # function kept at conversion
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        opt.zero_grad()
        model(correlated(4, 4, 6, i + 1, 1)).square().mean().backward()
        opt.step()
    model.eval()
    ref = model(x)
    exported = wl.to_plain_model(copy.deepcopy(model))
    assert not wl.whitening_layers(exported)
    torch.testing.assert_close(exported(x), ref, rtol=1e-5, atol=1e-5)
    sd = wl.plain_state_dict(model, strict=False)  # the exported architecture's keys (a bias-free conv gains a bias)
    torch.testing.assert_close(torch.func.functional_call(exported, sd, (x,)), ref, rtol=1e-5, atol=1e-5)


def models_block(padding):
    """A grouped conv and a depthwise conv, as in a ResNeXt / MobileNet block."""
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=padding, groups=4), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=padding, groups=8, bias=False))


def test_grouped_diagnostics_plain_and_converted_line_up():
    torch.manual_seed(0)

    def make():
        torch.manual_seed(0)
        return stand_ins.mobilenet_like(width=4)

    data = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    plain = wl.collect_diagnostics(make(), data, targets="all")
    model = wl.convert_model(make(), targets="all", block_size=1)
    model.train()
    for x in data:
        model(x)
    conv = wl.collect_diagnostics(model, data, targets="all")
    assert plain.kappa.keys() == conv.kappa.keys() and len(plain.kappa) == 15
    dw = [n for n, m in model.named_modules() if isinstance(m, wl.GradWhitenConv2d) and m.groups > 1]
    assert len(dw) == 5
    for n in dw:
        assert plain.rho[n] == pytest.approx(1.0) and 0 < plain.kappa[n] <= 1
    layer = wl.layer_diagnostics(model)
    assert all(0 < v <= 1 + 1e-9 for v in layer.kappa.values()) and len(layer.kappa) == 15


# --------------------------------------------------------------------------
# Distributed: grouped statistics summed across ranks
# --------------------------------------------------------------------------
def _grouped_model(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 9, 3, padding=1, groups=3), nn.ReLU(), nn.Conv2d(9, 8, 1),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8),
                          nn.Conv2d(8, 8, 1, groups=4))
    method = "recursive" if strategy == "owner-recursive" else "grad"
    return wl.convert_model(model, method, predicate=lambda n, m: True, block_size=2,
                            fold_strategy="owner" if strategy.startswith("owner") else strategy)


def _grouped_batch(step, rank):
    return correlated(4 + rank, 6, 5, 10 * step + rank, 3)


def _grouped_ranks(rank, world, strategy):
    model = _grouped_model(strategy)
    with torch.no_grad():
        for step in range(4):
            model(_grouped_batch(step, rank))
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("strategy", ["replicated", "owner", "owner-recursive"])
def test_grouped_statistics_are_summed_across_ranks(strategy):
    """2 gloo ranks: bit-identical state on every rank, equal to one process on the global batch."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from dist_utils import run_distributed

    r0, r1 = run_distributed(_grouped_ranks, strategy, world_size=2)
    single = _grouped_model(strategy)
    with torch.no_grad():
        for step in range(4):
            single(torch.cat([_grouped_batch(step, r) for r in range(2)]))
    ref = single.state_dict()
    assert int(r0["0.num_blocks"]) == 2 and tuple(r0["3.whitening_matrix"].shape) == (8, 1, 1)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(r0[key], r1[key]), key
            torch.testing.assert_close(r0[key], value, rtol=1e-4, atol=1e-5)


def test_grouped_layer_takes_an_empty_batch():
    """An empty batch (a rank with no samples left) in training mode: no statistics, no error (it raised in
    the grouped statistics' reshape before issue 22)."""
    layer = wl.GradWhitenConv2d(4, 4, 3, padding=1, groups=2, block_size=2)
    assert layer(torch.randn(0, 4, 5, 5)).shape == (0, 4, 5, 5)
    layer(torch.randn(3, 4, 5, 5) + 1)
    assert int(layer.num_blocks) == 1 and torch.isfinite(layer.whitening_matrix).all()
