"""Issue 80, item A: the plain checkpoint of a ``direct`` model with 1x1 conv shortcuts, bias-free unpadded convs
and strided convs, strictly into the original class and back into a converted model."""
import copy

import pytest
import torch
from torch import nn

import whitenlayers as wl

DTYPES = [torch.float32, torch.float64]


def assert_same_function(got, want):
    """Two code paths for one function: equal to the dtype's rounding (the gaps measured here: up to 3 eps of the
    largest output, float32 and float64 alike)."""
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=32 * eps, atol=32 * eps * float(want.detach().abs().max()))


def train_steps(model, steps, shape, seed=1):
    """A few SGD steps on correlated, offset data, so that every layer's ``T`` and ``mu`` are far from the identity
    and zero."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        base = torch.randn((8, 1) + shape[1:], generator=g, dtype=dtype)
        x = base + 0.3 * torch.randn((8,) + shape, generator=g, dtype=dtype) + 2.0
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def inputs(shape, dtype, seed=5):
    return torch.randn((4,) + shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) + 2.0


def direct(net, **kw):
    return wl.convert_model(net, method="direct", block_size=1, **kw)


# --------------------------------------------------------------------------
# A user's BasicBlock with a Sequential(1x1 conv, BatchNorm) shortcut
# --------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """A user's own block: padded 3x3 convs (the first strided) and a bias-free 1x1 conv + BatchNorm shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.short(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BasicBlock(8, 16, 2), BasicBlock(16, 24, 2))
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        return self.fc(self.layers(x).mean((2, 3)))


def make_net(seed, dtype):
    torch.manual_seed(seed)
    return Net().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_direct_model_with_1x1_conv_shortcuts_round_trips_through_its_plain_checkpoint(dtype):
    model = direct(make_net(0, dtype))
    train_steps(model, 3, (3, 16, 16))
    model.eval()
    x = inputs((3, 16, 16), dtype)
    want = model(x)
    with pytest.raises(ValueError, match="padded direct conv") as err:
        wl.plain_state_dict(model)
    assert "'layers.1.conv1'" in str(err.value) and "short" not in str(err.value)  # the shortcuts export exactly
    sd = wl.plain_state_dict(model, strict=False)
    # the shortcut conv stays bias-free: its offset went into its BatchNorm's running mean
    assert "layers.1.short.0.weight" in sd and "layers.1.short.0.bias" not in sd and "layers.2.short.0.bias" not in sd
    assert not torch.equal(sd["layers.1.short.1.running_mean"], model.layers[1].short[1].running_mean)
    for target in (direct(make_net(1, dtype)), copy.deepcopy(model)):  # a fresh conversion, a copy of the same
        assert wl.load_plain_state_dict(target, sd) == ([], [])
        assert_same_function(target.eval()(x), want)
    exported = wl.to_plain_model(copy.deepcopy(model))
    assert type(exported.layers[1].short[0]) is nn.Conv2d and exported.layers[1].short[0].bias is None
    assert_same_function(exported(x), want)


# --------------------------------------------------------------------------
# A block whose only conv is a bias-free unpadded conv followed by a BatchNorm
# --------------------------------------------------------------------------
class ProjectBlock(nn.Module):
    """``x + BN(conv(x))`` with a bias-free unpadded (1x1, or strided 2x2) conv; the identity subsampled to match."""

    def __init__(self, channels, kernel, stride):
        super().__init__()
        self.stride = stride
        self.conv1 = nn.Conv2d(channels, channels, kernel, stride, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x[:, :, ::self.stride, ::self.stride] + self.bn1(self.conv1(x))


def make_projecting(seed, dtype, kernel, stride):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), ProjectBlock(8, kernel, stride)).to(dtype)


