"""Centring absorbed by a following BatchNorm (docs/conventions.md; issue 12, lever 1).

A converted layer whose output feeds only a BatchNorm skips its centring offset
while the BatchNorm normalises with batch statistics. These tests hold it to
the centred layer: same training trajectory (float64, tight tolerance), same
eval outputs, an exact export that loads strictly into the original
architecture, and no absorption where the structure does not allow it.
"""
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whitenlayers as wl
from whitenlayers import models

TIGHT = dict(rtol=1e-9, atol=1e-11)  # float64: what rounding differences leave after a few SGD steps


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


def batches(n, *, seed=1, size=16, channels=3, classes=10, batch=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randn(batch, 1, size, size, generator=g, dtype=dtype)
        x = base + 0.3 * torch.randn(batch, channels, size, size, generator=g, dtype=dtype) + 2.0
        out.append((x, torch.randint(0, classes, (batch,), generator=g)))
    return out


def train(model, data, *, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    model.train()
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def resnet(seed=0, depth=20, width=4, dtype=torch.float64):
    torch.manual_seed(seed)
    return models.cifar_resnet(depth, width=width).to(dtype)


def absorbed(model):
    return {n for n, m in wl.whitening_layers(model) if m.centring == "absorbed"}


def assert_same_training_state(a, c):
    """``a`` absorbed, ``c`` centred: every parameter and buffer equal; BN running means differ by ``d``.

    An absorbed layer keeps its bias compensation inside ``absorbed_offset`` (``bias_correction`` is 0 and the
    offset holds ``d - c``), so the centred model's compensation ``c`` is added back before comparing.
    """
    sa, sc = a.state_dict(), c.state_dict()
    comp = {n: sc[f"{n}.bias_correction"] for n, m in wl.whitening_layers(a) if m.centring == "absorbed"}
    offsets = {n: m.absorbed_offset + comp[n] for n, m in wl.whitening_layers(a) if m.centring == "absorbed"}
    for n in comp:
        assert not sa[f"{n}.bias_correction"].any(), n
        sa[f"{n}.bias_correction"] = sc[f"{n}.bias_correction"]
    bn_of = {f"{n}.absorbed_offset": m.centring_batchnorm for n, m in wl.whitening_layers(a) if m.centring == "absorbed"}
    bn_names = {id(m): n for n, m in a.named_modules()}
    shifted = {f"{bn_names[id(bn)]}.running_mean": offsets[k[: -len(".absorbed_offset")]] for k, bn in bn_of.items()}
    assert set(sa) - set(sc) == set(bn_of) and set(sc) <= set(sa)
    for k, v in sc.items():
        if isinstance(v, dict):  # _extra_state: the partial block
            for kk, vv in v.items():
                if torch.is_tensor(vv):
                    torch.testing.assert_close(sa[k][kk], vv, **TIGHT)
                else:
                    assert sa[k][kk] == vv, (k, kk)
        elif not v.is_floating_point():
            assert torch.equal(sa[k], v), k
        elif k in shifted:
            torch.testing.assert_close(sa[k] + shifted[k], v, **TIGHT, msg=k)
        else:
            torch.testing.assert_close(sa[k], v, **TIGHT, msg=k)


# --------------------------------------------------------------------------
# Training trajectories and eval outputs equal the centred layers'
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_resnet20_training_matches_centred_layers(method):
    """ResNet-20 (width 4, float64), 9 steps, block_size 2 (4 folds): losses, parameters, whitening state equal."""
    data = batches(9)
    a = wl.convert_model(resnet(), method=method, block_size=2)
    c = wl.convert_model(resnet(), method=method, block_size=2, absorb_centring=False)
    assert len(absorbed(a)) == 18 and absorbed(c) == set()
    la, lc = train(a, data), train(c, data)
    torch.testing.assert_close(la, lc, **TIGHT)
    layers = wl.whitening_layers(a)
    assert all(int(m.num_blocks) == 4 for _, m in layers)
    # the centring is far from trivial: large means, offsets that moved while training
    assert max(float(m.running_mean.abs().max()) for _, m in layers) > 0.5
    assert max(float(m.absorbed_offset.abs().max()) for _, m in layers) > 0.1
    assert_same_training_state(a, c)
    # eval mode: the same outputs (the running means differ by exactly d, which the absorbed layers add back)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_channels_last_absorbed_layers_match_contiguous_centred_ones(method):
    """A channels_last model's absorbed layers read the weight tap-major for their offset (no copy of the weight):
    the same trajectory, whitening state and eval outputs as contiguous centred layers, up to float64 rounding."""
    data = batches(7)
    a = wl.convert_model(resnet(), method=method, block_size=2).to(memory_format=torch.channels_last)
    c = wl.convert_model(resnet(), method=method, block_size=2, absorb_centring=False)
    assert len(absorbed(a)) == 18
    assert any(m.weight.shape[-1] > 1 and not m.weight.is_contiguous() for _, m in wl.whitening_layers(a))
    la, lc = train(a, data), train(c, data)
    torch.testing.assert_close(la, lc, **TIGHT)
    assert max(float(m.absorbed_offset.abs().max()) for _, m in wl.whitening_layers(a)) > 0.1
    assert_same_training_state(a, c)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x.to(memory_format=torch.channels_last)), c(x), **TIGHT)


