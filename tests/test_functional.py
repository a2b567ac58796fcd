"""Pure maths: moments, rank, whiteness, EVD transform, weight-gradient transform."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from whitenlayers import functional as F

torch.set_default_dtype(torch.float32)


def random_spd(m, cond=100.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=dtype))
    lam = torch.logspace(0, -math.log10(cond), m, dtype=dtype)
    return (q * lam) @ q.t()


# ----------------------------------------------------------------- rank, rho
def test_effective_rank_limits():
    assert F.effective_rank(torch.ones(7, dtype=torch.float64)).item() == pytest.approx(7.0)
    assert F.effective_rank(torch.tensor([2.0, 0.0, 0.0, 0.0])).item() == pytest.approx(1.0)
    # negative rounding noise is clamped to 0
    assert F.effective_rank(torch.tensor([1.0, -1e-9])).item() == pytest.approx(1.0)


@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=20), st.floats(1e-3, 1e3))
def test_effective_rank_bounds_and_scale_invariance(vals, scale):
    lam = torch.tensor(vals, dtype=torch.float64)
    r = F.effective_rank(lam).item()
    assert 1.0 - 1e-9 <= r <= len(vals) + 1e-9
    if lam.sum() > 0:
        assert F.effective_rank(lam * scale).item() == pytest.approx(r, rel=1e-9)


def test_normalized_rank_identity_and_rank_one():
    assert F.normalized_rank(torch.eye(5, dtype=torch.float64)).item() == pytest.approx(1.0)
    u = torch.randn(6, dtype=torch.float64)
    assert F.normalized_rank(torch.outer(u, u)).item() == pytest.approx(1 / 6, rel=1e-6)


def test_whiteness_limits():
    assert F.whiteness(torch.diag(torch.tensor([1.0, 3.0, 7.0, 0.5]))).item() == pytest.approx(1.0)
    u = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5])
    assert F.whiteness(torch.outer(u, u)).item() == pytest.approx(1 / 5, rel=1e-6)
    # zero-variance feature: treated as white, no NaN
    c = torch.diag(torch.tensor([1.0, 0.0, 2.0]))
    assert F.whiteness(c).item() == pytest.approx(1.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.integers(0, 10_000))
def test_whiteness_range(m, seed):
    a = torch.randn(m, 2 * m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rho = F.whiteness(a @ a.t()).item()
    assert 1.0 / m - 1e-9 <= rho <= 1.0 + 1e-9


# ------------------------------------------------------------------- moments
def _np_reference(blocks, alpha):
    """Moment recursion computed from raw samples in float64 numpy."""
    mu = cov = None
    for i, b in enumerate(blocks):  # b: (P, M)
        b = np.asarray(b, dtype=np.float64)
        if i == 0:
            mu = b.mean(0)
            d = b - mu
            cov = d.T @ d / len(b)
        else:
            mu = alpha * mu + (1 - alpha) * b.mean(0)
            d = b - mu
            cov = alpha * cov + (1 - alpha) * d.T @ d / len(b)
    return mu, cov


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.floats(0.0, 0.95), st.integers(0, 1000))
def test_fold_moments_matches_sample_reference(m, nblocks, alpha, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(37, m, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(nblocks)]
    mu = torch.zeros(m, dtype=torch.float64)
    cov = torch.zeros(m, m, dtype=torch.float64)
    for i, b in enumerate(blocks):
        shift = b[0]
        s1, s2 = F.batch_moments(b, shift)
        summ = F.summarize_block(torch.tensor(float(len(b))), shift, s1, s2)
        mu, cov = F.fold_moments(mu, cov, summ, alpha, first=(i == 0))
    ref_mu, ref_cov = _np_reference([b.numpy() for b in blocks], alpha)
    np.testing.assert_allclose(mu.numpy(), ref_mu, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(cov.numpy(), ref_cov, rtol=1e-10, atol=1e-12)


def test_batch_moments_layouts_agree():
    x = torch.randn(3, 5, 4, 6)
    shift = torch.randn(5)
    s1a, s2a = F.batch_moments(x, shift)
    s1b, s2b = F.batch_moments(x.contiguous(memory_format=torch.channels_last), shift)
    rows = (x - shift.view(1, 5, 1, 1)).permute(0, 2, 3, 1).reshape(-1, 5)
    torch.testing.assert_close(s1a, rows.sum(0))
    torch.testing.assert_close(s2a, rows.t() @ rows)
    torch.testing.assert_close(s1b, s1a)
    torch.testing.assert_close(s2b, s2a)


# --------------------------------------------------------------- EVD transform
@settings(max_examples=20, deadline=None)
@given(st.integers(2, 16), st.floats(1.0, 1e3), st.integers(0, 1000))
def test_zca_whitens_exactly(m, cond, seed):
    phi = random_spd(m, cond, seed)
    t, q = F.evd_transform(phi, eps=1e-12, gmax=10.0, gains="zca")
    torch.testing.assert_close(t, t.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(q, t.t() @ t, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(t @ phi @ t.t(), torch.eye(m, dtype=phi.dtype), rtol=1e-8, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 16), st.floats(1.0, 1e4), st.floats(1.0, 50.0), st.integers(0, 1000))
def test_practical_gains_spectrum(m, cond, gmax, seed):
    """T Phi T^T: signal subspace at the average power unless the gain is capped; noise subspace untouched."""
    phi = random_spd(m, cond, seed)
    t, q = F.evd_transform(phi, eps=1e-12, gmax=gmax, gains="practical")
    torch.testing.assert_close(t, t.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(q, t.t() @ t, rtol=1e-9, atol=1e-9)
    lam, vec = torch.linalg.eigh(phi)
    lam, vec = lam.flip(0), vec.flip(1)
    ms = min(max(round(F.effective_rank(lam).item()), 1), m)
    # T shares phi's eigenvectors: its Rayleigh quotients along them are the whitened powers.
    out = torch.einsum("im,ij,jm->m", vec, t @ phi @ t.t(), vec)
    expected = torch.where(
        torch.arange(m) < ms, torch.minimum(lam.mean().expand(m), gmax * lam), lam
    )
    torch.testing.assert_close(out, expected, rtol=1e-7, atol=1e-10)
    gains = torch.einsum("im,ij,jm->m", vec, q, vec)
    assert bool((gains <= gmax * (1 + 1e-9)).all())


def test_whitening_gains_rejects_unknown_rule():
    with pytest.raises(ValueError, match="gains"):
        F.whitening_gains(torch.ones(3), eps=1e-5, gmax=10, gains="pca")


def test_robust_eigh_rejects_nonfinite():
    phi = torch.eye(3)
    phi[0, 1] = float("nan")
    assert F.robust_eigh(phi) is None
    assert F.evd_transform(phi, eps=1e-5, gmax=10) is None


def test_robust_eigh_retries_in_float64(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def flaky(a, *args, **kw):
        calls.append(a.dtype)
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected")
        return real(a, *args, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    lam, vec = F.robust_eigh(random_spd(4, dtype=torch.float32))
    assert calls == [torch.float32, torch.float64]
    assert lam.dtype == torch.float64 and bool((lam[:-1] >= lam[1:]).all())


# ------------------------------------------------------- weight-grad transform
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([(), (1, 1), (3, 3), (2, 5)]))
def test_transform_weight_grad_per_tap(s, m, kernel):
    g = torch.randn((s, m) + kernel, dtype=torch.float64)
    q = torch.randn(m, m, dtype=torch.float64)
    out = F.transform_weight_grad(g, q)
    if kernel:
        ref = torch.einsum("sihw,ij->sjhw", g, q)
    else:
        ref = g @ q
    torch.testing.assert_close(out, ref)


@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([(1, 1), (3, 3), (2, 5), (2, 3, 2)]))
def test_transform_weight_grad_keeps_a_channels_last_layout(s, m, kernel):
    """A channels_last gradient (a model moved to channels_last) is transformed as the (S * taps, M) matrix it is
    in memory: the same values, the same layout."""
    g = torch.randn((s, m) + kernel, dtype=torch.float64)
    q = torch.randn(m, m, dtype=torch.float64)
    fmt = torch.channels_last if g.dim() == 4 else torch.channels_last_3d
    out = F.transform_weight_grad(g.contiguous(memory_format=fmt), q)
    torch.testing.assert_close(out, torch.einsum("si...,ij->sj...", g, q), rtol=1e-12, atol=1e-12)
    assert out.is_contiguous(memory_format=fmt)


# ----------------------------------------------------------------- the hot path's batch sums
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 4), st.sampled_from([1, 2, 3, 6]), st.sampled_from(["2d", "nchw", "channels_last"]),
       st.booleans(), st.integers(0, 10_000))
def test_batch_sums_are_the_sums_about_the_shift(batch, groups, layout, shifted, seed):
    """s1 = sum (x - k), s2 = sum (x - k)(x - k)^T (its diagonal blocks for groups > 1), against float64."""
    g = torch.Generator().manual_seed(seed)
    m = 6
    x = torch.randn(batch, m, 3, 4, generator=g) * 2 + 3 if layout != "2d" else torch.randn(batch, m, generator=g) + 3
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    k = torch.randn(m, generator=g) + 3
    shift = k.view((1, m) + (1,) * (x.dim() - 2)) if shifted else None
    s1, s2 = F.batch_sums(x, shift, groups)
    xd = x.double()
    if shifted:
        xd = xd - k.double().view((1, m) + (1,) * (x.dim() - 2))
    rows = xd.transpose(0, 1).reshape(m, -1)
    want2 = rows @ rows.t()
    if groups > 1:
        c = m // groups
        want2 = torch.stack([want2[i * c:(i + 1) * c, i * c:(i + 1) * c] for i in range(groups)])
    assert s1.dtype == s2.dtype == x.dtype and s2.shape == want2.shape
    torch.testing.assert_close(s1.double(), rows.sum(1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(s2.double(), want2, rtol=1e-5, atol=1e-3)


def test_unshifted_accurate_is_mean_squared_against_variance():
    def block(mean, var, n=100.0):
        mean = torch.tensor(mean, dtype=torch.float64)
        return F.BlockSummary(torch.tensor(n, dtype=torch.float64), mean, None,
                              n * (torch.tensor(var, dtype=torch.float64) + mean.square()))
    assert F.unshifted_accurate(block([1.0, 0.5], [1.0, 1.0]), 3.0)
    assert F.unshifted_accurate(block([1.7], [1.0]), 3.0)  # 2.89 <= 3
    assert not F.unshifted_accurate(block([1.8], [1.0]), 3.0)  # 3.24 > 3
    assert not F.unshifted_accurate(block([float("nan")], [1.0]), 3.0)


# --------------------------------------------------------------------------
# accumulate_moments: the two-op path (CUDA's) and the CPU's agree with batch_sums
# --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(b=st.integers(0, 4), m=st.integers(1, 6), hw=st.sampled_from([(), (1,), (3, 2), (2, 2, 2)]),
       layout=st.sampled_from(["contiguous", "channels_last"]), shifted=st.booleans(), fused=st.booleans(),
       aligned=st.booleans(), seed=st.integers(0, 2**16))
def test_accumulate_moments_equals_batch_sums(b, m, hw, layout, shifted, fused, aligned, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((b, m) + hw, generator=gen, dtype=torch.float64) * 3 + 2
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    shift = torch.randn(m, generator=gen, dtype=torch.float64).view((1, m) + (1,) * len(hw)) if shifted else None
    acc = F.moments_accumulator(m, torch.float64) if aligned else torch.zeros(m + 1, m + 1, dtype=torch.float64)
    with F.fused_moments(fused):
        for _ in range(2):
            F.accumulate_moments(acc, x, shift)
    s1, s2 = F.batch_sums(x, shift)
    tol = {"rtol": 1e-12, "atol": 1e-10}  # float64 sums of at most 32 rows, in another order
    torch.testing.assert_close(acc[:m, :m], 2 * s2, **tol)
    torch.testing.assert_close(acc[:m, m], 2 * s1, **tol)
    if aligned:  # the padding of the aligned rows is never written
        assert not acc._base[:, m + 1:].any()


def test_moments_accumulator_rows_are_aligned():
    """The statistics' product writes an (M, M) block whose rows start at multiples of 8 elements (32 bytes in
    float32: what cuBLAS's fast kernels need), for any M; the accumulator is zero and (M + 1, M + 1)."""
    for m in (1, 3, 7, 8, 64, 255, 256):
        acc = F.moments_accumulator(m)
        assert acc.shape == (m + 1, m + 1) and acc.stride(0) % 8 == 0 and acc.stride(1) == 1
        assert acc.dtype == torch.float32 and not acc.any()
        assert acc[:m, :m].stride() == (acc.stride(0), 1)


