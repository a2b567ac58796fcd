"""Running statistics: block timing, batch-split invariance, numerical soundness, validation."""
import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_utils import assert_states_close

import whitenlayers as wl


def feed(layer, batches):
    for b in batches:
        layer(b)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(2, 5),
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.integers(0, 100),
)
def test_statistics_invariant_to_batch_split(c, split_a, split_b, seed):
    """The same samples split differently into the batches of one block give the same fold."""
    g = torch.Generator().manual_seed(seed)
    total = max(sum(split_a), 1)
    x = torch.randn(total, c, 3, 3, generator=g, dtype=torch.float64) * 3 + 2
    # split_b rescaled to the same total
    cuts_b = np.cumsum(split_b)
    cuts_b = np.unique(np.round(cuts_b / max(cuts_b[-1], 1) * total).astype(int))
    parts_a = torch.split(x, [s for s in split_a if s > 0] or [total])
    parts_b = torch.tensor_split(x, cuts_b[:-1].tolist())
    la = wl.DirectWhiten(c, block_size=len(parts_a), dtype=torch.float64)
    lb = wl.DirectWhiten(c, block_size=len(parts_b), dtype=torch.float64)
    # a second block so that the recursion (and the block-0 shift) is exercised too
    y = torch.randn(5, c, 3, 3, generator=g, dtype=torch.float64) - 1
    feed(la, list(parts_a) + [y] * len(parts_a))
    feed(lb, list(parts_b) + [y] * len(parts_b))
    assert int(la.num_blocks) == int(lb.num_blocks) == 2
    for name in ("running_mean", "running_cov", "whitening_matrix"):
        torch.testing.assert_close(getattr(la, name), getattr(lb, name), rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    st.floats(-1e3, 1e3).filter(lambda v: abs(v) > 1.0),
    st.floats(1e-3, 1e-1),
    st.integers(2, 6),
    st.integers(0, 1000),
)
def test_accumulation_sound_when_mean_dominates(mean, std, c, seed):
    """Post-ReLU-like features with |mean| >> std: float32 statistics within 1e-3 of float64 truth."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(c, dtype=torch.float64) + 0.5 * torch.randn(c, c, generator=g, dtype=torch.float64)
    batches = []
    for _ in range(6):
        z = torch.randn(16, c, 8, 8, generator=g, dtype=torch.float64)
        batches.append(mean + std * torch.einsum("ij,bjhw->bihw", mix, z))
    layer = wl.DirectWhiten(c, block_size=3, alpha=0.5)
    feed(layer, [b.float() for b in batches])
    assert int(layer.num_blocks) == 2
    ref = wl.DirectWhiten(c, block_size=3, alpha=0.5, dtype=torch.float64)
    # reference from exact float64 samples (the float32 inputs, promoted)
    feed(ref, [b.float().double() for b in batches])
    cov, cov_ref = layer.running_cov.double(), ref.running_cov
    assert torch.linalg.matrix_norm(cov - cov_ref) <= 1e-3 * torch.linalg.matrix_norm(cov_ref)
    torch.testing.assert_close(layer.running_mean.double(), ref.running_mean, rtol=1e-6, atol=0)


def test_naive_accumulation_would_fail():
    """Sanity check of the previous test's premise: sum x x^T - n mu mu^T in float32 is useless here."""
    g = torch.Generator().manual_seed(0)
    x = (10 + 0.01 * torch.randn(4096, 3, generator=g)).float()
    naive = x.t() @ x / len(x) - torch.outer(x.mean(0), x.mean(0))
    true = torch.cov(x.double().t(), correction=0)
    assert torch.linalg.matrix_norm(naive.double() - true) > 1e-2 * torch.linalg.matrix_norm(true)