def test_without_the_tracked_offset_eval_would_be_wrong():
    """Why the layer keeps ``d``: BN's running mean averages past offsets, not the one in force now."""
    data = batches(9)
    a = wl.convert_model(resnet(depth=8), block_size=2)
    c = wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False)
    train(a, data), train(c, data)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    want = c(x)
    torch.testing.assert_close(a(x), want, **TIGHT)
    for _, m in wl.whitening_layers(a):
        m.absorbed_offset.copy_(m._skipped_offset(m.weight.detach()))  # as if BN had tracked the offset now in force
    assert (a(x) - want).abs().max() > 1e-4


def small_model(kind, momentum, bias, *, whiten=True, dtype=torch.float64):
    """One layer feeding a BatchNorm, then a classifier; ``whiten``: the layer is a whitening layer (block_size 2)."""
    torch.manual_seed(0)
    if kind == "conv":
        layer = nn.Conv2d(3, 6, 3, padding=1, bias=bias, dtype=dtype)
        if whiten:
            layer = wl.GradWhitenConv2d.from_conv(layer, block_size=2)
        body = [layer, nn.BatchNorm2d(6, momentum=momentum, dtype=dtype)]
        head = [nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 10, dtype=dtype)]
    else:
        layer = nn.Linear(3 * 16 * 16, 6, bias=bias, dtype=dtype)
        if whiten:
            layer = wl.RecursiveWhitenLinear.from_linear(layer, block_size=2)
        body = [nn.Flatten(), layer, nn.BatchNorm1d(6, momentum=momentum, dtype=dtype)]
        head = [nn.ReLU(), nn.Linear(6, 10, dtype=dtype)]
    return nn.Sequential(*body, *head)


def the_layer(model):
    return wl.whitening_layers(model)[0][1]


def the_bn(model):
    return next(m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("bias", [False, True])
def test_single_layer_matches_centred(kind, momentum, bias):
    """Conv + BatchNorm2d and linear + BatchNorm1d, with and without bias, exponential or cumulative BN averages."""
    data = batches(7, size=16)
    a, c = small_model(kind, momentum, bias), small_model(kind, momentum, bias)
    the_layer(a).absorb_centring(the_bn(a))
    assert the_layer(a).centring == "absorbed" and the_layer(c).centring == "input"
    torch.testing.assert_close(train(a, data), train(c, data), **TIGHT)
    assert int(the_layer(a).num_blocks) == 3
    assert_same_training_state(a, c)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)
    # the export: the plain layer with the original bias setting, the offset moved into the BN's running mean
    sd = wl.plain_state_dict(a)
    plain = small_model(kind, momentum, bias, whiten=False)
    plain.load_state_dict(sd, strict=True)
    torch.testing.assert_close(plain.eval()(x), c(x), **TIGHT)


