"""``defer_grad_transform``: the weight-gradient transform at the optimizer's step trains like the default.

The default multiplies a weight gradient by ``Q_s`` in the backward; the deferral multiplies the same gradient by
the same ``Q_s`` at the step. These are two code paths: the gradient may reach the product in another layout (on a
GPU, a channels_last gradient against the parameter's), which picks another kernel, and under DDP the product comes
after the all-reduce instead of before it. So the comparisons allow some ulps of float64, derived from its ``eps``.
Measured gaps on a 2-core AMD EPYC: 0 for one process (same kernel, same tensor), 8.9e-16 for DDP. ``GRAD_ATOL``
applies to gradients (|g| <= 0.05 here) and ``STATE_ATOL`` to a model after 12 SGD steps (|w| <= 4.5), where a
difference of a few ulps per step can grow.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whitenlayers as wl
import whitenlayers.deferred as deferral_module
from dist_utils import run_distributed

DT = torch.float64
EPS = torch.finfo(DT).eps
GRAD_ATOL = 2**8 * EPS  # 5.7e-14
STATE_ATOL = 2**12 * EPS  # 9.1e-13


def _model(method: str, seed: int = 0, groups: int = 1, **kw) -> nn.Module:
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 8, 3, padding=1, bias=False, groups=groups), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(DT)
    return wl.convert_model(base, method, block_size=3, targets="all", include_stem=True, **kw)


def _batches(n: int, seed: int = 1, batch: int = 8):
    """Inputs with correlated channels (a fixed mixing), so that ``Q_s`` is far from the identity."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.tensor([[1.0, 0.9, 0.0], [0.0, 0.5, 0.8], [0.3, 0.0, 0.2]], dtype=DT)
    return [(torch.einsum("bchw,cd->bdhw", torch.randn(batch, 3, 6, 6, generator=g, dtype=DT), mix) * 2 + 0.5,
             torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, batches, defer: bool, micro: int = 1) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    deferral = wl.defer_grad_transform(model, opt) if defer else None
    for i in range(0, len(batches), micro):
        opt.zero_grad()
        for x, y in batches[i : i + micro]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    if deferral is not None:
        deferral.remove()
    return model


def _assert_same_training(a: nn.Module, b: nn.Module, atol: float = STATE_ATOL) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if sa[k].is_floating_point():
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("method, kw", [("grad", {}), ("recursive", {}), ("grad", {"stem_patches": True}),
                                        ("recursive", {"groups": 2})], ids=["grad", "recursive", "patches", "grouped"])
def test_deferred_transform_trains_like_the_default(method, kw):
    """12 SGD steps with momentum, a fold every 3 (the transform changes between steps): the same model. Also a
    patch-whitened stem (``Q_s`` on the flattened ``C k^2`` axis) and a grouped conv (block-diagonal ``Q_s``)."""
    batches = _batches(12)
    a = _train(_model(method, **kw), batches, defer=False)
    b = _train(_model(method, **kw), batches, defer=True)
    assert b[0].features == ("patches" if kw.get("stem_patches") else "channels")
    assert b[3].groups == kw.get("groups", 1)
    assert all(int(layer.num_blocks) == 4 for _, layer in wl.whitening_layers(b))
    # the comparison has teeth: Q_s is far from the identity, and training without any transform differs
    q = b[0].grad_transform
    assert (q - torch.eye(q.shape[0], dtype=DT)).abs().max() > 0.05
    _assert_same_training(a, b)
    c = _model(method, **kw)
    for _, layer in wl.whitening_layers(c):
        layer.__dict__["_deferred_grad"] = True  # deferred, but never transformed: not the same training
    _train(c, batches, defer=False)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


def test_accumulated_gradients_with_blocks_on_step_boundaries():
    """Two backward passes per step and ``accumulation_steps=2``: blocks end on step boundaries, so every micro-
    batch of a step has the same ``Q_s``, and the deferral's one product per step equals the default's two."""
    batches = _batches(12)
    a = _train(_model("grad", accumulation_steps=2), batches, defer=False, micro=2)
    b = _train(_model("grad", accumulation_steps=2), batches, defer=True, micro=2)
    assert all(int(layer.num_blocks) == 2 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)


def test_gradients_between_backward_and_step_are_the_plain_ones():
    model = _model("grad")
    x, y = _batches(1)[0]
    for _ in range(3):  # a fold: Q_s is no longer the identity
        model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)  # not deferred: transforms in the backward
    with wl.defer_grad_transform(model, opt):
        F.cross_entropy(model(x), y).backward()
        raw = model[0].weight.grad.clone()
        F.cross_entropy(reference(x), y).backward()
        layer = model[0]
        expected = wl.functional.transform_weight_grad(raw, layer.grad_transform)
        torch.testing.assert_close(reference[0].weight.grad, expected, rtol=0, atol=GRAD_ATOL)
        assert (raw - expected).abs().max() > 1e-6
        opt.step()  # the pre-hook transforms in place
        torch.testing.assert_close(model[0].weight.grad, expected, rtol=0, atol=GRAD_ATOL)
    # removed: the backward transforms again (as a copy does, which is never deferred)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=0, atol=GRAD_ATOL)


