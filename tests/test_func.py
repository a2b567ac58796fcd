"""``torch.func`` on converted models: ``vmap``, ``grad``, ``jacrev``, ``jvp`` and per-sample gradients
``vmap(grad(loss))`` through the layers' autograd Functions (docs/training.md, "Works with").

Eval mode: every transform runs and equals the same quantity computed sample by sample with ordinary autograd
(the layers' gradient transform included). Training mode: a forward that would gather statistics refuses with
what to do; inside ``wl.frozen(model)``, with BatchNorms that keep no running statistics (what any model needs
under ``torch.func`` in training mode), it runs and equals the loop too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, jacrev, jvp, replace_all_batch_norm_modules_, vjp, vmap

import whitenlayers as wl
from whitenlayers.autograd import direct_whiten, grad_transformed
from whitenlayers.functional import transform_weight_grad

METHODS = ["grad", "recursive", "direct"]
DTYPE = torch.float64
#: Two orderings of the same float64 sums (a vmapped product against a single sample's, the vectorised backward
#: against the loop). Measured: up to 1.4e-15 relative on the per-sample gradients, 2.2e-16 on the logits and
#: 5e-17 on the Jacobians; 100 ulps.
TOL = dict(rtol=torch.finfo(DTYPE).eps * 100, atol=torch.finfo(DTYPE).eps * 100)


def trained(method, seed=0):
    """A converted CIFAR ResNet-8 (float64) after 3 training steps on correlated inputs: non-trivial ``mu``, ``T``
    and ``Q_s`` (block_size 1; ``beta = 0``: ``Q_s`` is the last block's ``Q``, far from the identity)."""
    torch.manual_seed(seed)
    kw = {} if method == "direct" else {"beta": 0.0}
    model = wl.convert_model(wl.models.cifar_resnet(8, num_classes=10, width=4), method, block_size=1, **kw)
    model = model.to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mix = torch.randn(3, 3, dtype=DTYPE)
    for _ in range(3):
        x = torch.einsum("ij,bjhw->bihw", mix, torch.randn(8, 3, 8, 8, dtype=DTYPE)) + 0.5
        opt.zero_grad()
        Fn.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
        opt.step()
    return model


def data(n=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=DTYPE), torch.randint(0, 10, (n,), generator=g)


def state(model):
    """The whitening state and the block in progress (a forward that gathers or folds changes it)."""
    out = {k: v.clone() for k, v in model.state_dict().items() if "conv" in k or "whiten" in k}
    out.update({f"{n}.batches": torch.tensor(m.batches_in_block) for n, m in wl.whitening_layers(model)})
    return out


def assert_state_unchanged(model, before):
    after = state(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


def per_sample_grads(model, x, y):
    """``vmap(grad(loss), in_dims=(None, 0, 0))`` with ``functional_call``: the Opacus / functorch recipe."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi, yi):
        return Fn.cross_entropy(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def looped_grads(model, x, y):
    """The same gradients from one ordinary backward per sample (the layers' autograd Functions: ``Q_s``)."""
    out = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        Fn.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for k, p in model.named_parameters():
            out[k].append(p.grad.clone())
    return {k: torch.stack(v) for k, v in out.items()}


def check_transform_applied(model, got):
    """For each grad / recursive layer: its weight's per-sample gradient is the untransformed one right-multiplied
    by a ``Q_s`` far from the identity (so the comparison with the loop has something to catch)."""
    for name, layer in wl.whitening_layers(model):
        q = getattr(layer, "grad_transform", None)
        if q is None or not hasattr(layer, "weight"):
            continue
        assert (q - torch.eye(q.shape[-1], dtype=q.dtype)).abs().max() > 0.1, name
        g = got[f"{name}.weight"]
        untransformed = torch.stack([transform_weight_grad(gi, torch.linalg.inv(q)) for gi in g])
        assert not torch.allclose(untransformed, g, **TOL), name


@pytest.mark.parametrize("method", METHODS)
def test_eval_per_sample_gradients_equal_the_loop_with_the_gradient_transform(method):
    model = trained(method).eval()
    x, y = data()
    before = state(model)
    got = per_sample_grads(model, x, y)
    want = looped_grads(model, x, y)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)
    check_transform_applied(model, got)
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("method", METHODS)
def test_eval_vmap_jacrev_and_jvp_equal_ordinary_autograd(method):
    model = trained(method).eval()
    x, _ = data(3)
    before = state(model)
    want = model(x)
    torch.testing.assert_close(vmap(model)(x.unsqueeze(1)).squeeze(1), want, **TOL)
    jac = jacrev(model)(x)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(model, x), **TOL)
    # the whitening's backward is the true derivative: the plain export's Jacobian
    plain = wl.to_plain_model(copy.deepcopy(model)).eval()
    torch.testing.assert_close(jac, jacrev(plain)(x), **TOL)
    v = torch.randn_like(x)
    out, tangent = jvp(model, (x,), (v,))
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(tangent, torch.einsum("boixyz,ixyz->bo", jac, v), **TOL)
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
def test_training_forward_inside_a_transform_refuses_before_changing_state(method, transform):
    model = trained(method)
    replace_all_batch_norm_modules_(model)  # what torch.func needs of any model in training mode
    model.train()
    x, y = data()
    before = state(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    calls = {
        "vmap": lambda: vmap(model)(x.unsqueeze(1)),
        "grad": lambda: grad(lambda p: functional_call(model, p, (x,)).sum())(params),
        "jacrev": lambda: jacrev(model)(x),
    }
    first = wl.whitening_layers(model)[0][0]
    with pytest.raises(RuntimeError, match=rf"'{first}'.*training-mode forward inside a torch\.func transform.*"
                                           r"eval mode.*wl\.frozen\(model\)"):
        calls[transform]()
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_absorbed_layer_under_a_transform_with_a_tracking_batchnorm_says_what_to_do(method):
    model = trained(method).train()
    layer = model.layer1[0].conv1
    assert layer.centring == "absorbed"
    model.bn1.eval()  # the stem's BatchNorm would refuse first (torch's own message)
    x, _ = data()
    with wl.frozen(model), pytest.raises(RuntimeError, match=r"'layer1\.0\.conv1'.*absorbed by a BatchNorm in "
                                                            r"training mode.*replace_all_batch_norm_modules_"):
        jacrev(model)(x)


@pytest.mark.parametrize("method", METHODS)
def test_frozen_training_mode_per_sample_gradients_equal_the_loop(method):
    model = trained(method)
    replace_all_batch_norm_modules_(model)
    model.train()
    x, y = data()
    before = state(model)
    with wl.frozen(model):
        got = per_sample_grads(model, x, y)
        want = looped_grads(model, x, y)
        jac = jacrev(model)(x)
        torch.testing.assert_close(jac, torch.autograd.functional.jacobian(model, x), **TOL)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)
    check_transform_applied(model, got)
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_eval_mode_keeps_the_weight_gradient_transform(method):
    """The gradient transform belongs to the layer, not to training mode (a model fine-tuned in eval mode, e.g.
    with frozen BatchNorms, is preconditioned too): eval-mode gradients equal those of a frozen training-mode
    forward of the same function, and differ from the untransformed ones."""
    torch.manual_seed(0)
    cls = {"grad": wl.GradWhitenConv2d, "recursive": wl.RecursiveWhitenConv2d}[method]
    layer = cls(3, 5, 3, padding=1, bias=False, block_size=1, beta=0.0, dtype=DTYPE)
    mix = torch.randn(3, 3, dtype=DTYPE)
    for _ in range(3):
        layer(torch.einsum("ij,bjhw->bihw", mix, torch.randn(8, 3, 6, 6, dtype=DTYPE)) + 0.5)
    x = torch.randn(4, 3, 6, 6, dtype=DTYPE)

    def weight_grad():
        layer.weight.grad = None
        layer(x).square().sum().backward()
        return layer.weight.grad.clone()

    with wl.frozen(layer):
        trained_grad = weight_grad()
    layer.eval()
    eval_grad = weight_grad()
    torch.testing.assert_close(eval_grad, trained_grad, **TOL)
    with torch.no_grad():
        layer.grad_transform.copy_(torch.eye(3, dtype=DTYPE))
    assert not torch.allclose(weight_grad(), eval_grad, **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_eval_ensemble_of_stacked_models_equals_each_model(method):
    """``vmap`` over stacked parameters and buffers (``stack_module_state``, model ensembling), outputs and
    gradients: ``T``, ``mu``, ``Q_s`` are batched too."""
    models = [trained(method, seed=s).eval() for s in range(3)]
    params, buffers = torch.func.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x, y = data()

    def loss(p, b):
        return Fn.cross_entropy(functional_call(base, (p, b), (x,)), y)

    got = vmap(lambda p, b: functional_call(base, (p, b), (x,)))(params, buffers)
    torch.testing.assert_close(got, torch.stack([m(x) for m in models]), **TOL)
    grads = vmap(grad(loss))(params, buffers)
    for i, m in enumerate(models):
        m.zero_grad()
        Fn.cross_entropy(m(x), y).backward()
        for k, p in m.named_parameters():
            torch.testing.assert_close(grads[k][i], p.grad, **TOL, msg=k)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_jacfwd_equals_jacrev_with_respect_to_a_whitened_weight(method):
    """Forward mode agrees with reverse mode on the layers' weights: the derivative with respect to a whitened
    weight is the transformed one in either mode (the Function's jvp is its backward's adjoint), also for a weight
    that requires no grad (a forward-mode tangent only)."""
    model = trained(method).eval()
    x, _ = data(2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    for name in ("layer1.0.conv1.weight", "layer2.0.conv2.weight"):
        def f(w, name=name):
            return functional_call(model, {**params, name: w}, (x,))
        torch.testing.assert_close(torch.func.jacfwd(f)(params[name]), jacrev(f)(params[name]), **TOL)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_per_sample_gradients_under_the_deferred_transform_are_transformed(method):
    """``defer_grad_transform`` moves the transform to the optimizer's step, which torch.func's gradients never
    reach: under a transform the layers keep it in the backward, so the per-sample gradients equal the default's."""
    model = trained(method).eval()
    default = copy.deepcopy(model)
    wl.defer_grad_transform(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    got = per_sample_grads(model, x, y)
    want = looped_grads(default, x, y)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)


def _spd_blocks(g, k, gen):
    a = torch.randn(g, k, k, generator=gen, dtype=DTYPE)
    return a @ a.mT + torch.eye(k, dtype=DTYPE)


@settings(max_examples=30, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), channels_last=st.booleans(), in_dim=st.sampled_from([0, 1, 2]),
       seed=st.integers(0, 2 ** 16))
def test_functions_under_vmap_equal_each_slice(groups, channels_last, in_dim, seed):
    """The Functions' generated vmap rules, on any layout the vmapped input may have (the batch dimension first,
    second or third; each slice channels_last or not) and any grouping: ``vmap`` of the forward, of its vjp and of
    the weight-gradient transform's vjp equal the same calls slice by slice."""
    gen = torch.Generator().manual_seed(seed)
    n, b, m = 3, 2, 4
    t = _spd_blocks(groups, m // groups, gen)
    t = t[0] if groups == 1 else t
    mean = torch.randn(m, generator=gen, dtype=DTYPE)
    x = torch.randn(n * b, m, 3, 3, generator=gen, dtype=DTYPE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x = x.view(n, b, m, 3, 3).movedim(0, in_dim)  # a view: the slices keep their layout
    cot = torch.randn(n, b, m, 3, 3, generator=gen, dtype=DTYPE).movedim(0, in_dim)
    slices = [x.select(in_dim, i) for i in range(n)]
    cots = [cot.select(in_dim, i) for i in range(n)]

    def whiten(xi):
        return direct_whiten(xi, t, mean)

    torch.testing.assert_close(vmap(whiten, in_dims=in_dim)(x), torch.stack([whiten(xi) for xi in slices]), **TOL)
    got = vmap(lambda xi, ci: vjp(whiten, xi)[1](ci)[0], in_dims=(in_dim, in_dim))(x, cot)
    torch.testing.assert_close(got, torch.stack([vjp(whiten, xi)[1](ci)[0] for xi, ci in zip(slices, cots)]), **TOL)
    # the weight-gradient transform: a grouped conv's weight (S, M/G, kh, kw), its gradients batched in any layout
    w = torch.randn(6 * groups, m // groups, 3, 3, generator=gen, dtype=DTYPE)
    g = torch.randn(n, *w.shape, generator=gen, dtype=DTYPE)
    if channels_last:
        g = g.view(n * w.shape[0], *w.shape[1:]).contiguous(memory_format=torch.channels_last).view(g.shape)
    g = g.movedim(0, in_dim)

    def weight_vjp(gi):
        return vjp(lambda wi: grad_transformed(wi, t), w)[1](gi)[0]

    want = torch.stack([transform_weight_grad(g.select(in_dim, i), t) for i in range(n)])
    torch.testing.assert_close(vmap(weight_vjp, in_dims=in_dim)(g), want, **TOL)