def test_frozen_batchnorm_falls_back_to_centring():
    """A BatchNorm in eval mode inside a training model (fine-tuning with frozen BN) does not remove the offset:
    the layer then centres (offset s - d, with its weight-gradient term), and training still matches."""
    data = batches(8)
    a = wl.convert_model(resnet(depth=8), block_size=2)
    c = wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False)
    train(a, data[:4]), train(c, data[:4])

    def freeze(model):
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()

    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.05, momentum=0.9)
    for x, y in data[4:]:
        for model, opt in ((a, opt_a), (c, opt_c)):
            model.train()
            freeze(model)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert_same_training_state(a, c)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)


# --------------------------------------------------------------------------
# Export into the original architecture
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["grad", "recursive"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_state_dict_loads_strictly_into_a_fresh_cifar_resnet(method, dtype):
    model = wl.convert_model(resnet(seed=3, depth=8, dtype=dtype), method=method, block_size=2)
    train(model, batches(5, dtype=dtype))
    assert all(int(m.num_blocks) == 2 for _, m in wl.whitening_layers(model))
    model.eval()
    x = batches(1, seed=5, dtype=dtype)[0][0]
    want = model(x)
    sd = wl.plain_state_dict(model)
    plain = resnet(seed=4, depth=8, dtype=dtype)
    plain.load_state_dict(sd, strict=True)  # no "Unexpected key(s) ... bias"
    tol = TIGHT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.eval()(x), want, **tol)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)  # plain_state_dict leaves the model alone
    # the plain model trains on: in training mode its BatchNorms remove the moved offsets again
    train(plain, batches(1, seed=6, dtype=dtype))


def test_export_model_in_place_keeps_training_outputs():
    """After to_plain_model, a training-mode forward gives the converted model's training-mode output."""
    model = wl.convert_model(resnet(depth=8), block_size=2)
    train(model, batches(4))
    x = batches(1, seed=5)[0][0]
    ref = copy.deepcopy(model)
    for m in wl.whitening_layers(ref):
        m[1].block_size = 10**6  # no fold during the comparison forward
    want = ref.train()(x)
    out = wl.to_plain_model(model).train()(x)
    assert wl.whitening_layers(model) == []
    assert all(type(m) is nn.Conv2d and m.bias is None for m in model.modules() if isinstance(m, nn.Conv2d))
    torch.testing.assert_close(out, want, **TIGHT)


# --------------------------------------------------------------------------
# Detection: conservative
# --------------------------------------------------------------------------
class Block(nn.Module):
    """A residual-block stand-in whose forward is given as a function of (self, x)."""

    def __init__(self, fn, c=4):
        super().__init__()
        self.fn = fn
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.fn(self, x)


BasicBlock = type("BasicBlock", (Block,), {})  # the class name convert_model targets