def test_copies_are_not_deferred_and_remove_transforms_what_waits():
    model = _model("recursive")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deferral = wl.defer_grad_transform(model, opt)
    assert not copy.deepcopy(model)[0].__dict__.get("_deferred_grad")  # no optimizer of the deferral steps a copy
    x, y = _batches(1)[0]
    for _ in range(3):
        model(x)
    F.cross_entropy(model(x), y).backward()
    raw = model[0].weight.grad.clone()
    deferral.remove()  # a gradient waiting for its transform gets it now
    expected = wl.functional.transform_weight_grad(raw, model[0].grad_transform)
    torch.testing.assert_close(model[0].weight.grad, expected, rtol=0, atol=GRAD_ATOL)
    assert not model[0].__dict__.get("_deferred_grad")


def test_bad_uses_are_refused_with_the_reason():
    model = _model("grad")
    with pytest.raises(ValueError, match="needs the optimizers"):
        wl.defer_grad_transform(model)
    with pytest.raises(ValueError, match="no grad or recursive whitening layer"):
        wl.defer_grad_transform(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    head = torch.optim.SGD(model[-1].parameters(), lr=0.1)  # steps the linear head only
    with pytest.raises(ValueError, match="no optimizer given steps the weight of 2 whitening layer"):
        wl.defer_grad_transform(model, head)
    x, y = _batches(1)[0]
    # a gradient that is not the weight's shape (FSDP1's flat shard of it) is refused at the step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with wl.defer_grad_transform(model, opt):
        F.cross_entropy(model(x), y).backward()
        layer = model[0]
        shard = torch.nn.Parameter(layer.weight.detach().flatten()[:10].clone())  # as a sharded wrapper holds it
        shard.grad = torch.zeros(10, dtype=DT)
        weight = layer._parameters["weight"]
        layer._parameters["weight"] = shard
        try:
            with pytest.raises(RuntimeError, match=r"needs the full weight gradient.*shape \(10,\)"):
                deferral_module.transform_gradients([layer])
        finally:
            layer._parameters["weight"] = weight


def _train_with_closures(model: nn.Module, batches, defer: bool, how: str) -> nn.Module:
    """``opt.step(closure)``: SGD with momentum, the closure passed by position or keyword, or LBFGS (several calls
    of the closure per step)."""
    if how == "lbfgs":
        opt: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    deferral = wl.defer_grad_transform(model, opt) if defer else None
    calls = 0
    for x, y in batches:
        def closure():
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure=closure) if how == "keyword" else opt.step(closure)
    assert calls > len(batches) if how == "lbfgs" else calls == len(batches)
    if deferral is not None:
        deferral.remove()
    return model


@pytest.mark.parametrize("how", ["positional", "keyword", "lbfgs"])
def test_closure_steps_train_like_the_default(how):
    """A step with a closure computes the gradients inside the step, after the step's pre-hook: each call of the
    closure transforms what its backward left. LBFGS calls it several times per step (and each call is a training
    forward: folds fall inside the steps); the comparison fails if the closure's gradients are not transformed."""
    batches = _batches(6)
    a = _train_with_closures(_model("grad"), batches, defer=False, how=how)
    b = _train_with_closures(_model("grad"), batches, defer=True, how=how)
    assert all(int(layer.num_blocks) >= 2 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)
    c = _model("grad")
    for _, layer in wl.whitening_layers(c):
        layer.__dict__["_deferred_grad"] = True  # deferred, but never transformed: not the same training
    _train_with_closures(c, batches, defer=False, how=how)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


