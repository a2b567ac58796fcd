"""Checkpoints, copies and pickles (issue 7; docs/robustness.md).

* ``state_dict`` carries a version in its metadata and the partial block in
  ``_extra_state``; resuming from a checkpoint taken in the middle of a block
  (model and SGD state) continues bit-for-bit like the uninterrupted run.
* Older checkpoints (no ``_extra_state``) load and start a fresh block.
* A checkpoint with another channel count fails with an error naming the layer.
* ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` of a layer or of a
  converted model keep the whole behaviour, gradient transform included, and
  the copy shares no state with the original.
"""
from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as Fn

import whitenlayers as wl
from whitenlayers.coordinator import FoldCoordinator

METHODS = ["grad", "recursive", "direct"]
BLOCK = 3


def build(method, seed=0):
    torch.manual_seed(seed)
    model = wl.convert_model(wl.models.cifar_resnet(8, num_classes=4, width=8), method=method, block_size=BLOCK)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    return model, opt


def batch(i, n=6, hw=12):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 3, hw, hw, generator=g) * 1.5 + 0.5, torch.randint(0, 4, (n,), generator=g)


def step(model, opt, i):
    x, y = batch(i)
    opt.zero_grad()
    Fn.cross_entropy(model(x), y).backward()
    opt.step()


def whitening(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, wl.WhiteningLayer)]