def _sums_float64(x, shift=None):
    """``batch_sums`` of ``x`` (any dtype) in float64: the reference of the float32 / low-precision products."""
    return F.batch_sums(x.double(), None if shift is None else shift.double())


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), m=st.integers(1, 6), hw=st.sampled_from([(), (3, 2), (4, 4)]),
       layout=st.sampled_from(["contiguous", "channels_last"]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       shifted=st.booleans(), seed=st.integers(0, 2**16))
def test_accumulate_moments_low_precision(b, m, hw, layout, dtype, shifted, seed):
    """CUDA's path, emulated on the CPU within fused_moments: a bf16 / fp16 batch summed about 0 reaches the product
    as it is (float32 accumulation of exact products: the float32 sums of the same numbers), a shifted one is
    converted first. Checked against float64 sums of the same low-precision numbers."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn((b, m) + hw, generator=gen) * 2 + 1).to(dtype)
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    shift = torch.randn(m, generator=gen).view((1, m) + (1,) * len(hw)) if shifted else None
    acc = F.moments_accumulator(m)
    seen = []
    real_rows, real_product = F.batch._moment_products, F.batch._product_add
    with pytest.MonkeyPatch.context() as mp, F.fused_moments(True):
        # what reaches the products: the rows' two (x^T x and x^T 1), or else one (M + 1) product
        mp.setattr(F.batch, "_moment_products", lambda s2, s1, rows, traced: (seen.append(rows.dtype),
                                                                                real_rows(s2, s1, rows, traced)))
        mp.setattr(F.batch, "_product_add", lambda out, left, right: (seen.append(left.dtype),
                                                                        real_product(out, left, right)))
        F.accumulate_moments(acc, x, shift)
    rows = F.batch._as_rows(x) is not None
    products = [torch.float32 if shifted else dtype] * (1 if not rows else 3)  # (the rows' two: each float32)
    if rows and not shifted:  # converted once in the rows' products (the CPU has no bf16 product into float32)
        products[1:] = [torch.float32] * 2
    assert seen == products  # converted only when shifted
    s1, s2 = _sums_float64(x, shift)
    n = x.numel() // m
    scale = float(s2.diagonal().abs().max()) + 1.0
    eps = torch.finfo(torch.float32).eps
    tol = {"rtol": 0.0, "atol": 8 * n * eps * scale}  # float32 sums of n exact products: n ulps of the largest
    torch.testing.assert_close(acc[:m, :m].double(), s2, **tol)
    torch.testing.assert_close(acc[:m, m].double(), s1, rtol=0.0, atol=8 * n * eps * (float(s1.abs().max()) + 1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's low-precision product")
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_accumulate_moments_cuda_bf16_matches_float64(layout):
    """On CUDA a bf16 batch goes into the product as it is (tensor cores, float32 output): the sums match float64
    sums of the same bf16 numbers to float32 accuracy."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(64, 32, 28, 28, device="cuda", generator=gen).relu() + 0.5).bfloat16()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    acc = F.moments_accumulator(32, device="cuda")
    F.accumulate_moments(acc, x, None)
    F.accumulate_moments(acc, x, None)
    s1, s2 = _sums_float64(x)
    rel = float((acc[:32, :32].double() - 2 * s2).norm() / (2 * s2).norm())
    assert rel < 1e-5, rel
    assert float((acc[:32, 32].double() - 2 * s1).norm() / (2 * s1).norm()) < 1e-5


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 4), m=st.integers(1, 6), hw=st.sampled_from([(), (3, 2), (4, 4)]),
       layout=st.sampled_from(["contiguous", "channels_last"]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       offset=st.sampled_from([0.0, 0.3, 5.0, 100.0]), seed=st.integers(0, 2**16))