def convert_block(fn, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(BasicBlock(fn))
    wl.convert_model(model, **kw)
    return model, {n.split(".")[-1] for n in absorbed(model)}


def test_resnet_layouts_absorb_every_block_conv():
    _, found = convert_block(lambda s, x: F.relu(s.bn2(s.conv2(F.relu(s.bn1(s.conv1(x))))) + x))
    assert found == {"conv1", "conv2"}


@pytest.mark.parametrize("fn, expected", [
    # conv -> relu -> bn: the BatchNorm does not see the conv output
    (lambda s, x: s.bn2(s.conv2(s.bn1(F.relu(s.conv1(x))))), {"conv2"}),
    # the conv output is also used elsewhere
    (lambda s, x: (lambda y: s.bn1(y) + y)(s.conv1(x)) + s.bn2(s.conv2(x)), {"conv2"}),
    # pre-activation layout: conv1 feeds bn2, conv2 feeds the residual sum
    (lambda s, x: s.conv2(F.relu(s.bn2(s.conv1(F.relu(s.bn1(x)))))) + x, {"conv1"}),
    # a BatchNorm called twice
    (lambda s, x: s.bn1(s.conv1(x)) + s.bn1(s.conv2(x)), set()),
    # a conv called twice
    (lambda s, x: s.bn1(s.conv1(x)) + s.bn2(s.conv1(x)) + s.conv2(x), set()),
    # in-place change between conv and BN
    (lambda s, x: s.bn1(s.conv1(x).add_(1)) + s.bn2(s.conv2(x)), {"conv2"}),
    # the conv output goes to something else than a BatchNorm
    (lambda s, x: s.bn2(s.conv2(x)) + s.conv1(x).mul(2), {"conv2"}),
])
def test_other_structures_are_not_absorbed(fn, expected):
    model, found = convert_block(fn)
    assert found == expected
    # and the converted model still computes the plain block's function at conversion time
    torch.manual_seed(0)
    plain = BasicBlock(fn)
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(model[0](x.clone()), plain(x.clone()))


def test_untraceable_forward_absorbs_nothing_but_converts():
    def fn(s, x):
        if float(x.sum()) > 1e30:  # data-dependent control flow: torch.fx cannot trace it
            return x
        return s.bn2(s.conv2(s.bn1(s.conv1(x))))

    model, found = convert_block(fn)
    assert found == set() and len(wl.whitening_layers(model)) == 2


def test_forward_hook_on_the_conv_prevents_absorption():
    torch.manual_seed(0)
    model = nn.Sequential(BasicBlock(lambda s, x: s.bn2(s.conv2(s.bn1(s.conv1(x))))))
    model[0].conv1.register_forward_hook(lambda m, i, o: o + 1)
    wl.convert_model(model)
    assert {n.split(".")[-1] for n in absorbed(model)} == {"conv2"}


def test_consumer_found_in_the_caller_and_in_sequential_downsample():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1, bias=False)

        def forward(self, x):
            return self.conv(x)

    class BasicBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.bn = nn.BatchNorm2d(4)
            self.downsample = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4))
            self.other = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.ReLU(), nn.BatchNorm2d(4))

        def forward(self, x):
            return self.bn(self.inner(x)) + self.downsample(x) + self.other(x)

    model = nn.Sequential(BasicBlock())
    wl.convert_model(model)
    assert absorbed(model) == {"0.inner.conv", "0.downsample.0"}
    assert model[0].inner.conv.centring_batchnorm is model[0].bn
    assert model[0].downsample[0].centring_batchnorm is model[0].downsample[1]


def test_switch_off_and_direct_method():
    model = wl.convert_model(resnet(depth=8), absorb_centring=False)
    assert absorbed(model) == set()
    direct = wl.convert_model(resnet(depth=8), method="direct")
    assert not any(hasattr(m, "centring") for _, m in wl.whitening_layers(direct))
    grad = wl.convert_model(resnet(depth=8))
    assert len(absorbed(grad)) == 6
    assert "centring=absorbed" in repr(grad.layer1[0].conv1)
    assert "centring" not in repr(model.layer1[0].conv1)