def assert_same(a, b, path=""):
    """Recursive bit-for-bit equality of state dicts (tensors, extra-state dicts, numbers)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{path}[{i}]")
    else:
        assert a == b, path


# --------------------------------------------------------------------------
# Versioned state_dict
# --------------------------------------------------------------------------
def test_state_dict_has_version_and_partial_block():
    model, opt = build("grad")
    step(model, opt, 0)
    sd = model.state_dict()
    layers = whitening(model)
    assert len(layers) == 6
    for name, layer in layers:
        assert sd._metadata[name]["version"] == wl.WhiteningLayer._version >= 1
        extra = sd[f"{name}._extra_state"]  # one float64 tensor: layout tag, acc_batches, ..., the block's sums
        assert isinstance(extra, torch.Tensor) and extra.dtype == torch.float64 and extra.dim() == 1
        assert int(extra[0]) == 2 and int(extra[1]) == layer.batches_in_block == 1
        assert extra.numel() == 9 + 2 * layer.num_features + layer.running_cov.numel()
        for buf in ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks"):
            assert f"{name}.{buf}" in sd


# --------------------------------------------------------------------------
# Resume mid-block
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("container", ["state_dict", "plain-dict"])
def test_resume_mid_block_is_bit_for_bit(method, container):
    model, opt = build(method)
    for i in range(4):  # one block and one batch of the next
        step(model, opt, i)
    assert all(layer.batches_in_block == 1 for _, layer in whitening(model))
    sd = model.state_dict()
    if container == "plain-dict":  # what a dict comprehension or some loaders leave: no _metadata
        sd = {k: v for k, v in sd.items()}
    buf = io.BytesIO()
    torch.save({"model": sd, "opt": opt.state_dict()}, buf)
    for i in range(4, 12):  # crosses three folds
        step(model, opt, i)

    resumed, opt2 = build(method, seed=1)  # another init ...
    for i in range(50, 52):  # ... and a partial block of its own, all to be overwritten
        step(resumed, opt2, i)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    for i in range(4, 12):
        step(resumed, opt2, i)
    assert int(whitening(resumed)[0][1].num_blocks) == 4
    assert_same(model.state_dict(), resumed.state_dict())
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(p.grad, q.grad), n
    assert_same(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("version", [0, 1])
def test_pre_release_checkpoint_is_refused_with_its_version(version):
    """A checkpoint of a pre-release layer version (0: without ``_extra_state``) fails, naming the layer and the
    version; a plain layer's checkpoint (nn.Module's version 1) keeps its own message (test_init_and_cast)."""
    model, opt = build("grad")
    for i in range(4):
        step(model, opt, i)
    sd = model.state_dict()
    old = OrderedDict((k, v) for k, v in sd.items() if not k.endswith("_extra_state"))
    old._metadata = copy.deepcopy(sd._metadata)
    for name, _ in whitening(model):
        old._metadata[name]["version"] = version
    fresh, _ = build("grad", seed=3)
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(RuntimeError, match=rf"pre-release whitenlayers \(version {version}\); it cannot be loaded"):
        fresh.load_state_dict(old, strict=False)
    for name, _ in whitening(fresh):
        assert torch.equal(fresh.state_dict()[f"{name}.running_mean"], before[f"{name}.running_mean"]), name


def test_current_checkpoint_without_partial_block_is_rejected_in_strict_mode():
    """Only an *older* checkpoint may lack ``_extra_state``; a current one that lacks it is incomplete."""
    model, _ = build("grad")
    sd = model.state_dict()
    for k in [k for k in sd if k.endswith("_extra_state")]:
        del sd[k]
    fresh, _ = build("grad")
    with pytest.raises(RuntimeError, match="_extra_state"):
        fresh.load_state_dict(sd)


# --------------------------------------------------------------------------
# Wrong channel count
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda c: wl.GradWhitenConv2d(c, 3, 3),
        lambda c: wl.RecursiveWhitenConv2d(c, 3, 3),
        lambda c: wl.GradWhitenLinear(c, 3),
        lambda c: wl.DirectWhiten(c),
    ],
    ids=["grad", "recursive", "linear", "direct"],
)
def test_checkpoint_with_other_channel_count_fails_clearly(make):
    src, dst = make(4), make(5)
    dst.layer_name = "layer2.0.conv1"
    src(torch.randn(2, 4, 5, 5) if not isinstance(src, wl.GradWhitenLinear) else torch.randn(2, 4))
    before = {k: v.clone() for k, v in dst.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(RuntimeError) as info:
        dst.load_state_dict(src.state_dict())
    msg = str(info.value)
    assert "'layer2.0.conv1'" in msg and "4 features" in msg and "has 5" in msg, msg
    for k, v in dst.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, before[k]), k


def test_model_checkpoint_with_other_width_names_the_layer():
    torch.manual_seed(0)
    small = wl.convert_model(wl.models.cifar_resnet(8, width=8), method="grad")
    wide = wl.convert_model(wl.models.cifar_resnet(8, width=12), method="grad")
    with pytest.raises(RuntimeError) as info:
        wide.load_state_dict(small.state_dict())
    assert "'layer1.0.conv1'" in str(info.value) and "has 12" in str(info.value)


# --------------------------------------------------------------------------
# deepcopy / pickle
# --------------------------------------------------------------------------
LAYERS = {
    "grad": lambda: wl.GradWhitenConv2d(4, 3, 3, padding=1, bias=False, block_size=2),
    "recursive": lambda: wl.RecursiveWhitenConv2d(4, 3, 3, padding=1, block_size=2),
    "linear": lambda: wl.GradWhitenLinear(4, 3, block_size=2),
    "direct": lambda: wl.DirectWhiten(4, block_size=2),
}

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": lambda m: torch.load(io.BytesIO(_saved(m)), weights_only=False),
}


def _saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    return buf.getvalue()


def layer_batch(kind, i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(5, 4, 6, 6, generator=g) * torch.tensor([1.0, 3.0, 0.3, 2.0]).view(1, 4, 1, 1) + 1
    return x.mean((2, 3)) if kind == "linear" else x


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("how", sorted(COPIES))
def test_layer_copy_keeps_whole_behaviour(kind, how):
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    for i in range(3):  # a fold, then mid-block
        layer(layer_batch(kind, i))
    clone = COPIES[how](layer)
    assert clone.batches_in_block == 1 and int(clone.num_blocks) == 1
    results = []
    for m in (layer, clone):
        params = list(m.parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
        grads = []
        for i in range(3, 8):
            x = layer_batch(kind, i).requires_grad_(True)
            y = m(x)
            (y * torch.linspace(-1, 1, y.shape[1]).view(1, -1, *([1] * (y.dim() - 2)))).sum().backward()
            grads.append((x.grad.clone(), [p.grad.clone() for p in params]))
            if opt:
                opt.step()
                opt.zero_grad()
        results.append((m.state_dict(), grads))
    assert_same(results[0][0], results[1][0])
    for (gx_a, gp_a), (gx_b, gp_b) in zip(results[0][1], results[1][1]):
        assert torch.equal(gx_a, gx_b)
        for a, b in zip(gp_a, gp_b):
            assert torch.equal(a, b)
    assert int(layer.num_blocks) == 4
    # the transform is not the identity, so equal gradients mean the transform was carried over
    t = layer.grad_transform if hasattr(layer, "grad_transform") else layer.whitening_matrix
    assert (t - torch.eye(4)).abs().max() > 1e-3


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("how", sorted(COPIES))
def test_converted_model_copy_keeps_whole_behaviour_and_shares_nothing(method, how):
    model, opt = build(method)
    for i in range(4):
        step(model, opt, i)
    clone = COPIES[how](model)
    frozen = copy.deepcopy(clone.state_dict())
    # the copy has its own coordinator, installed on the copy and used by the copy's layers
    hooks = [h for h in clone._forward_hooks.values() if isinstance(h, FoldCoordinator)]
    assert len(hooks) == 1
    for (_, a), (_, b) in zip(whitening(model), whitening(clone)):
        assert b._fold_coordinator is hooks[0]
        assert a._fold_coordinator is not hooks[0]
        assert a.whitening_matrix is not b.whitening_matrix
    # training the original leaves the copy alone (EMA / model averaging)
    for i in range(4, 7):
        step(model, opt, i)
    assert_same(clone.state_dict(), frozen)
    # ... and the copy, trained the same way, follows the same path bit-for-bit
    ref, ref_opt = build(method)
    for i in range(4):
        step(ref, ref_opt, i)
    opt_c = torch.optim.SGD(clone.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    opt_c.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (load_state_dict would share the momentum tensors)
    for i in range(4, 10):
        step(ref, ref_opt, i)
        step(clone, opt_c, i)
        blocks = {int(layer.num_blocks) for _, layer in whitening(clone)}
        assert blocks == {(i + 1) // BLOCK}, (i, blocks)  # folds at the right forward
    assert_same(ref.state_dict(), clone.state_dict())
    for p, q in zip(ref.parameters(), clone.parameters()):
        assert torch.equal(p.grad, q.grad)