@pytest.mark.parametrize("cls", [wl.DirectWhiten, wl.GradWhitenConv2d, wl.RecursiveWhitenConv2d])
def test_block_timing(cls):
    """After n * block_size training forwards num_blocks == n and buffers hold block n-1's results."""
    c, L = 3, 4
    layer = cls(c, block_size=L) if cls is wl.DirectWhiten else cls(c, 2, 1, block_size=L)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, c, 4, 4, generator=g) * torch.tensor([1.0, 3.0, 0.3]).view(1, 3, 1, 1) + 1 for _ in range(2 * L)]
    snapshots = []
    for i, x in enumerate(xs):
        before = layer.whitening_matrix.clone()
        layer(x)
        if (i + 1) % L:
            torch.testing.assert_close(layer.whitening_matrix, before, rtol=0, atol=0)
        else:
            snapshots.append(layer.running_mean.clone())
        assert int(layer.num_blocks) == (i + 1) // L
    # block 1's mean: alpha * mu(0) + (1 - alpha) * mean of block 1
    block0 = torch.cat(xs[:L]).transpose(0, 1).reshape(c, -1).mean(1)
    block1 = torch.cat(xs[L:]).transpose(0, 1).reshape(c, -1).mean(1)
    torch.testing.assert_close(snapshots[0], block0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(snapshots[1], layer.alpha * block0 + (1 - layer.alpha) * block1, rtol=1e-5, atol=1e-6)


def test_eval_mode_never_updates():
    layer = wl.GradWhitenConv2d(3, 4, 3, block_size=1)
    layer(torch.randn(2, 3, 5, 5))
    layer.eval()
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # the partial block too (_extra_state)
    for _ in range(3):
        layer(torch.randn(2, 3, 5, 5) * 5)
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    assert layer.batches_in_block == 0


def test_stats_fraction_opt_in():
    assert wl.GradWhitenConv2d(3, 4, 1).stats_fraction == 1.0
    layer = wl.DirectWhiten(2, block_size=1, stats_fraction=0.5)
    x = torch.cat([torch.zeros(2, 2, 8, 8), torch.ones(2, 2, 8, 8) * 9])
    layer(x)
    torch.testing.assert_close(layer.running_mean, torch.zeros(2))  # only the leading half was used


def test_stats_fraction_keeps_enough_rows():
    """The fraction thins out rows to spare, never a batch with few rows per feature (a linear layer)."""
    layer = wl.GradWhitenLinear(4, 3, block_size=1, stats_fraction=0.25)
    x = torch.cat([torch.zeros(32, 4), torch.ones(32, 4) * 8])  # 64 rows: 16 per feature, all of them needed
    layer(x)
    torch.testing.assert_close(layer.running_mean, torch.full((4,), 4.0))
    conv = wl.GradWhitenConv2d(2, 3, 1, block_size=1, stats_fraction=0.25)
    conv(torch.cat([torch.zeros(4, 2, 8, 8), torch.ones(12, 2, 8, 8)]))  # 64 rows per sample: a quarter suffices
    torch.testing.assert_close(conv.running_mean, torch.zeros(2))


BAD = [
    ("block_size", 0), ("block_size", 2.5), ("alpha", 1.0), ("alpha", -0.1), ("beta", 1.0),
    ("eps", 0.0), ("gmax", 0.5), ("alpha", float("nan")), ("stats_fraction", 0.0),
]
BAD_REC = [("gamma", 0.0), ("gamma", 1.5), ("delta", 0.0), ("c_rel", -1.0), ("c_abs", -1e-6), ("beta", -0.2)]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_hyperparameters_raise(name, value):
    with pytest.raises(ValueError, match=name):
        wl.GradWhitenConv2d(3, 4, 3, **{name: value})
    if name != "beta":
        with pytest.raises(ValueError, match=name):
            wl.DirectWhiten(3, **{name: value})


@pytest.mark.parametrize("name,value", BAD_REC)
def test_invalid_recursive_hyperparameters_raise(name, value):
    with pytest.raises(ValueError, match=name):
        wl.RecursiveWhitenConv2d(3, 4, 3, **{name: value})
    with pytest.raises(ValueError, match=name):
        wl.RecursiveWhitenLinear(3, 4, **{name: value})


@settings(max_examples=30, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_alpha_validation_is_exact(alpha):
    ok = math.isfinite(alpha) and 0.0 <= alpha < 1.0
    if ok:
        wl.DirectWhiten(2, alpha=alpha)
    else:
        with pytest.raises(ValueError, match="alpha"):
            wl.DirectWhiten(2, alpha=alpha)


def test_reset_running_stats_keeps_function():
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=1, bias=False)
    x = torch.randn(4, 3, 6, 6) + 4
    layer(x)
    layer(x)
    layer.eval()
    y = layer(x)
    layer.reset_running_stats()
    assert int(layer.num_blocks) == 0
    torch.testing.assert_close(layer.whitening_matrix, torch.eye(3))
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-5)


