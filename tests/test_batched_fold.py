"""The batched fold (one ``eigh`` per width for many EVD layers) equals folding each layer alone.

Contract (docs/robustness.md, "What is bit-identical"): a batched ``torch.linalg.eigh`` and one call per matrix are different
LAPACK code paths; libraries such as MKL pick kernels by CPU, batch shape and alignment, so they do not
promise the same bits (measured: 1 ulp apart on an Intel Xeon, bit-equal on an AMD EPYC). The moments
(``running_mean``, ``running_cov``) and everything derived from them alone (``bias_correction``, counters)
take one code path either way and stay bit-identical. ``whitening_matrix`` and ``grad_transform`` come out of
``eigh`` and are equal to float tolerance: ``eigh`` is backward stable (the computed decomposition is exact
for ``C + E`` with ``||E|| <= c M u ||C||``), and ``T = f(C)`` with gains capped at ``gmax`` is Lipschitz in
``C`` on these well-conditioned test matrices, so two backward-stable paths agree to a few ``M u`` relative
to ``||T||``. We allow ``16 M u ||T||_max`` (``u`` = unit round-off of the working dtype); the measured gap is
at most 1 ulp, and a wrong ``eps``/``gmax``/gain rule moves ``T`` by orders of magnitude more.
"""
from __future__ import annotations

import copy

import pytest
import torch

import whitenlayers as wl
from whitenlayers.fold import fold_layers
from whitenlayers import functional as F


def _layers(widths, seed=0):
    torch.manual_seed(seed)
    layers = [wl.GradWhitenConv2d(m, 4, 3, padding=1, bias=False, block_size=10**6) for m in widths]
    for _ in range(2):
        for l in layers:
            mix = torch.randn(l.num_features, l.num_features)
            x = torch.relu(torch.einsum("bchw,cd->bdhw", torch.randn(6, l.num_features, 5, 5), mix) + 1)
            l(x)
        if _ == 0:
            fold_layers(layers)
    return layers


EXACT = ("running_mean", "running_cov", "num_blocks", "bias_correction")  # one code path: bit-identical
FROM_EIGH = ("whitening_matrix", "grad_transform")  # batched vs single eigh: float tolerance


def eigh_atol(t: torch.Tensor) -> float:
    """``16 M u ||T||_max``: two backward-stable eigendecompositions of one matrix agree to this (module doc)."""
    m = t.shape[-1]
    return 16 * m * torch.finfo(t.dtype).eps / 2 * max(1.0, t.abs().max().item())


def _assert_same(a, b):
    for la, lb in zip(a, b):
        for name in EXACT:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        for name in FROM_EIGH:
            x, y = getattr(la, name), getattr(lb, name)
            torch.testing.assert_close(x, y, rtol=0, atol=eigh_atol(y), msg=lambda m: f"{name}: {m}")
        assert la.transform_failures == lb.transform_failures


def test_batched_fold_equals_per_layer_fold():
    widths = [3, 5, 3, 8, 5, 3]
    a = _layers(widths)
    b = copy.deepcopy(a)
    fold_layers(a)
    for l in b:
        fold_layers([l])
    _assert_same(a, b)


def test_evd_transform_batched_matches_single_and_skips_nonfinite():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 6, 40, generator=g)
    covs = z @ z.transpose(1, 2) / 40
    covs[2, 0, 0] = float("nan")
    out = F.evd_transform_batched(covs, eps=1e-5, gmax=10.0)
    for i in range(5):
        ref = F.evd_transform(covs[i], eps=1e-5, gmax=10.0)
        if i == 2:
            assert out[i] is None and ref is None
        else:
            for got, want in zip(out[i], ref):
                torch.testing.assert_close(got, want, rtol=0, atol=eigh_atol(want))


def test_batched_fold_tolerance_is_tight_enough_to_catch_a_wrong_setting():
    """The tolerance is no blanket: a fold with another ``gmax`` (or eps) is far outside it."""
    widths = [5, 5]
    a = _layers(widths)
    b = copy.deepcopy(a)
    for l in b:
        l.gmax = 2.0
    fold_layers(a)
    fold_layers(b)
    with pytest.raises(AssertionError):
        _assert_same(a, b)