# --------------------------------------------------------------------------
# The layer switch
# --------------------------------------------------------------------------
def test_absorb_centring_on_and_off_keeps_the_function():
    model = wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False)
    train(model, batches(3))
    x = batches(1, seed=5)[0][0]
    model.eval()
    want = model(x)
    layer, bn = model.layer1[0].conv1, model.layer1[0].bn1
    layer.absorb_centring(bn)  # on: d = 0 makes BN's running mean the centred one
    assert layer.centring == "absorbed" and layer.centring_batchnorm is bn
    assert "absorbed_offset" in layer.state_dict()
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    train(model, batches(3, seed=2))
    model.eval()
    want = model(x)
    rm = bn.running_mean.clone()
    d = layer.absorbed_offset.clone()
    assert d.abs().max() > 0
    layer.absorb_centring(None)  # off: d goes into BN's running mean
    assert layer.centring == "input" and "absorbed_offset" not in layer.state_dict()
    torch.testing.assert_close(bn.running_mean, rm + d, rtol=0, atol=0)
    torch.testing.assert_close(model(x), want, **TIGHT)


def test_absorb_centring_validates_its_argument():
    layer = wl.GradWhitenConv2d(3, 4, 3, bias=False)
    with pytest.raises(TypeError, match="BatchNorm"):
        layer.absorb_centring(nn.GroupNorm(2, 4))
    with pytest.raises(ValueError, match="4 output features.*num_features=5"):
        layer.absorb_centring(nn.BatchNorm2d(5))
    assert layer.centring == "input"
    lin = wl.GradWhitenLinear(3, 4)
    lin.absorb_centring(nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"GradWhitenLinear.*\(B, in_features\)"):
        lin(torch.randn(2, 5, 3))
    assert lin._block.batches == 0  # nothing recorded


# --------------------------------------------------------------------------
# Checkpoints and copies
# --------------------------------------------------------------------------
def test_centred_checkpoint_loads_into_absorbed_model():
    """A checkpoint without ``absorbed_offset`` (saved by centring layers) is exact with d = 0 (kept as ``-c``:
    an absorbed layer holds its compensation in the offset)."""
    c = wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False)
    train(c, batches(3))
    a = wl.convert_model(resnet(seed=1, depth=8), block_size=2)
    a.load_state_dict(c.state_dict(), strict=True)
    for name, m in wl.whitening_layers(a):
        assert not m.bias_correction.any()
        assert torch.equal(m.absorbed_offset, -c.state_dict()[f"{name}.bias_correction"]), name
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)
    # ... and both keep training alike
    data = batches(3, seed=2)
    torch.testing.assert_close(train(a, data), train(c, data), **TIGHT)
    assert_same_training_state(a, c)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_the_pairing(how):
    model = wl.convert_model(resnet(depth=8), block_size=2)
    train(model, batches(3))
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    for (n, m), (_, k) in zip(wl.whitening_layers(model), wl.whitening_layers(clone)):
        bn_name = n.replace("conv", "bn")
        assert m.centring_batchnorm is model.get_submodule(bn_name)
        assert k.centring_batchnorm is clone.get_submodule(bn_name)
    data = batches(3, seed=2)
    torch.testing.assert_close(train(clone, data), train(model, data), rtol=0, atol=0)


# --------------------------------------------------------------------------
# The BatchNorm replaced after the conversion
# --------------------------------------------------------------------------
def test_sync_batchnorm_conversion_after_convert_model_keeps_the_pairing():
    """``convert_sync_batchnorm`` after ``convert_model`` (what the experiment runner does) replaces every
    BatchNorm object; the layers look theirs up in its parent, so they follow (single process: SyncBatchNorm
    normalises like BatchNorm)."""
    data = batches(6)
    a = nn.SyncBatchNorm.convert_sync_batchnorm(wl.convert_model(resnet(depth=8), block_size=2))
    c = nn.SyncBatchNorm.convert_sync_batchnorm(wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False))
    for n, m in wl.whitening_layers(a):
        assert m.centring_batchnorm is a.get_submodule(n.replace("conv", "bn"))
        assert type(m.centring_batchnorm) is nn.SyncBatchNorm
    torch.testing.assert_close(train(a, data), train(c, data), **TIGHT)
    assert_same_training_state(a, c)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)
    sd = wl.plain_state_dict(a)
    plain = nn.SyncBatchNorm.convert_sync_batchnorm(resnet(seed=4, depth=8))
    plain.load_state_dict(sd, strict=True)
    torch.testing.assert_close(plain.eval()(x), c(x), **TIGHT)


