"""``gains="damped"``: ``Q = c (Phi + d I)^-1``, ``c = max(tr(Phi) / M, eps)``, ``d = c / gmax``, and
``T = sqrt(c) L^-1`` for ``Phi + d I = L L^T``, from a batched Cholesky factorisation.

Tolerances: the reference inverts ``Phi + d I`` in float64 with ``torch.linalg.inv``; both sides are backward
stable and ``cond(Phi + d I) <= M gmax + 1``, so they agree to ``cond * M * u`` relative (``u`` the working
dtype's unit round-off; measured: below 1e-14 relative in float64 on these matrices, 1e-6 in float32).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import whitenlayers as wl
from whitenlayers import functional as F
from whitenlayers.fold import fold_layers
from whitenlayers.functional import BlockSummary


def _cov(m: int, n: int, seed: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g, dtype=torch.float64) @ torch.randn(m, m, generator=g, dtype=torch.float64)
    return (scale * x.T @ x / n).to(dtype)


def _reference(cov: torch.Tensor, eps: float, gmax: float) -> torch.Tensor:
    """``c (Phi + d I)^-1`` of a dense matrix, in float64, by an explicit inverse."""
    phi = cov.to(torch.float64)
    m = phi.shape[-1]
    c = max(float(phi.diagonal().sum()) / m, eps)
    return c * torch.linalg.inv(phi + (c / gmax) * torch.eye(m, dtype=torch.float64))


def _tol(dtype: torch.dtype, m: int, gmax: float) -> float:
    return (m * gmax + 1) * m * torch.finfo(dtype).eps  # cond(Phi + d I) * M * u


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 60), seed=st.integers(0, 2**16), gmax=st.floats(1.0, 100.0),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_damped_equals_c_times_the_inverse_of_the_damped_covariance(m, n, seed, gmax, scale, dtype):
    cov = _cov(m, n, seed, dtype, scale)  # rank min(n, m): singular covariances included
    res = F.damped_transform(cov, eps=1e-5, gmax=gmax)
    assert res is not None
    t, q = res
    assert t.dtype == q.dtype == dtype and t.shape == q.shape == (m, m)
    ref = _reference(cov, 1e-5, gmax)
    tol = _tol(dtype, m, gmax)
    assert (q.to(torch.float64) - ref).abs().max() <= tol * ref.abs().max()
    assert (t.mT @ t - q).abs().max() <= tol * q.abs().max()  # T^T T = Q
    assert torch.equal(q, q.mT) and torch.equal(t, t.tril())  # Q symmetric, T the (scaled) inverse factor
    # gains c / (lambda + d): between c / (lambda_max + d) and gmax, and the mean power kept for lambda >> d
    lam = torch.linalg.eigvalsh(ref)
    assert float(lam.max()) <= gmax * (1 + tol)


@settings(max_examples=20, deadline=None)
@given(groups=st.integers(1, 4), k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_grouped_blocks_are_the_blocks_of_the_dense_damped_transform(groups, k, seed):
    """``(G, k, k)`` blocks: the same as the dense transform of the block-diagonal matrix (whose inverse is block
    diagonal), with the layer's mean eigenvalue over all ``M = G k``."""
    blocks = torch.stack([_cov(k, 3 * k, seed + g, scale=float(g + 1)) for g in range(groups)])
    t, q = F.damped_transform(blocks, eps=1e-5, gmax=10.0)
    dense = F.block_diagonal(blocks)
    ref = _reference(dense, 1e-5, 10.0)
    tol = _tol(torch.float64, groups * k, 10.0)
    assert (F.block_diagonal(q) - ref).abs().max() <= tol * ref.abs().max()
    assert (t.mT @ t - q).abs().max() <= tol * q.abs().max()


def test_batched_equals_one_layer_at_a_time_and_keeps_each_layers_gains():
    covs = torch.stack([_cov(8, 20, s, scale=10.0 ** s) for s in range(4)])
    batched = F.damped_transform_batched(covs, eps=1e-5, gmax=10.0)
    for cov, res in zip(covs, batched):
        alone = F.damped_transform(cov, eps=1e-5, gmax=10.0)
        assert res is not None and alone is not None
        for a, b in zip(res, alone):
            torch.testing.assert_close(a, b, rtol=64 * 8 * torch.finfo(torch.float64).eps, atol=0)