def test_batched_eigh_failure_falls_back_per_layer(monkeypatch):
    widths = [4, 4, 4]
    a = _layers(widths)
    b = copy.deepcopy(a)
    real = torch.linalg.eigh

    def failing(x, *args, **kw):  # the batched call fails; single-matrix calls work
        if x.dim() == 3:
            raise torch.linalg.LinAlgError("simulated batched failure")
        return real(x, *args, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    fold_layers(a)
    monkeypatch.setattr(torch.linalg, "eigh", real)
    for l in b:
        fold_layers([l])
    _assert_same(a, b)


def test_batched_fold_counts_failures_per_layer(monkeypatch):
    widths = [4, 4, 4]
    layers = _layers(widths)
    before = [l.whitening_matrix.clone() for l in layers]
    real = torch.linalg.eigh
    calls = {"n": 0}

    def flaky(x, *args, **kw):
        lam, vec = real(x, *args, **kw)
        if x.dim() == 3:
            lam = lam.clone()
            lam[1] = float("nan")  # the second matrix of the batch comes back non-finite
        else:
            calls["n"] += 1
            # the per-layer retries (working precision, then float64) fail as well
            lam = torch.full_like(lam, float("nan"))
        return lam, vec

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    with pytest.warns(RuntimeWarning, match="eigendecomposition failed"):
        fold_layers(layers)
    assert [l.transform_failures for l in layers] == [0, 1, 0]
    assert calls["n"] == 2  # float32 then float64, for the failing layer only
    assert torch.equal(layers[1].whitening_matrix, before[1])  # previous transform kept
    assert not torch.equal(layers[0].whitening_matrix, before[0])
    assert all(int(l.num_blocks) == 2 for l in layers)


def _eigh_shapes(monkeypatch) -> list:
    """The shapes ``torch.linalg.eigh`` is called with from now on (the list fills as the test runs)."""
    calls: list = []
    real = torch.linalg.eigh

    def spy(x, *args, **kw):
        calls.append(tuple(x.shape))
        return real(x, *args, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    return calls


def test_wide_layers_are_not_batched(monkeypatch):
    """Above ``EVDRule.BATCH_MAX_M`` one ``eigh`` per matrix is cheaper on the CPU than a batched call."""
    from whitenlayers.rules import EVDRule

    m_wide = EVDRule.BATCH_MAX_M + 1
    layers = [wl.GradWhitenLinear(m, 2, block_size=10**6) for m in (m_wide, m_wide, 4, 4)]
    for l in layers:
        l(torch.randn(3 * l.num_features, l.num_features) + 1)
    calls = _eigh_shapes(monkeypatch)
    with wl.functional.fused_moments(False):  # the CPU's own choice (WHITENLAYERS_TEST_FUSED=1 emulates CUDA's)
        fold_layers(layers)
    assert sorted(calls) == sorted([(m_wide, m_wide), (m_wide, m_wide), (2, 4, 4)])


def test_wide_layers_batch_off_the_cpu(monkeypatch):
    """Off the CPU (emulated: ``fused_moments``) every width batches: wide layers of one width share one ``eigh``,
    at most ``EIGH_BATCH_ELEMENTS`` entries per call, with the same results as one fold per layer."""
    from whitenlayers.rules import EVDRule

    m_wide = EVDRule.BATCH_MAX_M + 1
    monkeypatch.setattr(EVDRule, "EIGH_BATCH_ELEMENTS", 2 * m_wide * m_wide)  # two wide matrices per call
    a = _layers([m_wide, 4, m_wide, m_wide, 4])
    b = copy.deepcopy(a)
    calls = _eigh_shapes(monkeypatch)
    with F.fused_moments(True):
        fold_layers(a)
    assert sorted(calls) == sorted([(2, m_wide, m_wide), (1, m_wide, m_wide), (2, 4, 4)])
    calls.clear()
    for l in b:  # one layer at a time: one call per matrix
        fold_layers([l])
    assert sorted(calls) == sorted([(m_wide, m_wide)] * 3 + [(4, 4)] * 2)
    _assert_same(a, b)


def test_batched_fold_checks_results_with_one_synchronisation(monkeypatch):
    """A batched EVD fold reads its flags back once per call after the ``eigh`` (the inputs, the eigenpairs and
    the transforms together), not once per layer: on a GPU each read stalls the queue."""
    from whitenlayers.rules import EVDRule

    layers = _layers([EVDRule.BATCH_MAX_M + 1] * 3)
    reads = []
    real = torch.Tensor.tolist

    def spy(t, *args):
        reads.append(tuple(t.shape))
        return real(t, *args)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    F.evd_transform_batched(torch.stack([l.running_cov for l in layers]), eps=1e-5, gmax=1e3)
    assert reads == [(2, 3)]  # the inputs' finiteness and the results', one read


def test_nonfinite_matrix_never_reaches_eigh(monkeypatch):
    """A non-finite covariance in a batch gives ``None`` without being decomposed: the batched call sees the
    identity in its place (LAPACK's behaviour on NaN is not something to rely on)."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 5, 30, generator=g)
    covs = z @ z.transpose(1, 2) / 30
    covs[1, 2, 3] = float("inf")
    seen = []
    real = torch.linalg.eigh

    def spy(x, *args, **kw):
        seen.append(bool(torch.isfinite(x).all()))
        return real(x, *args, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    out = F.evd_transform_batched(covs, eps=1e-5, gmax=10.0)
    assert seen == [True]
    assert out[1] is None and out[0] is not None and out[2] is not None


def _fold_reads(layers, monkeypatch):
    """Host reads (``tolist``, ``item``-like scalar reads) during one ``fold_layers`` of ``layers``."""
    reads = []
    real_tolist = torch.Tensor.tolist

    def tolist(t, *args):
        reads.append("tolist")
        return real_tolist(t, *args)

    from torch.utils._python_dispatch import TorchDispatchMode

    class Items(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_local_scalar_dense":
                reads.append("item")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with Items():
        fold_layers(layers)
    monkeypatch.undo()
    return reads


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_fold_reads_flags_few_times_per_stack(method, monkeypatch):
    """One process: a stack of same-width layers reads its flags to the host twice (the block sums' finiteness
    with the first-block flags; the moments' finiteness with the next block's shift choice) plus once in the
    rule (EVD: the decomposition's check, besides ``eigh``'s own status; recursive: the step's finiteness and
    clamps): on a GPU each read waits for the queue. A regression (a read per layer, or per phase) shows here."""
    torch.manual_seed(0)
    cls = wl.GradWhitenConv2d if method == "grad" else wl.RecursiveWhitenConv2d
    layers = [cls(m, 4, 3, padding=1, bias=False, block_size=10**6) for m in (3, 5, 3, 5, 3)]
    for l in layers:
        l(torch.randn(4, l.num_features, 5, 5))
    fold_layers(layers)  # the first block
    for l in layers:
        l(torch.randn(4, l.num_features, 5, 5) + 1)
    assert _fold_reads(layers, monkeypatch) == ["tolist"] * (3 * 2)  # two stacks (widths 3 and 5)


def test_fold_chunks_group_by_batch_key_and_bound_their_size():
    """One process folds a batch of layers at a time (their float64 temporaries only), at most
    ``max_elements`` matrix entries per batch, same-width layers together in order of first appearance."""
    from whitenlayers.fold import _fold_chunks

    a = _layers([3, 5, 3, 8, 5, 3])
    chunks = _fold_chunks(a, max_elements=18)  # two 3x3 layers fit, a 5x5 alone
    assert [[a.index(l) for l in c] for c in chunks] == [[0, 2], [1], [3], [4], [5]]
    assert [[a.index(l) for l in c] for c in _fold_chunks(a)] == [[0, 2, 5], [1, 4], [3]]
    grouped = wl.GradWhitenConv2d(8, 8, 3, padding=1, groups=4, block_size=10**6)  # 4 groups of 2x2: 16 entries
    assert _fold_chunks([grouped, grouped], max_elements=16) == [[grouped], [grouped]]


def test_chunked_fold_equals_per_layer_fold(monkeypatch):
    """Folding in small batches changes no result, and no call folds more than one batch."""
    import whitenlayers.fold as fold_mod

    widths = [3, 5, 3, 8, 5, 3]
    a = _layers(widths)
    b = copy.deepcopy(a)
    calls = []
    real = fold_mod._fold_all

    def spy(layers, summaries, *args, **kw):
        calls.append(len(layers))
        return real(layers, summaries, *args, **kw)

    monkeypatch.setattr(fold_mod, "FOLD_CHUNK_ELEMENTS", 18)
    monkeypatch.setattr(fold_mod, "_fold_all", spy)
    fold_layers(a)
    assert calls == [2, 1, 1, 1, 1]
    monkeypatch.undo()
    for l in b:
        fold_layers([l])
    _assert_same(a, b)