def test_fold_now_and_num_blocks_counts_only_real_folds():
    layer = wl.DirectWhiten(2, block_size=100)
    layer(torch.randn(8, 2))
    layer.fold()
    assert int(layer.num_blocks) == 1
    with pytest.warns(RuntimeWarning, match="no samples"):
        layer.fold()  # empty block: skipped, counted
    assert int(layer.num_blocks) == 1 and layer.skipped_folds == 1


@pytest.mark.parametrize("cls", [wl.GradWhitenConv2d, wl.RecursiveWhitenConv2d])
def test_stats_every_gathers_the_first_of_every_k_forwards_and_folds_after_block_size(cls):
    """stats_every=2, block_size=4: the block's statistics are those of forwards 0 and 2 alone, exactly as a layer
    with block_size=2 fed only those batches; forwards 1 and 3 gather nothing but still count toward the block."""
    torch.manual_seed(0)
    make = lambda **kw: cls(3, 4, 3, padding=1, bias=False, **kw)  # noqa: E731
    scheduled, dense = make(block_size=4, stats_every=2), make(block_size=2)
    with pytest.warns(UserWarning, match=r"block_size=4 \(this layer: 2\), stats_every=2 \(this layer: 1\); the layer "
                                         "keeps its own hyper-parameters"):
        dense.load_state_dict(scheduled.state_dict())  # the same weights; each keeps its schedule
    xs = [torch.randn(4, 3, 6, 6) * torch.tensor([1.0, 3.0, 0.3]).view(1, 3, 1, 1) + i for i in range(8)]
    for i, x in enumerate(xs):
        scheduled(x)
        if i % 2 == 0:
            dense(x)
        if i in (1, 2):
            assert scheduled.batches_in_block == i + 1 and int(scheduled.num_blocks) == 0
    assert int(scheduled.num_blocks) == int(dense.num_blocks) == 2
    for name in ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "bias_correction"):
        assert torch.equal(getattr(scheduled, name), getattr(dense, name)), name
    with pytest.raises(ValueError, match=r"stats_every \(.+\) must be an integer >= 1, but got stats_every=0"):
        make(stats_every=0)


def test_public_block_api_feeds_times_and_discards_blocks():
    """accumulate / block_statistics / fold(block) / discard_block: what a benchmark needs without internals."""
    torch.manual_seed(0)
    layer = wl.GradWhitenLinear(4, 2, bias=False, block_size=10**6)
    x = torch.randn(64, 4, dtype=torch.float32) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + 1
    layer.accumulate(x)
    summary = layer.block_statistics()
    torch.testing.assert_close(summary.mean, x.double().mean(0))
    assert int(layer.batches_in_block) == 0  # accumulate counts no batch
    layer.fold(summary)  # on the given block: the accumulated one stays
    first = layer.whitening_matrix.clone()
    assert int(layer.num_blocks) == 1
    assert float(layer.block_statistics().count) == 0  # a fold starts a new block
    layer.accumulate(x)
    layer.discard_block()
    assert float(layer.block_statistics().count) == 0
    layer.accumulate(x)
    layer.fold()
    assert int(layer.num_blocks) == 2 and not torch.equal(layer.whitening_matrix, first)
    with pytest.raises(ValueError, match="features on dim 1"):
        layer.accumulate(torch.randn(3, 5))


