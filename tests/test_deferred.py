"""``defer_grad_transform``: the weight-gradient transform as a hook on the weight trains like the default.

The default multiplies each forward's weight gradient by its ``Q_s`` in the backward, through an autograd node;
the deferral multiplies the gradient each backward brings to the weight by the same ``Q_s``, in a hook on the
weight before the gradient is accumulated (and a forward under another ``Q_s`` than the one still waiting for its
backward transforms its part apart). These are two code paths: the gradient may reach the product in another
layout (on a GPU, a channels_last gradient against the parameter's), which picks another kernel, and parts of one
backward are summed before the product instead of after it. So the comparisons allow some ulps of float64, derived
from its ``eps``. Measured gaps on a 2-core AMD EPYC: 0 for one process (same kernel, same tensor), 8.9e-16 for
DDP. ``GRAD_ATOL`` applies to gradients (|g| <= 0.05 here) and ``STATE_ATOL`` to a model after 12 SGD steps
(|w| <= 4.5), where a difference of a few ulps per step can grow.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whitenlayers as wl
from dist_utils import run_distributed

DT = torch.float64
EPS = torch.finfo(DT).eps
GRAD_ATOL = 2**8 * EPS  # 5.7e-14
STATE_ATOL = 2**12 * EPS  # 9.1e-13


def _model(method: str, seed: int = 0, groups: int = 1, block_size: int = 3, **kw) -> nn.Module:
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 8, 3, padding=1, bias=False, groups=groups), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(DT)
    return wl.convert_model(base, method, block_size=block_size, targets="all", include_stem=True, **kw)


def _never_transformed(model: nn.Module) -> nn.Module:
    """Deferred, but never transformed: not the same training (what a comparison that has teeth must tell)."""
    for _, layer in wl.whitening_layers(model):
        layer._deferral = lambda w, q: w
    return model


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
    c = _never_transformed(_model(method, **kw))
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


def test_accumulated_gradients_with_a_fold_inside_a_step():
    """Two backward passes per step without ``accumulation_steps``: every other step a block ends between its two
    micro-batches, so they have different ``Q_s``. Each backward brings its own forward's ``Q_s`` to the hook."""
    batches = _batches(12)
    a = _train(_model("grad"), batches, defer=False, micro=2)
    b = _train(_model("grad"), batches, defer=True, micro=2)
    assert all(int(layer.num_blocks) == 4 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)


