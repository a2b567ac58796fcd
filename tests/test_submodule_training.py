"""Training a converted model through one of its sub-modules (a backbone, a neck, ``model.features``), never the
root's forward: each layer folds at its own block's end (no root forward's end folds it), with the weight of the
forward that ended the block, as the root's end would. The model then trains and evaluates as one called through its
root, absorbed centring included. A fold left pending (the root's forward traced by ``torch.export``, whose end folds
nothing) is folded at the layer's next forward, before it reads its buffers.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_versions import needs

import whitenlayers as wl
from whitenlayers import models

TOL = dict(rtol=1e-9, atol=1e-10)  # float64: rounding of a layer folded alone vs with the others (batched eigh)


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)
#: torch.jit.trace records the layers' shape checks (channels, a kernel's taps, a 1x1 kernel; BatchNorm's batch
#: size in training mode) as constants: fixed by the layer and the traced input's shape, so its TracerWarnings about
#: them are expected.
TRACED_SHAPE_CHECKS = pytest.mark.filterwarnings(
    "ignore:Converting a tensor to a Python boolean might cause the trace to be incorrect:torch.jit.TracerWarning")


def _batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 12, 12, generator=g, dtype=torch.float64) * 2 + 0.5


def _base(depth=20):
    torch.manual_seed(0)
    return models.cifar_resnet(depth, width=4).to(torch.float64)


def _features(net, x):
    """The backbone without the head: what a detection neck or a contrastive loss would train through."""
    return net.layer2(net.layer1(F.relu(net.bn1(net.conv1(x)))))


def _train_features(net, steps, lr=0.05):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    for s in range(steps):
        opt.zero_grad()
        _features(net, _batch(s)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("method", ["grad", "recursive"])
@pytest.mark.parametrize("steps", [5, 6])  # 6: the last training forward ends a block, folded by the eval forward
def test_absorbed_centring_follows_the_mean_through_a_submodule(method, steps):
    base = _base()
    absorbed = wl.convert_model(copy.deepcopy(base), method, block_size=3)
    centred = wl.convert_model(copy.deepcopy(base), method, block_size=3, absorb_centring=False)
    assert any(layer.centring == "absorbed" for _, layer in wl.whitening_layers(absorbed))
    for net in (absorbed, centred):
        _train_features(net, steps)
    absorbed.eval()
    centred.eval()
    x = _batch(100)
    with torch.no_grad():
        a, c = _features(absorbed, x), _features(centred, x)
    assert c.abs().mean() > 0.1
    torch.testing.assert_close(a, c, **TOL)


def test_a_model_inside_a_container_trains_through_its_own_forward():
    base = _base()
    held = nn.ModuleList([copy.deepcopy(base)])
    wl.convert_model(held, "grad", block_size=3)
    centred_held = nn.ModuleList([copy.deepcopy(base)])
    wl.convert_model(centred_held, "grad", block_size=3, absorb_centring=False)
    net, centred = held[0], centred_held[0]
    for model in (net, centred):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(7):
            opt.zero_grad()
            model(_batch(s)).logsumexp(1).mean().backward()
            opt.step()
    net.eval()
    centred.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(_batch(50)), centred(_batch(50)), **TOL)


def test_submodule_forwards_fold_where_the_root_would():
    """Forwards only (no weight change): each batch through a sub-module is computed with the transform the same
    model called through its root uses for it, and the layers end with the root-called model's buffers."""
    base = _base()
    root = wl.convert_model(copy.deepcopy(base), "grad", block_size=2)
    sub = wl.convert_model(copy.deepcopy(base), "grad", block_size=2)
    seen = []
    root.layer2.register_forward_hook(lambda module, inputs, output: seen.append(output.detach()))
    for s in range(8):
        x = _batch(s)
        root(x)  # the root's end folds the layers whose block ended
        torch.testing.assert_close(_features(sub, x), seen[-1], **TOL)
    first = sub.layer1[0].conv1
    assert int(first.num_blocks) == 4 and not first._block.fold_pending  # each layer folded at its block's end
    sub.eval()
    root.eval()
    with torch.no_grad():
        torch.testing.assert_close(_features(sub, _batch(9)), _features(root, _batch(9)), **TOL)
    for (name, a), b in zip(sub.named_modules(), root.modules()):
        if isinstance(a, wl.WhiteningLayer) and name.startswith(("layer1", "layer2")):
            for key in ("running_mean", "grad_transform", "bias_correction", "num_blocks"):
                torch.testing.assert_close(getattr(a, key), getattr(b, key), **TOL, msg=f"{name}.{key}")


def _pending_after_an_export():
    model = wl.convert_model(_base(8), "grad", block_size=3)  # a ResNet-8: each export traces 6 whitening layers, not 18
    for s in range(5):
        model(_batch(s))
    # the 6th forward ends a block; its end folds nothing while exporting (non-strict: the default from torch 2.13)
    torch.export.export(model, (_batch(5),), strict=False)
    assert model.layer1[0].conv1._block.fold_pending
    return model.eval()


@TRACED_SHAPE_CHECKS
@needs((2, 6), "torch.export of a training-mode forward")
def test_jit_trace_with_a_fold_pending_folds_outside_the_trace():
    model = _pending_after_an_export()
    x = _batch(7, n=2)
    with torch.no_grad():
        traced = torch.jit.trace(model, x)  # its check run traces again: the graphs must agree
        assert not model.layer1[0].conv1._block.fold_pending
        torch.testing.assert_close(traced(x), model(x), **TOL)


@needs((2, 6), "torch.export of a training-mode forward")
def test_torch_export_with_a_fold_pending():
    """The root's forward hook folds no pending layer while torch.export traces (under fake tensors it cannot);
    the next eager forward does, and the exported program reads the buffers it writes in place."""
    model = _pending_after_an_export()
    x = _batch(7, n=2)
    exported = torch.export.export(model, (x,), strict=False)
    with torch.no_grad():
        y = model(x)
    assert not model.layer1[0].conv1._block.fold_pending
    torch.testing.assert_close(exported.module()(x), y, **TOL)


@pytest.mark.skipif(not needs((2, 6), "").args[0], reason="torch >= 2.6 exports a training-mode forward")
def test_an_older_torch_says_it_cannot_export_a_training_mode_forward():
    model = wl.convert_model(_base(8), "grad", block_size=3)
    with pytest.raises(RuntimeError, match=r"torch.export of a training-mode forward.*needs torch >= 2.6.*model.eval"):
        torch.export.export(model, (_batch(0),), strict=False)
