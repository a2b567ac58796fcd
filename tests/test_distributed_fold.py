"""Distributed fold strategies (issue 13): each layer's transform on one rank, results sent to all.

Each rank gets its share of a global batch; the reference is one process that
sees each whole global batch. Ranks must hold bit-identical state and counters
after every fold (non-owners write the buffers their owner broadcast), equal to
the reference to float tolerance (the reference batches its eigendecompositions
differently). The last fold has a non-finite batch on one rank only and a layer
with no samples on any rank (a skipped fold).
"""
from __future__ import annotations

import collections

import pytest
import torch

import whitenlayers as wl
import whitenlayers.fold as wl_fold
from whitenlayers.fold import assign_owners, fold_layers
from whitenlayers import WhiteningLayer
from dist_utils import CountingDist, run_distributed

# The reference's warnings about the non-finite batch and the skipped fold (expected).
pytestmark = [pytest.mark.filterwarnings("ignore:.*non-finite activations:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*a block had no samples:RuntimeWarning")]

STATE = ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks", "bias_correction",
         "running_cov_whitened", "running_power", "whitening_gram")
FOLDS = 3
COUNTERS = ("transform_failures", "skipped_folds", "nonfinite_blocks", "clamped_steps")
NAN_LAYERS = (0, 3)  # at the last fold, one rank (the reference: once) feeds these a non-finite batch: dropped
EMPTY_LAYER = 4  # at the last fold, no rank feeds it: the fold is skipped


def make_layers():
    torch.manual_seed(0)
    layers = [
        wl.GradWhitenLinear(6, 3, bias=False, block_size=10**6),
        wl.GradWhitenConv2d(6, 4, 3, padding=1, bias=False, block_size=10**6),
        wl.GradWhitenConv2d(9, 4, 1, block_size=10**6),
        wl.RecursiveWhitenConv2d(5, 4, 3, padding=1, bias=False, block_size=10**6),
        wl.DirectWhiten(6, block_size=10**6),
        wl.GradWhitenLinear(9, 2, block_size=10**6),
        wl.RecursiveWhitenLinear(6, 2, block_size=10**6),
    ]
    for i, layer in enumerate(layers):
        layer.layer_name = f"l{i}"
    return layers


def global_batch(layer_index: int, m: int, fold: int, conv: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * fold + layer_index)
    mix = torch.eye(m) + 0.4 * torch.randn(m, m, generator=g)
    z = torch.randn(8, m, 4, 4, generator=g) if conv else torch.randn(24, m, generator=g)
    x = torch.einsum("ij,bj...->bi...", mix, z) * 2 + 1
    return x


def snapshot(layers):
    return [{k: getattr(m, k).clone() for k in STATE if getattr(m, k, None) is not None}
            | {c: getattr(m, c) for c in COUNTERS} for m in layers]


def feed(layers, fold: int, part):
    """Accumulate fold ``fold``'s global batch, ``part(x)`` of it; at the last fold with a skipped layer."""
    for i, layer in enumerate(layers):
        if fold == FOLDS - 1 and i == EMPTY_LAYER:
            continue
        conv = not isinstance(layer, wl.GradWhitenLinear)
        layer.accumulate(part(global_batch(i, layer.num_features, fold, conv)))


def feed_nan(layers):
    for i in NAN_LAYERS:
        x = global_batch(i, layers[i].num_features, 0, not isinstance(layers[i], wl.GradWhitenLinear))[:2].clone()
        x[0, 0] = float("nan")
        layers[i].accumulate(x)


def _rank_run(rank: int, world: int, strategy: str, fail_rank: int, alone: bool = False):
    if alone:  # every tensor in its own collective (as large layers' are), none packed
        wl_fold.COALESCE_NUMEL = 1
    layers = make_layers()
    counter = CountingDist(torch.distributed)
    wl_fold.dist = counter
    calls = collections.Counter()  # (method, layer) -> calls on this rank
    patched = {}
    real_finish = WhiteningLayer.fold_writes

    def finishing(self, *a):
        calls["fold_writes", self.layer_name] += 1
        return real_finish(self, *a)

    WhiteningLayer.fold_writes = finishing
    for name in ("_outcomes", "_transforms"):  # module functions taking a stack of layers first
        real = getattr(wl_fold, name)

        def counting(stack, *a, _real=real, _name=name):
            for layer in stack:
                calls[_name, layer.layer_name] += 1
            return _real(stack, *a)

        patched[name] = real
        setattr(wl_fold, name, counting)
    real_eigh = torch.linalg.eigh
    states, collectives = [], []
    try:
        for fold in range(FOLDS):
            if fold == 1 and rank == fail_rank:  # every eigh on this rank fails (also the float64 retry)
                torch.linalg.eigh = lambda x, *a, **k: tuple(torch.full_like(t, float("nan")) for t in real_eigh(x, *a, **k))
            feed(layers, fold, lambda x: x[torch.arange(x.shape[0]) % world == rank])
            if fold == FOLDS - 1 and rank == world - 1:
                feed_nan(layers)
            before = len(counter.calls)
            fold_layers(layers, strategy=strategy)
            collectives.append(counter.calls[before:])
            torch.linalg.eigh = real_eigh
            states.append(snapshot(layers))
    finally:
        WhiteningLayer.fold_writes = real_finish
        for name, real in patched.items():
            setattr(wl_fold, name, real)
        torch.linalg.eigh = real_eigh
        wl_fold.dist = torch.distributed
    return {"states": states, "calls": dict(calls), "collectives": collectives}


def reference():
    layers = make_layers()
    states = []
    for fold in range(FOLDS):
        feed(layers, fold, lambda x: x)
        if fold == FOLDS - 1:
            feed_nan(layers)
        fold_layers(layers)
        states.append(snapshot(layers))
    return states