class FrozenBN(nn.Module):
    """A non-BatchNorm module that normalises with fixed statistics (as detectron2's FrozenBatchNorm2d)."""

    def __init__(self, bn):
        super().__init__()
        for k in ("weight", "bias", "running_mean", "running_var"):
            self.register_buffer(k, getattr(bn, k).detach().clone())
        self.eps = bn.eps

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        return x * scale.view(1, -1, 1, 1) + (self.bias - self.running_mean * scale).view(1, -1, 1, 1)


def test_batchnorm_replaced_by_a_frozen_module_gets_the_centred_output():
    data = batches(5)
    a = wl.convert_model(resnet(depth=8), block_size=2)
    c = wl.convert_model(resnet(depth=8), block_size=2, absorb_centring=False)
    train(a, data[:3]), train(c, data[:3])
    for model in (a, c):
        for block in (model.layer1[0], model.layer2[0]):
            block.bn1 = FrozenBN(block.bn1)
    assert type(a.layer1[0].conv1.centring_batchnorm) is FrozenBN and a.layer1[0].conv1.centring == "absorbed"
    torch.testing.assert_close(train(a, data[3:]), train(c, data[3:]), **TIGHT)
    a.eval(), c.eval()
    x = batches(1, seed=5)[0][0]
    torch.testing.assert_close(a(x), c(x), **TIGHT)
    # switching off with no BatchNorm there keeps the function through the bias compensation
    want = a(x)
    layer = a.layer1[0].conv1
    c_before = layer.bias_correction.clone()
    d = layer.absorbed_offset.clone()
    layer.absorb_centring(None)
    torch.testing.assert_close(layer.bias_correction, c_before - d)
    torch.testing.assert_close(a(x), want, **TIGHT)
    # and the export stays exact (that layer exports with a bias, the others move their offset into their BN)
    torch.testing.assert_close(wl.to_plain_model(a)(x), want, **TIGHT)


def test_absorb_centring_parent_must_hold_the_batchnorm():
    layer = wl.GradWhitenConv2d(3, 4, 3, bias=False)
    bn = nn.BatchNorm2d(4)
    with pytest.raises(ValueError, match="parent must hold the BatchNorm"):
        layer.absorb_centring(bn, parent=nn.Sequential(nn.BatchNorm2d(4)))
    parent = nn.Sequential(layer, bn)
    layer.absorb_centring(bn, parent=parent)
    assert layer.centring_batchnorm is bn
    parent[1] = nn.BatchNorm2d(4)
    assert layer.centring_batchnorm is parent[1]


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_absorbed_offset_follows_a_weight_whose_memory_moved(channels_last):
    """The absorbed offset's update reads the weight's rows as sliced once per weight; a weight moved to new
    memory (``param.data = ...``, as loaders and wrappers do) is sliced again, not read from the old memory."""
    torch.manual_seed(0)
    model = wl.convert_model(models.cifar_resnet(8, num_classes=10, width=4), "grad", block_size=1).double()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model(x)
    twin(x)  # the rows are sliced once here; a fold: a mean in force, so the offset depends on the weight
    with torch.no_grad():
        for (_, a), (_, b) in zip(wl.whitening_layers(model), wl.whitening_layers(twin)):
            a.weight.mul_(2)  # in place: the same memory
            b.weight.data = b.weight.data * 2  # new memory, the same values
    model(x)
    twin(x)
    for (name, a), (_, b) in zip(wl.whitening_layers(model), wl.whitening_layers(twin)):
        assert a.centring == "absorbed" and a.running_mean.abs().max() > 0
        assert torch.equal(a.absorbed_offset, b.absorbed_offset), name