def test_lightning_automatic_optimization_trains_like_the_default(tmp_path):
    """Lightning steps every optimizer with a closure (its training step, backward and gradient clipping): with
    the deferral set up in ``configure_optimizers`` it trains like the default. The clipping threshold is not
    reached here: clipping sees the untransformed gradients, so a reached threshold clips another norm than the
    default's (docs/training.md)."""
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self, defer: bool) -> None:
            super().__init__()
            self.net, self.defer = _model("grad"), defer

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if self.defer:
                self.deferral = wl.defer_grad_transform(self.net, opt)
            return opt

    data = _batches(6)
    loader = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*data)])), batch_size=8)

    def fit(defer: bool) -> nn.Module:
        module = Module(defer)
        L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                  gradient_clip_val=10.0).fit(module, loader)
        return module.net

    a, b = fit(False), fit(True)
    assert all(int(layer.num_blocks) == 2 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)


def _ddp_deferred(rank: int, world: int, defer: bool) -> dict:
    torch.manual_seed(0)
    model = _model("grad")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    deferral = wl.defer_grad_transform(ddp, opt) if defer else None
    for x, y in _batches(9, batch=8):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        F.cross_entropy(ddp(xs), ys).backward()
        opt.step()
    if deferral is not None:
        deferral.remove()
    # parameters and the whitening state (BatchNorm's running statistics are each rank's own under DDP)
    keep = {f"{name}.{b}" for name, layer in wl.whitening_layers(model) for b, _ in layer.named_buffers()}
    return {k: v.clone() for k, v in model.state_dict().items() if k in keep or k in dict(model.named_parameters())}


@pytest.mark.slow
def test_ddp_deferred_is_bit_identical_across_ranks_and_trains_like_the_default():
    deferred = run_distributed(_ddp_deferred, True)
    default = run_distributed(_ddp_deferred, False)
    for k in deferred[0]:
        assert torch.equal(deferred[0][k], deferred[1][k]), k
        if deferred[0][k].is_floating_point():
            # the default transforms each rank's gradient before the all-reduce, the deferral the reduced one
            torch.testing.assert_close(deferred[0][k], default[0][k], rtol=0, atol=STATE_ATOL,
                                       msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_scaler_steps_the_deferred_transform_like_the_default(set_to_none):
    """``GradScaler.step`` unscales the gradients and checks them for infinities, then calls ``optimizer.step()``,
    whose pre-hook transforms them. The default transforms the scaled gradients in the backward instead: both are
    linear, so the updates agree to float32 rounding (a training loop with the scaler runs unchanged).

    The third step's loss is infinite, so the scaler skips that step (no pre-hook runs), and its forward ends a
    block: the next step's gradient must get the new ``Q_s``, also when ``zero_grad(set_to_none=False)`` leaves the
    gradients in place (a deferral that kept the ``Q_s`` of the first forward since the gradient was cleared took
    the skipped step's)."""
    batches = _batches(6)

    def run(defer: bool) -> nn.Module:
        model = _model("grad").float()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        deferral = wl.defer_grad_transform(model, opt) if defer else None
        for i, (x, y) in enumerate(batches):
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x.float()), y) * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() == 2.0**9  # the one skipped step halved it
        if deferral is not None:
            deferral.remove()
        return model

    a, b = run(False), run(True)
    assert all(int(layer.num_blocks) == 2 for _, layer in wl.whitening_layers(b))
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_deferred_weight(use_reentrant):
    """A recomputed forward (activation checkpointing) is not a new batch: with the deferral it hands the conv the
    weight as it is, as the original forward did, and the step transforms with the original forward's ``Q_s``."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):  # the whole converted model recomputed in the backward
            return checkpoint(self.inner, x, use_reentrant=use_reentrant)

    # both checkpointed: a recomputed BatchNorm updates its running statistics again (PyTorch's behaviour), and
    # an absorbed offset follows it, in either run
    batches = [(x.requires_grad_(use_reentrant), y) for x, y in _batches(9)]
    a = _train(Checkpointed(_model("grad")), batches, defer=False)
    b = _train(Checkpointed(_model("grad")), batches, defer=True)
    assert all(int(layer.num_blocks) == 3 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)