def test_failures_give_none_and_a_failed_float32_factorisation_is_retried_in_float64(monkeypatch):
    good = _cov(5, 20, 0, torch.float32)
    indefinite = torch.diag(torch.tensor([1.0, -5.0, 1.0, 1.0, 1.0]))  # fails in float64 too
    nonfinite = good.clone()
    nonfinite[0, 0] = float("nan")
    out = F.damped_transform_batched(torch.stack([good, indefinite, nonfinite]), eps=1e-5, gmax=10.0)
    assert out[0] is not None and out[1] is None and out[2] is None
    assert all(torch.isfinite(t).all() for t in out[0])

    real = torch.linalg.cholesky_ex
    calls = []

    def float32_fails(a, **kw):  # a float32 factorisation reports failure: the float64 retry must take over
        calls.append(a.dtype)
        chol, info = real(a, **kw)
        return (chol, torch.ones_like(info)) if a.dtype == torch.float32 else (chol, info)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", float32_fails)
    res = F.damped_transform(good, eps=1e-5, gmax=10.0)
    assert calls == [torch.float32, torch.float64] and res is not None and res[1].dtype == torch.float32
    torch.testing.assert_close(res[1].double(), _reference(good, 1e-5, 10.0), rtol=1e-4, atol=0)


def test_grad_layer_folds_damped_q_into_q_s_and_a_failed_fold_keeps_the_transform():
    torch.manual_seed(0)
    layer = wl.GradWhitenConv2d(6, 4, 3, padding=1, block_size=1, gains="damped", beta=0.5)
    x = torch.randn(8, 6, 5, 5) @ torch.eye(5) + torch.randn(1, 6, 1, 1)
    layer(x)
    assert int(layer.num_blocks) == 1 and layer.transform_failures == 0
    q = _reference(layer.running_cov, layer.eps, layer.gmax)
    torch.testing.assert_close(layer.grad_transform.double(), 0.5 * torch.eye(6, dtype=torch.float64) + 0.5 * q,
                               rtol=1e-5, atol=1e-6)
    t = layer.whitening_matrix.double()
    torch.testing.assert_close(t.T @ t, q, rtol=1e-4, atol=1e-6)
    before = {name: buf.clone() for name, buf in layer.named_buffers()}
    bad = BlockSummary(torch.tensor(10.0, dtype=torch.float64), torch.zeros(6, dtype=torch.float64),
                       -100 * torch.eye(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64))
    with pytest.warns(RuntimeWarning, match="Cholesky factorisation failed"):
        layer.fold(bad)
    assert layer.transform_failures == 1
    for name in ("whitening_matrix", "grad_transform"):
        assert torch.equal(getattr(layer, name), before[name]), name


def test_damped_layers_fold_batched_as_one_at_a_time():
    torch.manual_seed(1)
    layers = [wl.GradWhitenConv2d(8, 4, 1, gains="damped", block_size=10**6) for _ in range(3)]
    twins = [wl.GradWhitenConv2d(8, 4, 1, gains="damped", block_size=10**6) for _ in range(3)]
    for a, b in zip(layers, twins):
        x = torch.randn(16, 8, 3, 3) * torch.rand(1, 8, 1, 1) * 3
        a(x)
        b(x)
    fold_layers(layers)  # one batched Cholesky factorisation for the three
    for b in twins:
        fold_layers([b])
    for a, b in zip(layers, twins):
        assert torch.equal(a.running_cov, b.running_cov)
        torch.testing.assert_close(a.grad_transform, b.grad_transform, rtol=16 * 8 * 1.2e-7, atol=1e-7)


def test_direct_refuses_damped_gains():
    with pytest.raises(ValueError, match="DirectWhiten: gains='damped' makes the EVD rule give a non-symmetric T"):
        wl.DirectWhiten(4, gains="damped")
    with pytest.raises(ValueError, match="non-symmetric T"):
        wl.convert_model(wl.models.resnet20(), method="direct", gains="damped")
    layer = wl.DirectWhiten(4)
    with pytest.raises(ValueError, match="non-symmetric T"):
        layer.gmax = 5.0
        layer.config = layer.config.replace(gains="damped")
    assert layer.config.gains == "practical" and layer.gmax == 5.0


def test_direct_takes_damped_gains_under_a_rule_of_ones_own():
    """The refusal is the EVD rule's (its damped T is not symmetric): a rule of one's own computes its own T and may
    read ``gains`` as it likes."""
    from rule_example import EigenbasisRule

    layer = wl.DirectWhiten(4, rule=EigenbasisRule, gains="damped")
    assert layer.config.gains == "damped"


def test_damped_trains_a_resnet_with_finite_steps():
    model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1, gains="damped")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no failed factorisation, nothing skipped
        for step in range(3):
            loss = model(torch.randn(4, 3, 8, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert torch.isfinite(loss)
    layers = [layer for _, layer in wl.whitening_layers(model)]
    assert all(int(layer.num_blocks) == 3 and layer.transform_failures == 0 for layer in layers)
