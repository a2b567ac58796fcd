"""Distributed fold strategies (issue 13): each layer's transform on one rank, results sent to all.

Each rank gets its share of a global batch; the reference is one process that
sees each whole global batch. Ranks must hold bit-identical state after every
fold (they unpack the same all-reduced numbers), equal to the reference to
float tolerance (the reference batches its eigendecompositions differently).
"""
from __future__ import annotations

import collections

import pytest
import torch

import whitenlayers as wl
from whitenlayers.fold import assign_owners, fold_layers
from whitenlayers.stats import WhiteningStatistics
from dist_utils import run_distributed

STATE = ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks", "bias_correction",
         "running_cov_whitened", "running_power", "whitening_gram")
FOLDS = 3


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
            | {"eig_failures": m.eig_failures} for m in layers]


def _rank_run(rank: int, world: int, strategy: str, fail_rank: int):
    layers = make_layers()
    transforms = collections.Counter()
    real_transform = WhiteningStatistics._transform

    def counting(self, fold, *a):
        transforms[self.layer_name] += 1
        return real_transform(self, fold, *a)

    WhiteningStatistics._transform = counting
    real_eigh = torch.linalg.eigh
    states = []
    try:
        for fold in range(FOLDS):
            if fold == 1 and rank == fail_rank:  # every eigh on this rank fails (also the float64 retry)
                torch.linalg.eigh = lambda x, *a, **k: tuple(torch.full_like(t, float("nan")) for t in real_eigh(x, *a, **k))
            for i, layer in enumerate(layers):
                conv = not isinstance(layer, wl.GradWhitenLinear)
                x = global_batch(i, layer.num_features, fold, conv)
                rows = torch.arange(x.shape[0])
                layer._accumulate(x[rows % world == rank])
            fold_layers(layers, strategy=strategy)
            torch.linalg.eigh = real_eigh
            states.append(snapshot(layers))
    finally:
        WhiteningStatistics._transform = real_transform
        torch.linalg.eigh = real_eigh
    return {"states": states, "transforms": dict(transforms)}


def reference():
    layers = make_layers()
    states = []
    for fold in range(FOLDS):
        for i, layer in enumerate(layers):
            conv = not isinstance(layer, wl.GradWhitenLinear)
            layer._accumulate(global_batch(i, layer.num_features, fold, conv))
        fold_layers(layers)
        states.append(snapshot(layers))
    return states


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


@pytest.mark.parametrize("world", [2, 4])
def test_owner_fold_is_bit_identical_across_ranks_and_runs_each_transform_once(world):
    runs = run_distributed(_rank_run, "owner", -1, world_size=world)
    ref = reference()
    layers = make_layers()
    owners = assign_owners([float(m.num_features) ** 3 for m in layers], world)
    for fold in range(FOLDS):
        for i in range(len(layers)):
            for r in range(1, world):
                for k, v in runs[0]["states"][fold][i].items():
                    same = torch.equal(v, runs[r]["states"][fold][i][k]) if torch.is_tensor(v) else v == runs[r]["states"][fold][i][k]
                    assert same, f"fold {fold} layer {i} {k}: rank {r} differs from rank 0"
            for k, v in ref[fold][i].items():
                if torch.is_tensor(v):
                    torch.testing.assert_close(runs[0]["states"][fold][i][k], v, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"fold {fold} layer {i} {k}: {m}")
    # each layer's transform ran on exactly one rank, its owner, once per fold
    for i in range(len(layers)):
        counts = [runs[r]["transforms"].get(f"l{i}", 0) for r in range(world)]
        assert counts == [FOLDS if r == owners[i] else 0 for r in range(world)], (i, counts)
    assert len(set(owners)) == min(world, len(layers))


def test_replicated_fold_computes_every_transform_on_every_rank():
    runs = run_distributed(_rank_run, "replicated", -1, world_size=2)
    for r in range(2):
        assert all(runs[r]["transforms"][f"l{i}"] == FOLDS for i in range(7))


def test_failure_on_the_owner_rank_leaves_every_rank_identical_with_the_previous_transform():
    world = 2
    runs = run_distributed(_rank_run, "owner", 1, world_size=world)
    layers = make_layers()
    owners = assign_owners([float(m.num_features) ** 3 for m in layers], world)
    evd = [i for i, m in enumerate(layers) if m.method == "evd"]
    failed = [i for i in evd if owners[i] == 1]
    assert failed and [i for i in evd if owners[i] == 0]
    for i in range(len(layers)):
        a, b = runs[0]["states"][1][i], runs[1]["states"][1][i]
        for k, v in a.items():
            assert (torch.equal(v, b[k]) if torch.is_tensor(v) else v == b[k]), (i, k)
        before = runs[0]["states"][0][i]
        if i in failed:
            assert a["eig_failures"] == 1
            assert torch.equal(a["whitening_matrix"], before["whitening_matrix"])
            assert not torch.equal(a["running_mean"], before["running_mean"])  # the moments still advance
        else:
            assert a["eig_failures"] == 0
            assert not torch.equal(a["whitening_matrix"], before["whitening_matrix"])
    # the next fold works again on every rank
    assert all(runs[0]["states"][2][i]["eig_failures"] == (1 if i in failed else 0) for i in range(len(layers)))