def _train_two_views(model: nn.Module, batches, defer: bool, backward: str) -> nn.Module:
    """Two forwards per step (a batch and its mirror image, as SimCLR's views): one loss over both (with a term
    that couples them), or one loss per view backpropagated apart, in the order of the forwards or the reverse."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    deferral = wl.defer_grad_transform(model, opt) if defer else None
    for x, y in batches:
        opt.zero_grad()
        out1, out2 = model(x), model(x.flip(-1))
        loss1, loss2 = F.cross_entropy(out1, y), F.cross_entropy(out2, y)
        if backward == "one":
            (loss1 + loss2 + (out1 - out2).square().mean()).backward()
        elif backward == "in order":
            loss1.backward()
            loss2.backward()
        else:
            loss2.backward()
            loss1.backward()
        opt.step()
    if deferral is not None:
        deferral.remove()
    return model


@pytest.mark.parametrize("backward", ["one", "in order", "reversed"])
@pytest.mark.parametrize("block_size", [1, 3], ids=["fold-every-forward", "block-ends-on-either-forward"])
def test_two_forwards_per_step_train_like_the_default(block_size, backward):
    """``block_size=1``: a fold between the two forwards of every step; ``block_size=3``: a block ends on the
    first forward of one step in three, on the second of another. Either way the two forwards of some steps use
    different ``Q_s``, and each forward's part of the gradient must be multiplied by its own."""
    batches = _batches(6)
    a = _train_two_views(_model("grad", block_size=block_size), batches, defer=False, backward=backward)
    b = _train_two_views(_model("grad", block_size=block_size), batches, defer=True, backward=backward)
    assert all(int(layer.num_blocks) == 12 // block_size for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)
    c = _train_two_views(_never_transformed(_model("grad", block_size=block_size)), batches, defer=False,
                         backward=backward)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


@pytest.mark.parametrize("block_size", [1, 2])
def test_gan_steps_train_like_the_default(block_size):
    """A GAN's discriminator: a real and a fake batch in one backward, its step, then the generator's loss through
    a third forward of the discriminator (whose weight gradient is cleared, unused, before the next step). Three
    forwards per step: a fold between the real and the fake batch on every step (``block_size=1``) or on every
    other step (``block_size=2``)."""
    g = torch.Generator().manual_seed(2)
    noise = [torch.randn(8, 4, generator=g, dtype=DT) for _ in range(6)]
    batches = _batches(6)

    def fit(defer: bool):
        torch.manual_seed(3)
        gen = nn.Sequential(nn.Linear(4, 3 * 6 * 6), nn.Unflatten(1, (3, 6, 6))).to(DT)
        disc = _model("grad", block_size=block_size)
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(disc, opt_d) if defer else None
        bce = F.binary_cross_entropy_with_logits
        for (real, _), z in zip(batches, noise):
            fake = gen(z)
            opt_d.zero_grad()
            ones, zeros = torch.ones(8, dtype=DT), torch.zeros(8, dtype=DT)
            (bce(disc(real)[:, 0], ones) + bce(disc(fake.detach())[:, 0], zeros)).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake)[:, 0], ones).backward()
            opt_g.step()
        if deferral is not None:
            deferral.remove()
        return disc, gen

    (da, ga), (db, gb) = fit(False), fit(True)
    assert all(int(layer.num_blocks) == 18 // block_size for _, layer in wl.whitening_layers(db))
    _assert_same_training(da, db)
    _assert_same_training(ga, gb)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_clipped_gradients_train_like_the_default(clip):
    """``clip_grad_norm_`` / ``clip_grad_value_`` between ``backward()`` and ``step()`` clip the transformed
    gradient, as with the default; the thresholds are reached on every step."""
    batches = _batches(9)

    def fit(model: nn.Module, defer: bool) -> nn.Module:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        deferral = wl.defer_grad_transform(model, opt) if defer else None
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if clip == "norm":
                assert nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.02) > 0.02
            else:
                assert max(p.grad.abs().max() for p in model.parameters()) > 2e-3
                nn.utils.clip_grad_value_(model.parameters(), clip_value=2e-3)
            opt.step()
        if deferral is not None:
            deferral.remove()
        return model

    a, b = fit(_model("grad"), False), fit(_model("grad"), True)
    _assert_same_training(a, b)
    c = fit(_never_transformed(_model("grad")), False)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as it is commonly written (a wrapper whose ``second_step`` steps the base
    optimizer it built; its own ``step`` is never called)."""

    def __init__(self, params, base_optimizer_cls, rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer_cls(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for group in self.param_groups for p in group["params"]
                                       if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * scale)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


@pytest.mark.parametrize("given", ["wrapper", "base"])
def test_sam_trains_like_the_default(given):
    """SAM: a forward and backward at the weights, a step along the (transformed) gradient's direction, a second
    forward and backward there (folds fall between them), then the base optimizer's step. The deferral given the
    wrapper or its base optimizer."""
    batches = _batches(6)

    def fit(model: nn.Module, defer: bool) -> nn.Module:
        opt = _SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(model, opt if given == "wrapper" else opt.base_optimizer) if defer else None
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.first_step(zero_grad=True)
            F.cross_entropy(model(x), y).backward()
            opt.second_step(zero_grad=True)
        if deferral is not None:
            deferral.remove()
        return model

    a, b = fit(_model("grad"), False), fit(_model("grad"), True)
    assert all(int(layer.num_blocks) == 4 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)
    c = fit(_never_transformed(_model("grad")), False)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


def test_gradients_after_backward_are_the_defaults():
    """The hook transforms each backward's gradient before it is accumulated: ``.grad`` after ``backward()`` is the
    default's (what clipping, logging, an optimizer wrapper see), with nothing left for the step to do."""
    model = _model("grad")
    x, y = _batches(1)[0]
    for _ in range(3):  # a fold: Q_s is no longer the identity
        model(x)
    reference = copy.deepcopy(model)  # not deferred: transforms in the backward
    plain = _never_transformed(copy.deepcopy(model))
    with wl.defer_grad_transform(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        for m in (model, reference, plain):
            F.cross_entropy(m(x), y).backward()
        torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=0, atol=GRAD_ATOL)
        assert (plain[0].weight.grad - reference[0].weight.grad).abs().max() > 1e-6
    # removed: the autograd Function transforms again
    for m in (model, reference):
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=0, atol=GRAD_ATOL)
    assert model[0]._deferral is None


def test_copies_are_not_deferred_and_remove_before_the_backward_warns():
    model = _model("recursive")
    deferral = wl.defer_grad_transform(model, torch.optim.SGD(model.parameters(), lr=0.1))
    twin = copy.deepcopy(model)  # its weights are new parameters, without the deferral's hook
    assert twin[0]._deferral is None and not twin[0].weight._backward_hooks
    x, y = _batches(1)[0]
    for _ in range(3):
        model(x)
    loss = F.cross_entropy(model(x), y)
    with pytest.warns(RuntimeWarning, match=r"removed while the backward of a forward made under it has not run"):
        deferral.remove()
    loss.backward()  # what the warning says: this gradient is not transformed
    assert not model[0].weight._backward_hooks
    deferral.remove()  # twice: nothing left, no warning