def test_accumulate_moments_split_matches_float64(b, m, hw, layout, dtype, offset, seed):
    """A compiled layer's statistics of a bf16 / fp16 batch about a float32 shift (CUDA's products emulated on the
    CPU): the float32 differences split in two bf16 numbers leave at most 2^-18 of each difference out of the
    products, so the sums are float64's of the same differences to that and float32's accumulation. Post-ReLU
    batches far from and near the shift; the shift near, not at, the batch mean (as a block's shift is)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.relu(torch.randn((b, m) + hw, generator=gen) * 2) + offset).to(dtype)
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    dims = [0] + list(range(2, x.dim()))
    shift = (x.float().mean(dims) + 0.1 * torch.randn(m, generator=gen)).view((1, m) + (1,) * len(hw))
    acc = F.moments_accumulator(m)
    with F.fused_moments(True):
        F.accumulate_moments_split(acc, x, shift)
        F.accumulate_moments_split(acc, x, shift)
    d = x.float() - shift  # the float32 differences both paths start from
    s1, s2 = (2 * s for s in F.batch_sums(d.double(), None))
    n = 2 * x.numel() // m
    scale = float(s2.diagonal().abs().max()) + 1e-30  # bounds |sum d_i d_j| (Cauchy-Schwarz)
    eps = torch.finfo(torch.float32).eps
    atol = (8 * n * eps + 4 * 2.0 ** -18) * scale
    torch.testing.assert_close(acc[:m, :m].double(), s2, rtol=0.0, atol=atol)
    torch.testing.assert_close(acc[:m, m].double(), s1, rtol=0.0,
                               atol=8 * n * eps * (float(d.double().abs().sum(dims).max()) + 1e-30))
    if F.batch._as_rows(x) is not None:  # the split's products (else accumulate_moments' concatenation, float32)
        assert not acc[m].any() and not acc._base[:, m + 1:].any()  # nothing else written


def test_accumulate_moments_split_is_accurate_where_one_bf16_rounding_is_not():
    """Why two bf16 numbers per difference: ``x - shift`` rounded to bf16 once is biased (its rounding is the same
    for every element of a binade of the discrete bf16 inputs), ~1e-3 of the covariance on post-ReLU activations;
    the split is within ~1e-5 (measured by a probe since retired, in git's history)."""
    gen = torch.Generator().manual_seed(0)
    m = 32
    x = (torch.relu(torch.randn(16384, m, generator=gen) * torch.linspace(0.2, 3.0, m)) + 0.3).bfloat16()
    mean = x.double().mean(0)
    cov = (x.double() - mean).t() @ (x.double() - mean) / x.shape[0]
    shift = (mean + 0.05 * torch.randn(m, generator=gen, dtype=torch.float64)).float().view(1, m)

    def errors(acc, k):
        n, s1, s2 = x.shape[0], acc[:m, m].double(), acc[:m, :m].double()
        mu = k.double().view(m) + s1 / n
        c = s2 / n - torch.outer(s1 / n, s1 / n)
        return float((mu - mean).norm() / mean.norm()), float((c - cov).norm() / cov.norm())

    split, once = F.moments_accumulator(m), F.moments_accumulator(m)
    with F.fused_moments(True):
        F.accumulate_moments_split(split, x, shift)
        # the rejected alternative: x - shift in bf16 (the shift a bf16 number), its products taken as they are
        F.accumulate_moments(once, x - shift.bfloat16(), None)
    mu_err, cov_err = errors(split, shift)
    assert mu_err < 1e-6 and cov_err < 2e-5, (mu_err, cov_err)
    once_mu, once_cov = errors(once, shift.bfloat16())
    assert once_cov > 50 * cov_err and once_mu > 50 * mu_err, (once_mu, once_cov, mu_err, cov_err)
