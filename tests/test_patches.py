"""Patch whitening (``features="patches"``): the unfolded ``C k^2`` patch as the feature vector (whitenlayers.patches).

The central property mirrors tests/test_layers.py's: a ``GradWhitenConv2d(features="patches")`` with weights
``W_flat T`` trained by SGD equals ``Unfold -> DirectWhiten(C k^2) -> linear map W_flat`` step after step.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_layers import random_transform  # the same SPD transforms as the per-channel property
from torch import nn

import whitenlayers as wl
from whitenlayers.patches import PATCH_MAX_FEATURES, patch_padding

PATCH_CONVS = [wl.GradWhitenConv2d, wl.RecursiveWhitenConv2d]


class UnfoldDirect(nn.Module):
    """The reference: unfold (zero padding) -> DirectWhiten on the C k^2 features -> W_flat, as a conv's output."""

    def __init__(self, direct, weight, bias, k, stride, pad):
        super().__init__()
        self.direct, self.k, self.stride, self.pad = direct, k, stride, pad
        self.weight = nn.Parameter(weight.flatten(1).clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    def forward(self, x):
        u = Fn.unfold(x, self.k, padding=self.pad, stride=self.stride)  # (B, C k^2, L)
        z = torch.einsum("sf,bfl->bsl", self.weight, self.direct(u))
        if self.bias is not None:
            z = z + self.bias.view(1, -1, 1)
        side = (x.shape[-1] + 2 * self.pad - self.k) // self.stride + 1
        return z.view(x.shape[0], -1, side, side)


@settings(max_examples=12, deadline=None)
@given(
    c=st.integers(1, 3),
    s=st.integers(1, 4),
    k=st.sampled_from([1, 2, 3]),
    stride=st.sampled_from([1, 2]),
    pad=st.integers(0, 2),
    bias=st.booleans(),
    nesterov=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_patch_grad_whitening_equals_direct_whitening_of_unfolded_input(c, s, k, stride, pad, bias, nesterov, seed):
    torch.manual_seed(seed)
    dt = torch.float64
    m = c * k * k
    t = random_transform(m, seed)
    mu = torch.randn(m, dtype=dt)
    big = 10**9  # fixed statistics: no fold during the test
    direct = wl.DirectWhiten(m, block_size=big, dtype=dt)
    direct.whitening_matrix.copy_(t)
    direct.running_mean.copy_(mu)
    w = torch.randn(s, c, k, k, dtype=dt) * 0.3
    b = torch.randn(s, dtype=dt) if bias else None
    ref = UnfoldDirect(direct, w, b, k, stride, pad)

    gw = wl.GradWhitenConv2d(c, s, k, stride=stride, padding=pad, bias=bias, dtype=dt, block_size=big,
                             features="patches")
    assert gw.num_features == m and gw.whitening_matrix.shape == (m, m)
    with torch.no_grad():
        gw.weight.copy_((ref.weight @ t).view_as(gw.weight))
        if bias:
            gw.bias.copy_(ref.bias)
    gw.running_mean.copy_(mu)
    gw.grad_transform.copy_(t.t() @ t)

    opt_kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    opt_d = torch.optim.SGD(ref.parameters(), **opt_kw)
    opt_g = torch.optim.SGD(gw.parameters(), **opt_kw)
    size = k + 3
    for _ in range(4):
        x = torch.randn(3, c, size, size, dtype=dt) + 0.5
        out_d, out_g = ref(x), gw(x)
        torch.testing.assert_close(out_g, out_d, rtol=1e-9, atol=1e-9)
        target = torch.randn_like(out_d)
        for out, opt in ((out_d, opt_d), (out_g, opt_g)):
            opt.zero_grad()
            ((out - target) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(gw.weight.flatten(1), ref.weight @ t, rtol=1e-9, atol=1e-9)


def test_patch_equivalence_detects_a_per_channel_transform():
    """Sharpness: the per-channel gradient transform (Q on C per tap) is not the patch one."""
    torch.manual_seed(0)
    c, k, dt = 2, 3, torch.float64
    t = random_transform(c * k * k, 1)
    gw = wl.GradWhitenConv2d(c, 2, k, padding=1, bias=False, dtype=dt, block_size=10**9, features="patches")
    gw.grad_transform.copy_(t.t() @ t)
    gw.weight.grad = None
    x = torch.randn(4, c, 6, 6, dtype=dt)
    gw(x).square().mean().backward()
    plain = nn.Conv2d(c, 2, k, padding=1, bias=False, dtype=dt)
    plain.weight.data.copy_(gw.weight.data)
    plain(x).square().mean().backward()
    torch.testing.assert_close(gw.weight.grad.flatten(1), plain.weight.grad.flatten(1) @ (t.t() @ t))
    assert not torch.allclose(gw.weight.grad.flatten(1), plain.weight.grad.flatten(1), atol=1e-6)


@pytest.mark.parametrize("cls", PATCH_CONVS)
def test_patch_statistics_are_those_of_the_unfolded_zero_padded_input(cls):
    torch.manual_seed(0)
    dt = torch.float64
    x = torch.randn(16, 2, 6, 6, dtype=dt) * torch.tensor([1.0, 3.0], dtype=dt).view(1, 2, 1, 1) + 2
    layer = cls(2, 3, 3, padding=1, stride=2, block_size=1, dtype=dt, features="patches")
    layer(x)
    u = Fn.unfold(x, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 18)
    torch.testing.assert_close(layer.running_mean, u.mean(0))
    assert int(layer.num_blocks) == 1 and layer.grad_transform.shape == (18, 18)
    assert not torch.allclose(layer.grad_transform, torch.eye(18, dtype=dt))


@pytest.mark.parametrize("cls", PATCH_CONVS)
@pytest.mark.parametrize("bias", [True, False])
def test_patch_layer_keeps_its_function_across_folds_and_exports_exactly(cls, bias):
    """A mean update is compensated (the layer's function is unchanged by a fold) and to_conv is exact."""
    torch.manual_seed(0)
    dt = torch.float64
    layer = cls(1, 4, 3, padding=1, bias=bias, block_size=2, dtype=dt, features="patches")
    probe = torch.randn(5, 1, 8, 8, dtype=dt) + 1
    for i in range(6):
        x = torch.randn(8, 1, 8, 8, dtype=dt) * (1 + i) + 3
        layer.eval()
        before = layer(probe)
        layer.train()
        layer(x)
        layer.eval()
        torch.testing.assert_close(layer(probe), before, rtol=1e-9, atol=1e-9)  # no step: only folds happened
    assert int(layer.num_blocks) == 3
    conv = layer.to_conv()
    torch.testing.assert_close(conv(probe), layer(probe), rtol=1e-12, atol=1e-12)


def test_patch_layer_trains_in_a_converted_model_and_round_trips():
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=8), block_size=2, include_stem=True, stem_patches=True)
    stem = model.conv1
    assert isinstance(stem, wl.GradWhitenConv2d) and stem.features == "patches" and stem.num_features == 27
    assert "features='patches'" in repr(stem)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(4):
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
        opt.zero_grad()
        Fn.cross_entropy(model(x), y).backward()
        opt.step()
    assert int(stem.num_blocks) == 2 and stem.nonfinite_blocks == 0
    clone = copy.deepcopy(model)
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(4, 3, 16, 16)
    model.eval(), clone.eval(), again.eval()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
    plain = wl.to_plain_model(copy.deepcopy(model))
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)
    fresh = wl.convert_model(wl.models.cifar_resnet(8, width=8), block_size=2, include_stem=True, stem_patches=True)
    fresh.load_state_dict(model.state_dict())
    fresh.eval()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_stem_patches_arguments_are_validated():
    with pytest.raises(ValueError, match="include_stem=True"):
        wl.convert_model(wl.models.cifar_resnet(8, width=8), stem_patches=True)
    with pytest.raises(ValueError, match="direct"):
        wl.convert_model(wl.models.cifar_resnet(8, width=8), method="direct", include_stem=True, stem_patches=True)
    wide = nn.Sequential(nn.Conv2d(64, 8, 5), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 1))
    assert 64 * 25 > PATCH_MAX_FEATURES
    with pytest.raises(ValueError, match="max_features"):
        wl.convert_model(wide, targets="all", include_stem=True, stem_patches=True)
    model = wl.convert_model(wide, targets="all", include_stem=True, stem_patches=True, max_features=2000)
    assert model[0].features == "patches" and model[2].features == "channels"