def assert_ranks_identical(runs, fold, i):
    for r in range(1, len(runs)):
        for k, v in runs[0]["states"][fold][i].items():
            w = runs[r]["states"][fold][i][k]
            assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), f"fold {fold} layer {i} {k}: rank {r} differs"


def test_assign_owners_balances_cubic_cost():
    owners = assign_owners([2048.0**3] + [512.0**3] * 8 + [64.0**3] * 20, 4)
    load = collections.Counter()
    for o, c in zip(owners, [2048.0**3] + [512.0**3] * 8 + [64.0**3] * 20):
        load[o] += c
    assert owners[0] == 0 and max(load.values()) == 2048.0**3  # the big layer alone; the rest spread on 1..3
    assert assign_owners([1.0, 1.0, 1.0], 2) == [0, 1, 0]


def test_unknown_strategy_is_a_value_error():
    with pytest.raises(ValueError, match="strategy must be one of"):
        fold_layers(make_layers(), strategy="fast")


@pytest.mark.slow
@pytest.mark.parametrize("world, alone", [(2, False), (4, False), (2, True)], ids=["2", "4", "2-unpacked"])
def test_owner_fold_is_bit_identical_across_ranks_and_folds_each_layer_on_its_owner_only(world, alone):
    runs = run_distributed(_rank_run, "owner", -1, alone, world_size=world)
    ref = reference()
    layers = make_layers()
    owners = assign_owners([float(m.num_features) ** 3 for m in layers], world)
    for fold in range(FOLDS):
        for i in range(len(layers)):
            assert_ranks_identical(runs, fold, i)
            for k, v in ref[fold][i].items():
                if torch.is_tensor(v):
                    torch.testing.assert_close(runs[0]["states"][fold][i][k], v, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"fold {fold} layer {i} {k}: {m}")
                else:
                    assert runs[0]["states"][fold][i][k] == v, f"fold {fold} layer {i} {k}"
    last = runs[0]["states"][-1]
    assert [last[i]["nonfinite_blocks"] for i in NAN_LAYERS] == [1, 1]  # one rank's block, counted everywhere
    assert [last[i]["skipped_folds"] for i in NAN_LAYERS] == [1, 1]  # and dropped everywhere
    assert last[EMPTY_LAYER]["skipped_folds"] == 1 and int(last[EMPTY_LAYER]["num_blocks"]) == FOLDS - 1
    # the moments, the transform and Q_s of each layer ran on exactly one rank, its owner, once per fold (the
    # skipped fold: its moments only); every rank wrote every fold
    for i in range(len(layers)):
        done = FOLDS - (i == EMPTY_LAYER or i in NAN_LAYERS)
        for name, n in (("_outcomes", FOLDS), ("_transforms", done)):
            counts = [runs[r]["calls"].get((name, f"l{i}"), 0) for r in range(world)]
            assert counts == [n if r == owners[i] else 0 for r in range(world)], (name, i, counts)
        assert all(runs[r]["calls"][("fold_writes", f"l{i}")] == FOLDS for r in range(world))
    assert len(set(owners)) == min(world, len(layers))
    # collectives per fold: counts, means and powers (one all_reduce), the scatters (reduce to the owner), the
    # outcomes (broadcast from the owner): these small layers packed, one call per owner rank; unpacked, one
    # reduce per layer and one broadcast for the flags and per buffer
    buffers = sum(len(m.outcome_layout()) for m in layers)
    expected = (["all_reduce"] + ["reduce"] * len(layers) + ["broadcast"] * (world + buffers) if alone else
                ["all_reduce"] + ["reduce"] * world + ["broadcast"] * world)
    for r in range(world):
        for calls in runs[r]["collectives"]:
            assert calls == expected


def test_replicated_fold_computes_every_transform_on_every_rank():
    runs = run_distributed(_rank_run, "replicated", -1, world_size=2)
    ref = reference()
    for r in range(2):
        assert all(runs[r]["calls"]["_transforms", f"l{i}"] == FOLDS - (i == EMPTY_LAYER or i in NAN_LAYERS) for i in range(7))
        assert all(calls == ["all_reduce", "all_reduce"] for calls in runs[r]["collectives"])
    for fold in range(FOLDS):
        for i in range(7):
            assert_ranks_identical(runs, fold, i)
            assert all(runs[0]["states"][fold][i][c] == ref[fold][i][c] for c in COUNTERS), (fold, i)


@pytest.mark.slow
def test_failure_on_the_owner_rank_leaves_every_rank_identical_with_the_previous_transform():
    world = 2
    runs = run_distributed(_rank_run, "owner", 1, world_size=world)
    layers = make_layers()
    owners = assign_owners([float(m.num_features) ** 3 for m in layers], world)
    evd = [i for i, m in enumerate(layers) if m.rule_name == "evd"]
    failed = [i for i in evd if owners[i] == 1]
    assert failed and [i for i in evd if owners[i] == 0]
    for i in range(len(layers)):
        for fold in range(FOLDS):
            assert_ranks_identical(runs, fold, i)
        a = runs[0]["states"][1][i]
        before = runs[0]["states"][0][i]
        if i in failed:
            assert a["transform_failures"] == 1
            assert torch.equal(a["whitening_matrix"], before["whitening_matrix"])
            assert not torch.equal(a["running_mean"], before["running_mean"])  # the moments still advance
        else:
            assert a["transform_failures"] == 0
            assert not torch.equal(a["whitening_matrix"], before["whitening_matrix"])
    # the next fold works again on every rank
    assert all(runs[0]["states"][2][i]["transform_failures"] == (1 if i in failed else 0) for i in range(len(layers)))