@pytest.mark.parametrize("fused", [False, True])
def test_a_batch_of_another_rank_mid_block_is_summed_about_the_block_shift(fused):
    """A block's shift is kept as its first batch subtracts it (rank 4 for a convolution's input); a batch of
    another rank in the same block (``accumulate`` of ``(P, M)`` rows, as ``benchmarks/gpu.py`` times a fold) is
    summed about the same shift, not broadcast against it (which made a ``(1, M, P, M)`` tensor)."""
    gen = torch.Generator().manual_seed(0)
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=10)
    x = torch.randn(4, 3, 5, 5, generator=gen) * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1) + 3
    rows = torch.randn(40, 3, generator=gen) + 3
    with wl.functional.fused_moments(fused):
        layer(x)  # the first block: shifted by this batch's mean, kept as (1, 3, 1, 1)
        layer.accumulate(rows)
        summary = layer.block_statistics()
    every = torch.cat([x.permute(0, 2, 3, 1).reshape(-1, 3), rows]).double()
    assert float(summary.count) == every.shape[0]
    torch.testing.assert_close(summary.mean, every.mean(0), rtol=1e-6, atol=1e-6)


def test_block_sums_keep_aligned_rows_through_casts_copies_and_checkpoints():
    """The partial block's accumulator has moments_accumulator's aligned rows (what CUDA's statistics product is
    fast on) from the start, after a cast (float64 and back: `.to` copies a strided view contiguous), a deepcopy and
    a checkpoint round trip, and its sums survive each."""
    import copy

    torch.manual_seed(0)
    layer = wl.GradWhitenConv2d(5, 4, 3, padding=1, block_size=100)
    layer(torch.randn(3, 5, 4, 4) + 1)
    before = layer.block_statistics()

    def check(lay, dtype=torch.float32):
        acc = lay._block.acc
        assert acc.shape == (6, 6) and acc.stride(0) % 8 == 0 and acc.dtype == dtype
        assert lay._block.s2.data_ptr() == acc.data_ptr()  # the fold's views are views of it
        got = lay.block_statistics()
        assert float(got.count) == float(before.count)
        torch.testing.assert_close(got.mean, before.mean)
        torch.testing.assert_close(got.scatter, before.scatter)

    check(layer)
    check(layer._apply(lambda t: t.clone()))  # what a move to another device does: a strided view copied contiguous
    check(layer.double(), torch.float64)
    check(layer.float())
    check(copy.deepcopy(layer))
    fresh = wl.GradWhitenConv2d(5, 4, 3, padding=1, block_size=100)
    fresh.load_state_dict(layer.state_dict())
    check(fresh)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_two_op_statistics_path_trains_like_the_cpu_path(method):
    """The statistics' two-op path (a concatenation with ones and one product, what CUDA runs) and the CPU path
    (product, sums and adds) give the same training, up to the order of float64 sums."""
    def run(fused):
        torch.manual_seed(0)
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4).double(), method, block_size=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        with wl.functional.fused_moments(fused):
            for _ in range(7):
                x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 1
                opt.zero_grad()
                model(x).logsumexp(1).mean().backward()
                opt.step()
        return model.state_dict()

    assert_states_close(run(True), run(False), rtol=1e-10, atol=1e-12)