def test_patch_layer_arguments_are_validated():
    with pytest.raises(ValueError, match="features must be one of"):
        wl.GradWhitenConv2d(2, 2, 3, features="pixels")
    with pytest.raises(ValueError, match="groups=1"):
        wl.GradWhitenConv2d(2, 2, 3, groups=2, features="patches")
    with pytest.raises(ValueError, match="padding_mode"):
        wl.GradWhitenConv2d(2, 2, 3, padding=1, padding_mode="reflect", features="patches")
    with pytest.raises(ValueError, match="asymmetrically"):
        wl.GradWhitenConv2d(2, 2, 2, padding="same", features="patches")
    assert patch_padding((3, 3), (1, 1), "same") == (1, 1) and patch_padding((3, 5), (2, 1), "valid") == (0, 0)
    layer = wl.GradWhitenConv2d(2, 3, 3, padding="same", features="patches", block_size=1)
    assert layer(torch.randn(2, 2, 5, 5)).shape == (2, 3, 5, 5)
    with pytest.raises(ValueError, match="expected 2 input channels"):
        layer(torch.randn(2, 18, 5, 5))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("cls", PATCH_CONVS)
def test_patch_layer_under_activation_checkpointing_trains_like_the_plain_run(cls, reentrant):
    """The recomputed forward gathers no patch statistics and uses the transform of the original forward."""
    from torch.utils.checkpoint import checkpoint

    dt = torch.float64
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(cls(1, 4, 3, padding=1, bias=False, block_size=2, dtype=dt, features="patches"),
                            nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 3, dtype=dt))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = (torch.randn(8, 1, 6, 6, generator=g, dtype=dt) * 2 + 1).requires_grad_(reentrant)  # reentrant needs it
            y = torch.randint(0, 3, (8,), generator=g)
            out = checkpoint(net, x, use_reentrant=reentrant) if ckpt else net(x)
            opt.zero_grad()
            Fn.cross_entropy(out, y).backward()
            opt.step()
        runs.append(net)
    plain, ckpt = runs
    assert int(ckpt[0].num_blocks) == 2 and ckpt[0].batches_in_block == 1
    for a, b in zip(list(plain.state_dict().values()), list(ckpt.state_dict().values())):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
