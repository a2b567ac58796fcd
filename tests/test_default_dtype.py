"""A layer built without ``dtype`` follows ``torch.get_default_dtype()`` for its state, as ``nn.BatchNorm2d`` does
(issue 80): every public layer class, enumerated from ``whitenlayers.__all__``."""
import inspect

import pytest
import torch
from torch import nn

import whitenlayers as wl

pytestmark = pytest.mark.usefixtures("single_thread")

#: Every public concrete whitening layer (``WhiteningLayer`` itself is the abstract interface, not a module).
LAYERS = sorted(
    (obj for obj in (getattr(wl, name) for name in wl.__all__)
     if inspect.isclass(obj) and issubclass(obj, wl.WhiteningLayer) and issubclass(obj, nn.Module)
     and not inspect.isabstract(obj)),
    key=lambda cls: cls.__name__)
#: The classes with a second feature layout, whitened by the unfolded patches.
PATCHES = [cls for cls in LAYERS if "features" in inspect.signature(cls).parameters]
CASES = [(cls, {}) for cls in LAYERS] + [(cls, {"features": "patches"}) for cls in PATCHES]
IDS = [cls.__name__ + ("-patches" if kw else "") for cls, kw in CASES]


def test_every_public_layer_class_is_covered():
    names = {cls.__name__ for cls in LAYERS}
    assert names >= {"DirectWhiten", "GradWhitenConv1d", "GradWhitenConv2d", "GradWhitenConv3d", "GradWhitenLinear",
                     "RecursiveWhitenConv1d", "RecursiveWhitenConv2d", "RecursiveWhitenConv3d",
                     "RecursiveWhitenLinear"}
    assert PATCHES  # GradWhitenConv2d, RecursiveWhitenConv2d


def _layer(cls, options, **kw):
    torch.manual_seed(0)
    if cls is wl.DirectWhiten:
        return cls(4, block_size=3, **kw)
    if cls.__name__.endswith("Linear"):
        return cls(4, 3, block_size=3, **kw)
    return cls(2, 3, 3, padding=1, block_size=3, **options, **kw)


def _batch(cls, gen, scale=1.0, dtype=torch.float64):
    name = cls.__name__
    shape = ((8, 4, 5, 5) if cls is wl.DirectWhiten else (8, 4) if name.endswith("Linear")
             else (8, 2, 7) if name.endswith("1d") else (8, 2, 5, 5) if name.endswith("2d") else (8, 2, 4, 4, 4))
    return ((torch.randn(shape, generator=gen, dtype=torch.float64) + 1.0) * scale).to(dtype)


def _train(layer, cls, batches, scale=1.0, dtype=torch.float64):
    """``batches`` training steps (a forward, and a backward where the layer has parameters): one block of 3 per
    3 steps is folded."""
    layer.train()
    gen = torch.Generator().manual_seed(1)
    for _ in range(batches):
        out = layer(_batch(cls, gen, scale, dtype))
        if out.requires_grad:
            out.square().mean().backward()
    return layer


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("cls, options", CASES, ids=IDS)
def test_state_follows_the_default_dtype(cls, options, float64_default):
    layer = _layer(cls, options)
    floating = {name: t.dtype for name, t in [*layer.named_buffers(), *layer.named_parameters()]
                if t.is_floating_point()}
    assert "running_mean" in floating and "whitening_matrix" in floating
    assert set(floating.values()) == {torch.float64}, floating
    # as nn.BatchNorm2d does under the same default
    assert {t.dtype for t in nn.BatchNorm2d(3).state_dict().values() if t.is_floating_point()} == {torch.float64}


@pytest.mark.parametrize("cls, options", CASES, ids=IDS)
def test_default_built_layer_folds_as_an_explicit_float64_one(cls, options, float64_default):
    default = _train(_layer(cls, options), cls, 9)
    explicit = _train(_layer(cls, options, dtype=torch.float64), cls, 9)
    assert int(default.num_blocks) == int(explicit.num_blocks) == 3
    assert not torch.equal(default.whitening_matrix, torch.eye(default.whitening_matrix.shape[-1]))  # it moved
    assert torch.equal(default.whitening_matrix, explicit.whitening_matrix)
    a, b = default.state_dict(), explicit.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("cls, options", CASES, ids=IDS)
def test_default_built_layer_folds_float64_data_at_1e20(cls, options, float64_default, recwarn):
    """Its second moments (1e40) overflow float32 but not float64: the block is folded, not dropped."""
    layer = _train(_layer(cls, options), cls, 3, scale=1e20)
    assert int(layer.num_blocks) == 1 and layer.nonfinite_blocks == 0
    assert torch.isfinite(layer.whitening_matrix).all() and torch.isfinite(layer.running_mean).all()
    assert layer.running_mean.abs().min() > 1e19  # the block's mean, ~1e20
    assert not [w for w in recwarn if "non-finite" in str(w.message)]


def test_float32_layer_drops_that_block(float64_default):
    """The control: the same block in a float32 layer (dtype=torch.float32 under the float64 default) overflows
    and is dropped, so the test above would fail for a layer whose state ignored the default."""
    cls = wl.GradWhitenConv2d
    layer = _layer(cls, {}, dtype=torch.float32)
    assert layer.running_mean.dtype == torch.float32
    with pytest.warns(RuntimeWarning, match="non-finite"):
        _train(layer, cls, 3, scale=1e20, dtype=torch.float32)
    assert int(layer.num_blocks) == 0 and layer.nonfinite_blocks == 1