@pytest.mark.parametrize("kernel, stride", [(1, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bias_free_unpadded_direct_conv_before_a_batchnorm_exports_strictly_to_the_original_class(
        dtype, kernel, stride):
    model = direct(make_projecting(0, dtype, kernel, stride), block_types=ProjectBlock)
    train_steps(model, 3, (3, 8, 8))
    model.eval()
    x = inputs((3, 8, 8), dtype)
    want = model(x)
    sd = wl.plain_state_dict(model)  # strict: the original's keys, no "1.conv1.bias"
    assert set(sd) == set(make_projecting(1, dtype, kernel, stride).state_dict())
    original = make_projecting(1, dtype, kernel, stride)
    original.load_state_dict(sd, strict=True)
    assert_same_function(original.eval()(x), want)
    # in training mode the BatchNorm's batch mean removes the offset: the two agree there too
    assert_same_function(original.train()(x), copy.deepcopy(model).train()(x))
    # and back into a converted model
    other = direct(make_projecting(2, dtype, kernel, stride), block_types=ProjectBlock)
    assert wl.load_plain_state_dict(other, sd) == ([], [])
    assert_same_function(other.eval()(x), want)


def test_a_hook_on_the_direct_layer_keeps_its_batchnorm_from_taking_the_offset():
    model = direct(make_projecting(0, torch.float64, 1, 1), block_types=ProjectBlock)
    train_steps(model, 2, (3, 8, 8))
    model[1].conv1.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(ValueError, match=r"'1.conv1': a bias-free direct layer .*forward hooks"):
        wl.plain_state_dict(model)


# --------------------------------------------------------------------------
# A bias-free unpadded direct layer that no BatchNorm follows
# --------------------------------------------------------------------------
class Squeeze(nn.Module):
    """``relu(conv(x))``: a bias-free 1x1 conv (grouped or not) with no BatchNorm after it."""

    def __init__(self, cin, cout, groups):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 1, groups=groups, bias=False)

    def forward(self, x):
        return torch.relu(self.conv1(x))


def make_squeezing(seed, dtype, cin, cout, groups):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, cin, 3, padding=1), Squeeze(cin, cout, groups)).to(dtype)


@pytest.mark.parametrize("cin, cout, groups", [(8, 8, 1), (8, 4, 1), (4, 8, 1), (8, 8, 2), (8, 8, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bias_free_direct_conv_without_a_batchnorm_raises_and_round_trips_unstrict(dtype, cin, cout, groups):
    model = direct(make_squeezing(0, dtype, cin, cout, groups), block_types=Squeeze)
    train_steps(model, 3, (3, 8, 8))
    model.eval()
    x = inputs((3, 8, 8), dtype)
    want = model(x)
    with pytest.raises(ValueError, match=r"'1.conv1': a bias-free direct layer whose output is not taken by one "
                                         r"BatchNorm alone.*needs a bias the original lacks"):
        wl.plain_state_dict(model)
    sd = wl.plain_state_dict(model, strict=False)
    assert set(sd) == set(make_squeezing(1, dtype, cin, cout, groups).state_dict()) | {"1.conv1.bias"}
    other = direct(make_squeezing(1, dtype, cin, cout, groups), block_types=Squeeze)
    assert wl.load_plain_state_dict(other, sd) == ([], [])
    assert_same_function(other.eval()(x), want)
    torch.testing.assert_close(other[1].conv1.whiten.whitening_matrix,  # the bias gave back mu, with T = I
                               torch.eye(cin // groups, dtype=dtype).expand_as(other[1].conv1.whiten.whitening_matrix))
    assert_same_function(wl.to_plain_model(copy.deepcopy(other))(x), want)


def test_a_bias_free_direct_linear_layer_round_trips_unstrict():
    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 6, bias=False), nn.ReLU(), nn.Linear(6, 3)).double()

    model = direct(make(0), targets="all", include_stem=True)
    train_steps(model, 3, (3, 2, 2))
    model.eval()
    x = inputs((3, 2, 2), torch.float64)
    want = model(x)
    with pytest.raises(ValueError, match="'1': a bias-free direct layer"):
        wl.plain_state_dict(model)
    sd = wl.plain_state_dict(model, strict=False)
    other = direct(make(1), targets="all", include_stem=True)
    assert wl.load_plain_state_dict(other, sd) == ([], [])
    assert_same_function(other.eval()(x), want)


def test_a_bias_that_no_input_mean_gives_is_an_unexpected_key():
    """4 inputs, 8 outputs: a bias-free 1x1 conv's ``-sum_k W_k mu`` spans 4 of 8 dimensions, so a random bias has no
    place."""
    model = direct(make_squeezing(0, torch.float64, 4, 8, 1), block_types=Squeeze)
    before = copy.deepcopy(model.state_dict())
    sd = make_squeezing(1, torch.float64, 4, 8, 1).state_dict()
    sd["1.conv1.bias"] = torch.randn(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"unexpected keys \['1.conv1.bias'\]"):
        wl.load_plain_state_dict(model, sd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    assert wl.load_plain_state_dict(model, sd, strict=False) == ([], ["1.conv1.bias"])
