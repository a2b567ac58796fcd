"""Faults and bad input (issue 7): failed eigendecompositions, non-finite batches, invalid input, fuzzing.

Guarantees checked here:
* a failed EVD (raises, or returns NaN) is retried in float64, then the previous
  transform is kept, a warning names the layer once, ``transform_failures`` counts;
* a batch with NaN/Inf activations drops its whole block (the layer ends exactly
  where a layer that never saw that block ends), ``nonfinite_blocks`` and
  ``skipped_folds`` count and a warning names the layer; nothing non-finite
  reaches ``T``, ``Q_s``, ``mu`` or the weights;
* in float32, a batch whose second moments overflow float32 (values around
  1e20 with a spread to match: squares above 3.4e38) counts as non-finite; a
  float64 layer folds it;
* wrong input rank, channel count or dtype raise an error naming the layer,
  what was expected and what was given;
* fuzzing over odd shapes and values gives finite transforms and keeps
  channels_last.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import whitenlayers as wl
from whitenlayers import functional as F

STATE = ("running_mean", "running_cov", "whitening_matrix", "grad_transform")
EVD_LAYERS = {
    "grad": lambda **kw: wl.GradWhitenConv2d(4, 3, 3, padding=1, **kw),
    "direct": lambda **kw: wl.DirectWhiten(4, **kw),
}


def data(n, seed, c=4, scale=(1.0, 3.0, 0.5, 2.0), offset=1.5, hw=5):
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor(scale[:c]).view(1, c, 1, 1)
    mix = torch.eye(c) + 0.4 * torch.randn(c, c, generator=g)
    return [
        torch.einsum("ij,bjhw->bihw", mix, torch.randn(6, c, hw, hw, generator=g) * s) + offset for _ in range(n)
    ]


def state(layer):
    return {k: getattr(layer, k).clone() for k in STATE + ("num_blocks",) if hasattr(layer, k)}


def bias_of(layer):
    if isinstance(layer, wl.DirectWhiten):
        return None
    return layer.bias_correction.detach().clone()  # the compensation, also for a layer with a bias


def assert_all_finite(layer):
    for name, buf in layer.named_buffers():
        if buf.is_floating_point():
            assert torch.isfinite(buf).all(), f"{name} is not finite"
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all(), f"{name} is not finite"


def messages(record, category=RuntimeWarning):
    return [str(w.message) for w in record if issubclass(w.category, category)]


# --------------------------------------------------------------------------
# Eigendecomposition failures
# --------------------------------------------------------------------------
class EighPatch:
    """Replaces ``torch.linalg.eigh``: records the dtypes it is called with and fails in the chosen ones."""

    def __init__(self, fail_dtypes, mode):
        self.real = torch.linalg.eigh
        self.fail_dtypes = set(fail_dtypes)
        self.mode = mode
        self.calls = []

    def __call__(self, a, *args, **kwargs):
        self.calls.append(a.dtype)
        if a.dtype in self.fail_dtypes:
            if self.mode == "raise":
                raise torch.linalg.LinAlgError("injected failure")
            lam, vec = self.real(a, *args, **kwargs)
            return lam * float("nan"), vec
        return self.real(a, *args, **kwargs)


@pytest.mark.parametrize("kind", sorted(EVD_LAYERS))
@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_failed_eigh_keeps_transform_retries_float64_warns_once(monkeypatch, kind, mode):
    layer = EVD_LAYERS[kind](block_size=1)
    layer.layer_name = "stage2.block0.conv1"
    xs = data(5, seed=1)
    layer(xs[0])  # one good fold
    good = state(layer)
    assert not torch.equal(good["whitening_matrix"], torch.eye(4))
    patch = EighPatch({torch.float32, torch.float64}, mode)
    monkeypatch.setattr(torch.linalg, "eigh", patch)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        layer(xs[1])
        layer(xs[2])
    # float32 first, then the float64 retry, at each of the two folds
    assert patch.calls == [torch.float32, torch.float64] * 2
    after = state(layer)
    assert torch.equal(after["whitening_matrix"], good["whitening_matrix"])
    if "grad_transform" in good:
        assert torch.equal(after["grad_transform"], good["grad_transform"])
    # the moments still move on (only the transform is kept), and the layer's function is kept
    assert int(after["num_blocks"]) == 3
    assert not torch.equal(after["running_mean"], good["running_mean"])
    assert layer.transform_failures == 2
    eig_msgs = [m for m in messages(rec) if "eigendecomposition" in m]
    assert len(eig_msgs) == 1, messages(rec)
    assert "stage2.block0.conv1" in eig_msgs[0] and type(layer).__name__ in eig_msgs[0]
    assert_all_finite(layer)
    # once eigh works again, the transform is updated again and the count stays
    monkeypatch.setattr(torch.linalg, "eigh", patch.real)
    layer(xs[3])
    assert not torch.equal(layer.whitening_matrix, good["whitening_matrix"])
    assert layer.transform_failures == 2


@pytest.mark.parametrize("kind", sorted(EVD_LAYERS))
@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_float32_eigh_failure_is_rescued_by_float64(monkeypatch, kind, mode):
    xs = data(2, seed=2)
    ref = EVD_LAYERS[kind](block_size=1)
    layer = EVD_LAYERS[kind](block_size=1)
    layer.load_state_dict(ref.state_dict())
    ref(xs[0])
    patch = EighPatch({torch.float32}, mode)
    monkeypatch.setattr(torch.linalg, "eigh", patch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn about
        layer(xs[0])
    assert patch.calls == [torch.float32, torch.float64]
    assert layer.transform_failures == 0
    # the float64 decomposition of the same covariance, rounded to float32
    t64, _ = F.evd_transform(layer.running_cov.double(), eps=layer.eps, gmax=layer.gmax)
    torch.testing.assert_close(layer.whitening_matrix, t64.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.whitening_matrix, ref.whitening_matrix, rtol=1e-4, atol=1e-5)


def three_layer_model():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1))
    return wl.convert_model(body, method="grad", predicate=lambda name, m: True, block_size=1)


class BatchedEighPatch(EighPatch):
    """Fails only the batched (3-d) float32 call: wholly ("raise") or for matrix ``index`` ("nan")."""

    def __init__(self, mode, index=1):
        super().__init__(set(), mode)
        self.index = index

    def __call__(self, a, *args, **kwargs):
        self.calls.append((a.dim(), a.dtype))
        if a.dim() == 3 and a.dtype == torch.float32:
            if self.mode == "raise":
                raise torch.linalg.LinAlgError("injected failure")
            lam, vec = self.real(a, *args, **kwargs)
            lam = lam.clone()
            lam[self.index] = float("nan")
            return lam, vec
        return self.real(a, *args, **kwargs)


@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_batched_fold_of_a_model_falls_back_per_layer(monkeypatch, mode):
    """The layers of a model fold together with one batched eigh; when it fails, the failed layers alone retry."""
    ref, model = three_layer_model(), three_layer_model()
    x = data(1, seed=8)[0]
    ref(x)
    patch = BatchedEighPatch(mode)
    monkeypatch.setattr(torch.linalg, "eigh", patch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model(x)
    retried = 3 if mode == "raise" else 1
    assert patch.calls == [(3, torch.float32)] + [(2, torch.float32)] * retried
    for (name, a), (_, b) in zip(wl.convert.whitening_layers(ref), wl.convert.whitening_layers(model)):
        assert b.transform_failures == 0 and int(b.num_blocks) == 1, name
        torch.testing.assert_close(b.whitening_matrix, a.whitening_matrix, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.grad_transform, a.grad_transform, rtol=1e-5, atol=1e-6)


def test_batched_fold_total_failure_keeps_every_transform_and_names_each_layer(monkeypatch):
    model = three_layer_model()
    x = data(2, seed=9)
    model(x[0])
    layers = wl.convert.whitening_layers(model)
    good = {name: state(layer) for name, layer in layers}
    patch = EighPatch({torch.float32, torch.float64}, "raise")
    monkeypatch.setattr(torch.linalg, "eigh", patch)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model(x[1])
    # one batched try, then float32 and float64 for each layer
    assert patch.calls == [torch.float32] + [torch.float32, torch.float64] * 3
    msgs = [m for m in messages(rec) if "eigendecomposition" in m]
    assert len(msgs) == 3
    for (name, layer), msg in zip(layers, msgs):
        assert f"'{name}'" in msg
        assert layer.transform_failures == 1 and int(layer.num_blocks) == 2
        assert torch.equal(layer.whitening_matrix, good[name]["whitening_matrix"])
        assert torch.equal(layer.grad_transform, good[name]["grad_transform"])
        assert_all_finite(layer)


def test_robust_eigh_contract(monkeypatch):
    """``robust_eigh`` never raises for numerical reasons and returns None when both precisions fail."""
    cov = torch.diag(torch.tensor([3.0, 2.0, 1.0]))
    lam, vec = F.robust_eigh(cov)
    assert lam.tolist() == [3.0, 2.0, 1.0]  # decreasing
    assert F.robust_eigh(torch.full((3, 3), float("nan"))) is None
    assert F.robust_eigh(torch.tensor([[1.0, float("inf")], [float("inf"), 1.0]])) is None
    monkeypatch.setattr(torch.linalg, "eigh", EighPatch({torch.float32, torch.float64}, "raise"))
    assert F.robust_eigh(cov) is None
    assert F.evd_transform(cov, eps=1e-5, gmax=10.0) is None


@pytest.mark.parametrize("cls", [wl.RecursiveWhitenConv2d, wl.RecursiveWhitenLinear])
def test_failed_recursive_step_keeps_transform(monkeypatch, cls):
    layer = cls(4, 3, 3, block_size=1) if cls is wl.RecursiveWhitenConv2d else cls(4, 3, block_size=1)
    layer.layer_name = "head"
    xs = data(4, seed=3)
    prep = (lambda x: x) if cls is wl.RecursiveWhitenConv2d else (lambda x: x.mean((2, 3)))
    layer(prep(xs[0]))
    layer(prep(xs[1]))
    good = state(layer)
    real = F.recursive_step_blocks

    def nan_step(*a, **k):
        step, over = real(*a, **k)
        return step._replace(transform=step.transform * float("nan")), over

    monkeypatch.setattr(F, "recursive_step_blocks", nan_step)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        layer(prep(xs[2]))
        layer(prep(xs[3]))
    assert torch.equal(layer.whitening_matrix, good["whitening_matrix"])
    assert torch.equal(layer.grad_transform, good["grad_transform"])
    assert layer.transform_failures == 2
    msgs = [m for m in messages(rec) if "recursive" in m]
    assert len(msgs) == 1 and "'head'" in msgs[0]
    assert_all_finite(layer)


# --------------------------------------------------------------------------
# Non-finite batches
# --------------------------------------------------------------------------
ALL_LAYERS = {
    "grad": lambda **kw: wl.GradWhitenConv2d(4, 3, 3, padding=1, bias=False, **kw),
    "grad-bias": lambda **kw: wl.GradWhitenConv2d(4, 3, 3, padding=1, **kw),
    "recursive": lambda **kw: wl.RecursiveWhitenConv2d(4, 3, 3, padding=1, **kw),
    "direct": lambda **kw: wl.DirectWhiten(4, **kw),
}


def poison(x, value, where):
    x = x.clone()
    if where == "one":
        x[2, 1, 3, 0] = value
    else:
        x[:] = value
    return x


@pytest.mark.parametrize("kind", sorted(ALL_LAYERS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad_block", [0, 1])
def test_nonfinite_batch_drops_its_block(kind, value, position, bad_block):
    """A block with a non-finite batch is dropped whole: the layer ends exactly where a layer that never saw that
    block ends (mu, T, Q_s, Phi_x, the bias compensation, num_blocks), and it is counted and named once.

    Why a whole block and not the batch alone: telling a bad batch apart needs a check of every batch (several
    ops and, to act on it, a host synchronisation or masked updates), and the hot path is one product and one
    accumulate per batch. A non-finite activation is an accident (an overflow, a diverging step), after which
    keeping the previous transform for one more block is what a skipped fold already does."""
    torch.manual_seed(0)
    ref = ALL_LAYERS[kind](block_size=3)
    layer = copy.deepcopy(ref)
    layer.layer_name = "features.3"
    xs = data(9, seed=4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for blk in range(3):
            batches = xs[3 * blk: 3 * blk + 3]
            if blk == bad_block:
                batches = list(batches)
                batches[position] = poison(batches[position], value, "one")
                before = state(layer)
            else:
                for x in batches:
                    ref(x)
            for x in batches:
                layer(x)
            if blk == bad_block:
                assert_same_state(state(layer), before)
    assert_same_state(state(layer), state(ref))
    assert torch.equal(bias_of(layer), bias_of(ref)) if bias_of(ref) is not None else True
    assert layer.nonfinite_blocks == 1 and layer.skipped_folds == 1 and int(layer.num_blocks) == 2
    msgs = [m for m in messages(rec) if "non-finite" in m]
    assert len(msgs) == 1 and "'features.3'" in msgs[0] and "dropped" in msgs[0]
    assert_all_finite(layer)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", sorted(ALL_LAYERS))
def test_block_without_finite_samples_is_not_folded(kind):
    layer = ALL_LAYERS[kind](block_size=2)
    layer.layer_name = "x"
    xs = data(3, seed=5)
    layer(xs[0])
    layer(xs[1])
    before, bias = state(layer), bias_of(layer)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        layer(poison(xs[2], float("nan"), "all"))
        layer(poison(xs[2], float("inf"), "one"))
    for k, v in before.items():
        assert torch.equal(getattr(layer, k), v), k
    if bias is not None:
        assert torch.equal(bias_of(layer), bias)
    assert layer.skipped_folds == 1 and layer.nonfinite_blocks == 1
    assert any("skipped" in m for m in messages(rec))
    assert_all_finite(layer)


@pytest.mark.parametrize("kind", ["grad", "grad-bias", "recursive"])
def test_training_through_nonfinite_batches_keeps_everything_finite(kind):
    """A loop that skips the optimizer step when the loss is not finite (as GradScaler does) stays finite."""
    torch.manual_seed(0)
    conv = ALL_LAYERS[kind](block_size=2)
    model = nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs = data(12, seed=6)
    g = torch.Generator().manual_seed(0)
    skipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, x in enumerate(xs):
            if i in (1, 4, 5):
                x = poison(x, float("nan") if i != 4 else float("inf"), "one" if i != 5 else "all")
            y = torch.randint(0, 2, (x.shape[0],), generator=g)
            opt.zero_grad()
            loss = Fn.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            loss.backward()
            assert torch.isfinite(conv.weight.grad).all()
            opt.step()
    assert skipped == 3
    assert conv.nonfinite_blocks == 2  # blocks [0, 1] and [4, 5] are dropped
    assert int(conv.num_blocks) == 4 and conv.skipped_folds == 2
    assert_all_finite(model)
    assert not torch.equal(conv.grad_transform, torch.eye(4))


def test_large_values_float32_overflow_is_counted_float64_folds():
    """Values ~1e20 with a spread to match: squares overflow float32 (1e40 > 3.4e38).

    In float32 such a batch counts as non-finite (the statistics cannot hold
    it); a float64 layer folds it; a large *mean* with an ordinary spread is no
    problem in float32 (the moments are taken about a shift).
    """
    x = data(1, seed=7)[0]
    f32 = wl.GradWhitenConv2d(4, 3, 1, block_size=1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        f32(x * 1e20)
    assert any("overflow" in m for m in messages(rec)) and any("skipped" in m for m in messages(rec))
    assert f32.nonfinite_blocks == 1 and f32.skipped_folds == 1 and int(f32.num_blocks) == 0
    assert torch.equal(f32.whitening_matrix, torch.eye(4))

    f64 = wl.GradWhitenConv2d(4, 3, 1, block_size=1, dtype=torch.float64)
    f64(x.double() * 1e20)
    assert f64.nonfinite_blocks == 0 and int(f64.num_blocks) == 1
    assert_all_finite(f64)
    assert (f64.running_cov.diagonal() > 1e39).all()
    # scale invariance of the practical gains: T of x*1e20 is T of x
    ref = wl.GradWhitenConv2d(4, 3, 1, block_size=1, dtype=torch.float64)
    ref(x.double())
    torch.testing.assert_close(f64.whitening_matrix, ref.whitening_matrix, rtol=1e-6, atol=1e-8)

    big_mean = wl.GradWhitenConv2d(4, 3, 1, block_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        big_mean(x + 1e6)
    assert int(big_mean.num_blocks) == 1
    assert_all_finite(big_mean)


# --------------------------------------------------------------------------
# Invalid input: clear errors
# --------------------------------------------------------------------------
INPUT_LAYERS = {
    "GradWhitenConv2d": (lambda: wl.GradWhitenConv2d(4, 3, 3), (2, 4, 5, 5)),
    "RecursiveWhitenConv2d": (lambda: wl.RecursiveWhitenConv2d(4, 3, 3), (2, 4, 5, 5)),
    "GradWhitenLinear": (lambda: wl.GradWhitenLinear(4, 3), (2, 4)),
    "RecursiveWhitenLinear": (lambda: wl.RecursiveWhitenLinear(4, 3), (2, 4)),
    "DirectWhiten": (lambda: wl.DirectWhiten(4), (2, 4, 5, 5)),
}


@pytest.mark.parametrize("name", sorted(INPUT_LAYERS))
@pytest.mark.parametrize("training", [True, False])
def test_invalid_input_errors_name_layer_expected_and_actual(name, training):
    make, shape = INPUT_LAYERS[name]
    layer = make().train(training)
    layer.layer_name = "layer3.1.conv2"
    good = torch.randn(shape)
    layer(good)  # valid input works
    before = {**state(layer), "partial block": layer.get_extra_state()}

    def check(exc, x, *fragments):
        with pytest.raises(exc) as info:
            layer(x)
        msg = str(info.value)
        assert name in msg and "'layer3.1.conv2'" in msg, msg
        for f in fragments:
            assert f in msg, (f, msg)

    wrong_c = list(shape)
    wrong_c[1 if len(shape) == 4 else -1] = 7
    check(ValueError, torch.randn(wrong_c), "expected 4", "got 7")
    check(TypeError, good.long(), "floating-point", "torch.int64")
    check(TypeError, torch.zeros(shape, dtype=torch.bool), "floating-point", "torch.bool")
    if name == "DirectWhiten":
        check(ValueError, torch.randn(4), "(B, C)", "(4,)")
    elif "Conv" in name:
        check(ValueError, torch.randn(2, 4), "(B, C, H, W)", "(2, 4)")
        check(ValueError, torch.randn(1, 2, 4, 5, 5), "(B, C, H, W)", "(1, 2, 4, 5, 5)")
    else:
        check(ValueError, torch.randn(()), "(*, in_features)", "()")
    if name != "DirectWhiten":  # a float dtype other than the weight's (outside autocast)
        check(TypeError, good.double(), "torch.float32", "torch.float64")
    with pytest.raises(TypeError, match=name):
        layer([1.0, 2.0])
    # rejected input left no trace in the statistics
    after = {**state(layer), "partial block": layer.get_extra_state()}
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert layer.batches_in_block == (1 if training else 0)


# --------------------------------------------------------------------------
# Fuzzing
# --------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(["grad", "recursive", "direct", "linear"]),
    batch=st.integers(0, 3),
    h=st.integers(1, 3),
    w=st.integers(1, 3),
    c=st.integers(1, 5),
    scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e3, 1e20]),
    offset=st.sampled_from([0.0, 1.0, -50.0]),
    constant=st.lists(st.booleans(), min_size=5, max_size=5),
    duplicate=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    channels_last=st.booleans(),
    block_size=st.integers(1, 2),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_fuzz_odd_shapes_and_values(kind, batch, h, w, c, scale, offset, constant, duplicate, dtype, channels_last,
                                    block_size, steps, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "grad":
        layer = wl.GradWhitenConv2d(c, 2, 3, padding=1, block_size=block_size, dtype=dtype)
    elif kind == "recursive":
        layer = wl.RecursiveWhitenConv2d(c, 2, 3, padding=1, bias=False, block_size=block_size, dtype=dtype)
    elif kind == "direct":
        layer = wl.DirectWhiten(c, block_size=block_size, dtype=dtype)
    else:
        layer = wl.GradWhitenLinear(c, 2, block_size=block_size, dtype=dtype)
    stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(steps):
            x = (torch.randn(batch, c, h, w, generator=g, dtype=torch.float64) + offset) * scale
            for i in range(c):
                if constant[i]:
                    x[:, i] = offset * scale  # zero variance
            if duplicate and c >= 2:
                x[:, c - 1] = x[:, 0]  # rank-deficient covariance
            x = x.to(dtype)
            if kind == "linear":
                x = x.permute(0, 2, 3, 1)  # (B, H, W, C): leading dims
            elif channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(kind == "direct")
            y = layer(x)
            if kind == "linear":
                assert y.shape == (batch, h, w, 2)
            else:
                assert y.shape == (batch, 2 if kind != "direct" else c, h, w)
                if channels_last and kind == "direct":
                    assert y.is_contiguous(memory_format=torch.channels_last)
                elif channels_last:
                    plain = Fn.conv2d(x.detach(), layer.weight.detach(), layer.bias, padding=1)
                    assert y.is_contiguous(memory_format=torch.channels_last) == plain.is_contiguous(
                        memory_format=torch.channels_last)
            assert y.dtype == dtype
            assert torch.isfinite(y).all()
            y.float().sum().backward()
            grad = x.grad if kind == "direct" else layer.weight.grad
            assert torch.isfinite(grad).all()
    folds = steps // block_size
    assert int(layer.num_blocks) + layer.skipped_folds == folds
    for name in STATE:
        if hasattr(layer, name):
            t = getattr(layer, name)
            assert t.dtype == stats_dtype, name
            assert torch.isfinite(t).all(), name
    if int(layer.num_blocks) == 0:
        assert torch.equal(layer.whitening_matrix, torch.eye(c, dtype=stats_dtype))
    # empty batches never count as non-finite
    if batch == 0:
        assert layer.nonfinite_blocks == 0 and int(layer.num_blocks) == 0


def test_one_nan_pixel_gives_one_warning_naming_the_layers_with_a_hint():
    """A NaN in one input reaches every whitening layer after it: one warning for the fold, naming the layers and
    saying what to do (before: one warning per layer, 18 for a ResNet-20, and no hint)."""
    model = wl.convert_model(wl.models.cifar_resnet(20, num_classes=10, width=4), "grad", block_size=1)
    x = torch.randn(4, 3, 8, 8)
    x[0, 0, 3, 3] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        model(torch.randn(4, 3, 8, 8))  # a later bad block of the same layers: said once per layer already
        x2 = torch.randn(4, 3, 8, 8)
        x2[1, 2, 0, 0] = float("inf")
        model(x2)
    mine = [w for w in caught if "non-finite" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    message = str(mine[0].message)
    assert "18 whitening layer(s)" in message and "'layer1.0.conv1'" in message and "and 12 more" in message
    assert "isfinite(loss)" in message
    assert all(layer.nonfinite_blocks == 2 for _, layer in wl.whitening_layers(model))