def _assert_float32_close_to_twin(layer, twin, blocks=3):
    """mu, Phi_x and T of a float32 layer within float32 rounding of its float64 twin (relative Frobenius)."""
    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert int(layer.num_blocks) == blocks
    assert rel(layer.running_mean, twin.running_mean) < 1e-6
    assert rel(layer.running_cov, twin.running_cov) < 1e-5
    assert rel(layer.whitening_matrix, twin.whitening_matrix) < 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_float32_block_sums_are_accurate_against_a_float64_twin(fused):
    """The block's sums accumulate in float32 (float64 only from the fold on): on post-ReLU activations with a
    large mean (summed unshifted after the first block) and on shifted ones, mu, Phi_x and T stay within float32
    rounding of a float64 layer fed the same inputs (float32 values are exact in float64)."""
    gen = torch.Generator().manual_seed(0)
    layer = wl.GradWhitenConv2d(16, 8, 3, padding=1, block_size=10)
    twin = wl.GradWhitenConv2d(16, 8, 3, padding=1, block_size=10, dtype=torch.float64)
    scale = torch.linspace(0.2, 3.0, 16).view(1, 16, 1, 1)
    with wl.functional.fused_moments(fused):
        for step in range(30):
            x = torch.relu(torch.randn(32, 16, 8, 8, generator=gen) * scale + 0.5) + (5.0 if step >= 20 else 0.0)
            layer(x)
            twin(x.double())

    _assert_float32_close_to_twin(layer, twin)


def test_bf16_batches_reach_the_product_as_they_are_and_match_a_float64_twin():
    """CUDA's path for bf16 activations, emulated on the CPU (``fused_moments``): a batch summed about 0 reaches
    the statistics' product in bf16 (no float32 copy of the batch), a shifted one (the first block, and the
    block after a large mean) in float32. Either way mu, Phi_x and T stay within float32 rounding of a float64
    layer fed the same bf16 numbers."""
    gen = torch.Generator().manual_seed(0)
    layer = wl.GradWhitenConv2d(16, 8, 3, padding=1, block_size=10)
    twin = wl.GradWhitenConv2d(16, 8, 3, padding=1, block_size=10, dtype=torch.float64)
    scale = torch.linspace(0.2, 3.0, 16).view(1, 16, 1, 1)
    seen = []
    real = wl.functional.batch._product_add
    with pytest.MonkeyPatch.context() as mp, wl.functional.fused_moments(True):
        mp.setattr(wl.functional.batch, "_product_add", lambda out, left, right: (seen.append(left.dtype),
                                                                                    real(out, left, right)))
        for step in range(30):
            x = (torch.relu(torch.randn(32, 16, 8, 8, generator=gen) * scale)
                 + (5.0 if step >= 20 else 0.0)).bfloat16()
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as a model under autocast feeds it
                layer(x)
            twin(x.double())
    # block 1: shifted (its first batch's mean); blocks 2 and 3 about 0 (ReLU outputs: mean^2 <= 3 var; block 3's
    # jump in the mean is summed about 0 still: decided on block 2), so bf16 from batch 11 on
    seen = [dt for dt in seen if dt != torch.float64]  # the twin's
    assert seen[:10] == [torch.float32] * 10 and seen[10:] == [torch.bfloat16] * 20

    _assert_float32_close_to_twin(layer, twin)


def _trained_steps(model, steps, seed=0, **opt):
    """``steps`` SGD steps of a converted model on random data (float64 where the model is)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=dtype) + 1
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_a_fold_writes_every_buffer_in_place(method, absorb):
    """Every buffer keeps its tensor and its storage across folds (a captured CUDA graph reads static addresses,
    ``functional_call`` puts the module's own tensors back after the call), and the folds change their values."""
    model = wl.convert_model(wl.models.cifar_resnet(8, num_classes=10, width=4), method, block_size=2,
                             absorb_centring=absorb)
    layers = [layer for _, layer in wl.whitening_layers(model)]
    before = {name: (t, t.data_ptr(), t.clone()) for name, t in model.named_buffers()}
    _trained_steps(model, 7)  # 3 folds
    assert all(int(layer.num_blocks) == 3 for layer in layers)
    after = dict(model.named_buffers())
    assert after.keys() == before.keys()
    moved = [name for name, t in after.items() if t is not before[name][0] or t.data_ptr() != before[name][1]]
    assert moved == []
    changed = {name.rsplit(".", 1)[1] for name, t in after.items() if not torch.equal(t, before[name][2])}
    assert {"running_mean", "running_cov", "whitening_matrix", "num_blocks"} <= changed


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_functional_call_with_the_buffers_keeps_every_fold(method):
    """``torch.func.functional_call(model, {**params, **buffers}, x)`` trains like calling the model: the folds
    write into the tensors passed (the module's own), which the call puts back afterwards."""
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, num_classes=10, width=4), method, block_size=1).double()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 3, 16, 16, generator=g, dtype=torch.float64) + 1 for _ in range(3)]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for x in xs:
        torch.func.functional_call(model, state, (x,))
        twin(x)
    layer = wl.whitening_layers(model)[0][1]
    assert int(layer.num_blocks) == 3 and layer.running_mean.abs().max() > 0
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(a, b), name
    x = torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64)
    assert torch.equal(model.eval()(x), twin.eval()(x))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "double"])