def test_set_up_and_refusals():
    model = _model("grad")
    with pytest.raises(ValueError, match="no grad or recursive whitening layer"):
        wl.defer_grad_transform(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected optimizers .* but got float; no optimizer is needed"):
        wl.defer_grad_transform(model, 0.1)
    # the optimizers play no part: one that steps the head only is as good as none
    head = torch.optim.SGD(model[-1].parameters(), lr=0.1)
    first = wl.defer_grad_transform(model, head)
    second = wl.defer_grad_transform(model)  # takes the layers over: one hook per weight
    assert len(model[0].weight._backward_hooks) == 1
    first.remove()  # ends nothing of the second's
    assert len(model[0].weight._backward_hooks) == 1 and model[0]._deferral is not None
    second.remove()
    assert not model[0].weight._backward_hooks and model[0]._deferral is None


def test_a_weight_that_is_not_the_hooked_parameter_takes_the_default_transform():
    """A parameter assigned to the layer since the set-up (or a replica's weight, a sharded wrapper's view) has no
    hook of the deferral: its forward goes through the autograd Function, as without the deferral."""
    model = _model("grad")
    x, y = _batches(1)[0]
    for _ in range(3):
        model(x)
    reference = copy.deepcopy(model)
    with wl.defer_grad_transform(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
        for m in (model, reference):
            F.cross_entropy(m(x), y).backward()
        torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=0, atol=GRAD_ATOL)


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
    c = _never_transformed(_model("grad"))
    _train_with_closures(c, batches, defer=False, how=how)
    assert (c[0].weight - a[0].weight).abs().max() > 1e-4


@pytest.mark.parametrize("clip", [10.0, 0.02], ids=["threshold-not-reached", "threshold-reached"])
def test_lightning_automatic_optimization_trains_like_the_default(tmp_path, clip):
    """Lightning steps every optimizer with a closure (its training step, backward and gradient clipping): with
    the deferral set up in ``configure_optimizers`` it trains like the default, also when the clipping threshold
    is reached (the closure clips the transformed gradients, as with the default)."""
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

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(float(torch.stack([p.grad.norm() for p in self.parameters()]).norm()))

    data = _batches(6)
    loader = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*data)])), batch_size=8)

    def fit(defer: bool) -> nn.Module:
        module = Module(defer)
        module.norms = []
        L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                  gradient_clip_val=clip).fit(module, loader)
        # on_before_optimizer_step runs before the clipping: the threshold is reached, or not, on every step
        assert all((n > clip) == (clip < 1) for n in module.norms), module.norms
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


def test_parametrized_weight_keeps_the_default_transform():
    """A parametrized weight (``weight_norm``) is computed anew in each forward, not the parameter: that layer keeps
    the autograd Function (the others are deferred), and the model trains like the default."""
    from torch.nn.utils import parametrizations

    def model() -> nn.Module:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                             parametrizations.weight_norm(nn.Conv2d(6, 8, 3, padding=1, bias=False)),
                             nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 4)).to(DT)
        return wl.convert_model(base, "grad", block_size=3, predicate=lambda name, m: isinstance(m, nn.Conv2d))

    batches = _batches(12)
    a = _train(model(), batches, defer=False)
    b = _train(model(), batches, defer=True)
    assert all(int(layer.num_blocks) == 4 for _, layer in wl.whitening_layers(b))
    _assert_same_training(a, b)
    deferral = wl.defer_grad_transform(b, torch.optim.SGD(b.parameters(), lr=0.1))
    assert deferral.layers == [b[0]]


@pytest.mark.slow  # 6.8 CPU s (measured at load 16): torch.compile of two runs
def test_eager_steps_then_compiled_steps_transform_once():
    """A layer inside a compiled graph takes the default transform (the Function); the weight's hook must not
    transform that gradient again with the Q_s of an earlier eager forward (a model whose first steps, or whose
    graph breaks, run eagerly): the trace ends the layer's deferral (before: 1e-3 off after one compiled step)."""
    batches = _batches(6)

    def run(defer: bool) -> nn.Module:
        model = _model("grad", block_size=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if defer:
            wl.defer_grad_transform(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            F.cross_entropy((model if i < 2 else compiled)(x), y).backward()  # 2 eager steps, then compiled
            opt.step()
        return model

    with pytest.warns(RuntimeWarning, match="its deferral is ended"):
        deferred = run(True)
    assert all(layer._deferral is None for _, layer in wl.whitening_layers(deferred))
    _assert_same_training(deferred, run(False))