def test_a_copied_or_cast_layer_sums_into_its_own_accumulator(how):
    """The eager hot path writes into the accumulator's blocks as sliced once per accumulator: a copy, a pickle
    or a float64 cast of a copy of a layer mid-block (CUDA's two-product path, channels_last batches) sums its
    next batch into its own accumulator, and the original's block is left as it was."""
    import copy
    import pickle

    g = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64).to(memory_format=torch.channels_last)
              for _ in range(2))
    dtype = torch.float32 if how == "double" else torch.float64
    x1 = x1.to(dtype)  # float32 values, exactly float64 too (the reference's first batch)
    with wl.functional.fused_moments(True):
        layer = wl.GradWhitenConv2d(4, 2, 3, padding=1, block_size=100).to(dtype)
        layer(x1)
        before = layer.block_statistics()
        other = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
                 "double": lambda m: copy.deepcopy(m).double()}[how](layer)
        other(x2)
        ref = wl.GradWhitenConv2d(4, 2, 3, padding=1, block_size=100).double()
        ref(x1.double())
        ref(x2)
        got, want = other.block_statistics(), ref.block_statistics()
        assert float(got.count) == float(want.count) == 2 * 3 * 25
        tol = 1e-5 if how == "double" else 1e-12  # float32 sums of the first batch, cast with the layer
        torch.testing.assert_close(got.mean, want.mean, rtol=tol, atol=tol)
        torch.testing.assert_close(got.scatter, want.scatter, rtol=tol, atol=tol * 100)
        after = layer.block_statistics()
        assert float(after.count) == float(before.count) and torch.equal(after.scatter, before.scatter)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_a_backward_after_an_in_place_fold_uses_the_transform_of_its_forward(method):
    """The fold that follows a block's last forward writes ``Q_s`` and ``mu`` in place; that forward's backward
    (and one of an earlier forward still pending: two views per step) uses the values in force at its forward."""
    cls = wl.GradWhitenConv2d if method == "grad" else wl.RecursiveWhitenConv2d
    torch.manual_seed(0)
    layer = cls(3, 4, 3, padding=1, block_size=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    layer(xs[0]).sum().backward()  # a first fold: Q_s no longer the identity
    layer.weight.grad = None
    expected = torch.zeros_like(layer.weight)
    outs = []
    for x in xs[1:]:  # two forwards, each followed by a fold, then one backward
        q, mu = layer.grad_transform.clone(), layer.running_mean.clone()
        w = layer.weight.detach().clone().requires_grad_(True)
        # conv(pad0(x) - mu, W) + b + c: the layer's function (centred after zero padding)
        out = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1)) - mu.view(1, -1, 1, 1), w,
                                         (layer.bias + layer.bias_correction).detach())
        out.square().sum().backward()
        expected += wl.functional.transform_weight_grad(w.grad, q)
        outs.append(layer(x))
        assert not torch.equal(layer.grad_transform, q) and not torch.equal(layer.running_mean, mu)  # folded
        torch.testing.assert_close(outs[-1], out, rtol=0, atol=1e-12)
    sum(o.square().sum() for o in outs).backward()
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-12, atol=1e-12)
