"""Distributed correctness on 2 local gloo ranks (docs/PAPER.md "Conventions", docs/robustness.md, issue 7).

Each rank gets a part of a global batch (parts of different sizes, an empty
one included); the reference is one process that sees each whole global batch.
The statistics are over all samples, so the block statistics of the
concatenated batch are those summed over the ranks, and the training step is
the same when each rank's loss is its share of the global mean (DDP averages
gradients over ranks).

Spawning processes is slow, so one spawned run checks several properties.
"""
from __future__ import annotations

import contextlib
import inspect


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import whitenlayers as wl
from whitenlayers.coordinator import FoldCoordinator
from whitenlayers.fold import fold_layers
import whitenlayers.fold as wl_fold
from dist_utils import CountingDist, run_distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD = 2
GLOBAL_BATCH = 8
BLOCK = 2
# Per step: how many of the global batch's samples each rank gets (an empty and uneven parts included).
SPLITS = [(8, 0), (4, 4), (6, 2), (1, 7), (0, 8), (5, 3), (4, 4), (3, 5)]
WHITEN_STATE = ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks")


class GlobalStatNorm(nn.Module):
    """A stand-in for ``SyncBatchNorm`` (which has no CPU kernel): normalise with the *global* batch statistics.

    It issues its own ``all_reduce`` in every training forward, so the
    whitening fold's collectives interleave with another module's, as with
    ``SyncBatchNorm``. The statistics are constants for the backward, here and
    in the single-process reference alike.
    """

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))

    def forward(self, x):
        with torch.no_grad():
            d = x.detach().transpose(0, 1).reshape(x.shape[1], -1).double()
            sums = torch.cat([d.sum(1), (d * d).sum(1), torch.tensor([float(d.shape[1])], dtype=torch.float64)])
            if dist.is_initialized():
                dist.all_reduce(sums)
            c = x.shape[1]
            n = sums[-1].clamp(min=1.0)
            mean = sums[:c] / n
            var = (sums[c:2 * c] / n - mean * mean).clamp(min=0.0)
            scale = (var + 1e-5).rsqrt().to(x.dtype)
        y = (x - mean.to(x.dtype).view(1, -1, 1, 1)) * scale.view(1, -1, 1, 1)
        return y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def install_coordinator(model: nn.Module) -> FoldCoordinator:
    """Fold all whitening layers of ``model`` together after its forward (what ``convert_model`` does)."""
    coord = FoldCoordinator()
    coord.handle = model.register_forward_hook(coord)
    coord.begin_handle = model.register_forward_pre_hook(coord.begin_forward)
    for name, m in model.named_modules():
        if isinstance(m, wl.WhiteningLayer):
            m._fold_coordinator = coord
            m.layer_name = name
            coord.layers.append(m)
    return coord


#: Model variants: name -> (with the batch-norm-like module, dtype). In float32 the convolutions of a rank's
#: half batch and of the global batch round differently and training amplifies that (up to 1e-5 apart after 8
#: steps); in float64 the same rounding leaves the runs 1e-14 apart, so the float64 variants check the fold's
#: arithmetic tightly.
VARIANTS = {"plain": (False, torch.float32), "plain-float64": (False, torch.float64),
            "global-batchnorm": (True, torch.float64)}
#: (rtol, atol) of the comparison with one process, by dtype.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-9, 1e-10)}


def make_model(variant: str) -> nn.Module:
    norm, dtype = VARIANTS[variant]
    torch.manual_seed(0)
    layers = [
        wl.GradWhitenConv2d(3, 8, 3, padding=1, bias=False, block_size=BLOCK),
        nn.ReLU(),
        wl.RecursiveWhitenConv2d(8, 8, 3, padding=1, block_size=BLOCK),
    ]
    if norm:
        layers.append(GlobalStatNorm(8))
    layers += [
        nn.ReLU(),
        wl.DirectWhiten(8, block_size=BLOCK),
        nn.Conv2d(8, 8, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        wl.GradWhitenLinear(8, 4, block_size=BLOCK),
    ]
    model = nn.Sequential(*layers).to(dtype)
    install_coordinator(model)
    return model


def global_batch(step: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    mix = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [0.5, 0.5, 0.7]])
    x = torch.einsum("ij,bjhw->bihw", mix, torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g)) * 2.0 + 1.0
    y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    return x.to(dtype), y


def snapshot(model: nn.Module) -> dict:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, wl.WhiteningLayer):
            for b in WHITEN_STATE:
                if hasattr(m, b):
                    out[f"{name}.{b}"] = getattr(m, b).detach().clone()
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p.detach().clone()
    return out


def train(model, step_fn, opt, steps):
    """Run the steps; snapshot after each. ``step_fn(step)`` returns this process's (x, y, loss scale)."""
    snaps = []
    for s in range(steps):
        x, y, scale = step_fn(s)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.cross_entropy(out, y, reduction="sum") * scale
        loss.backward()
        opt.step()
        snaps.append(snapshot(model.module if isinstance(model, DDP) else model))
    return snaps


def _worker(rank: int, world: int) -> dict:
    """Everything this module checks in one spawned run (starting processes dominates the cost)."""
    out = {variant: _ddp_run(rank, world, variant) for variant in VARIANTS}
    out["standalone"] = _standalone_run(rank, world)
    out["no-broadcast"] = _no_broadcast_run(rank, world)
    return out


#: DDP without its buffer broadcast at every forward: ``forward_sync_buffers=False`` (which still syncs the buffers
#: when DDP wraps the model) where DDP has it, else ``broadcast_buffers=False``.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


def _no_broadcast_run(rank: int, world: int) -> list:
    """A converted ResNet (BatchNorms absorbing the centring) under DDP without its buffer broadcast at every
    forward (:data:`NO_FORWARD_BUFFER_SYNC`): each
    rank's own batches, 7 steps of block 3; the whitening layers' buffers and the parameters after each step."""
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4, num_classes=4).double(), "grad", block_size=3)
    ddp = DDP(model, **NO_FORWARD_BUFFER_SYNC)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(10 + rank)  # the ranks' batches differ
    snaps = []
    for _ in range(7):
        x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 1
        y = torch.randint(0, 4, (4,), generator=gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        state = {f"param:{k}": p.detach().clone() for k, p in model.named_parameters()}
        for name, layer in wl.whitening_layers(model):
            state.update({f"{name}.{k}": b.clone() for k, b in layer.named_buffers()})
        snaps.append(state)
    return snaps


def _ddp_run(rank: int, world: int, variant: str) -> dict:
    torch.manual_seed(1234 + rank)  # any rank-dependent randomness must not matter
    model = make_model(variant)
    counter = CountingDist(dist)
    wl_fold.dist = counter  # count the whitening's own collectives only
    ddp = DDP(model)  # default settings: broadcast_buffers=True
    assert ddp.broadcast_buffers
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    calls_per_step = []

    def step_fn(s):
        x, y = global_batch(s, VARIANTS[variant][1])
        lo = sum(SPLITS[s][:rank])
        hi = lo + SPLITS[s][rank]
        calls_before = len(counter.calls)
        calls_per_step.append(calls_before)
        # DDP averages gradients over ranks: each rank's loss is its share of the global mean.
        return x[lo:hi], y[lo:hi], world / GLOBAL_BATCH

    snaps = train(ddp, step_fn, opt, len(SPLITS))
    calls_per_step.append(len(counter.calls))
    per_step = [b - a for a, b in zip(calls_per_step[:-1], calls_per_step[1:])]
    kinds = sorted(set(counter.calls))
    return {"snaps": snaps, "collectives": per_step, "kinds": kinds}


def _reference(variant: str):
    model = make_model(variant)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step_fn(s):
        x, y = global_batch(s, VARIANTS[variant][1])
        return x, y, 1.0 / GLOBAL_BATCH

    return train(model, step_fn, opt, len(SPLITS))


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, world_size=WORLD)


@pytest.fixture(scope="module")
def ddp_runs(spawned):
    """Both model variants (with and without a batch-norm-like module doing its own collectives) and references."""
    return {variant: ([r[variant] for r in spawned], _reference(variant)) for variant in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_ranks_bit_identical_after_every_fold(ddp_runs, variant):
    results, _ = ddp_runs[variant]
    r0, r1 = results
    assert len(r0["snaps"]) == len(SPLITS)
    for step, (a, b) in enumerate(zip(r0["snaps"], r1["snaps"])):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs between ranks"
    # folds did happen, on every whitening layer
    last = r0["snaps"][-1]
    blocks = {k: int(v) for k, v in last.items() if k.endswith("num_blocks")}
    assert len(blocks) == 4 and set(blocks.values()) == {len(SPLITS) // BLOCK}, blocks


def test_whitening_buffers_stay_bit_identical_without_ddp_buffer_broadcast(spawned):
    """DDP without its buffer broadcast at every forward, which saves re-sending every whitening layer's matrices
    (docs/performance.md): the library's own sums across ranks at each fold keep every whitening buffer (the
    absorbed offset included) and every parameter bit-identical on both ranks, though the ranks' batches (and so
    their BatchNorms' running statistics) differ."""
    r0, r1 = (r["no-broadcast"] for r in spawned)
    for step, (a, b) in enumerate(zip(r0, r1)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs between ranks"
    last = r0[-1]
    assert any(k.endswith("absorbed_offset") for k in last)  # the absorbed case is in the comparison
    assert {int(v) for k, v in last.items() if k.endswith("num_blocks")} == {2}  # folds happened (7 steps, block 3)
    assert any((v - torch.eye(v.shape[0], dtype=v.dtype)).abs().max() > 1e-3
               for k, v in last.items() if k.endswith("whitening_matrix"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_equals_single_process_on_global_batch(ddp_runs, variant):
    results, ref = ddp_runs[variant]
    dist_snaps = results[0]["snaps"]
    for step, (d, r) in enumerate(zip(dist_snaps, ref)):
        assert d.keys() == r.keys()
        for k in r:
            if k.endswith("num_blocks"):
                assert int(d[k]) == int(r[k]), f"step {step}: {k}"
                continue
            # convolutions on different batch sizes round differently; that is all that differs (VARIANTS)
            rtol, atol = TOLERANCE[VARIANTS[variant][1]]
            torch.testing.assert_close(d[k], r[k], rtol=rtol, atol=atol, msg=lambda m: f"step {step}: {k}: {m}")
    # the transforms are not trivially the identity (the comparison has teeth)
    assert (ref[-1]["0.whitening_matrix"] - torch.eye(3)).abs().max() > 0.05
    assert (ref[-1]["2.grad_transform"] - torch.eye(8)).abs().max() > 0.01


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fold_collectives_are_coalesced_for_the_whole_model(ddp_runs, variant):
    """Two all_reduce calls per block for all four whitening layers together, none between folds."""
    results, _ = ddp_runs[variant]
    for r in results:
        expected = [2 if (s + 1) % BLOCK == 0 else 0 for s in range(len(SPLITS))]
        assert r["collectives"] == expected
        assert r["kinds"] == ["all_reduce"]


# ---------------------------------------------------------------------------
# Without DDP: standalone layers (no coordinator) folded per layer, and fold_layers directly.
# ---------------------------------------------------------------------------
def _standalone_run(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    layers = [
        wl.GradWhitenConv2d(4, 3, 3, padding=1, block_size=2),
        wl.RecursiveWhitenLinear(4, 2, block_size=2),
        wl.DirectWhiten(4, block_size=2),
    ]
    counter = CountingDist(dist)
    wl_fold.dist = counter
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(4):
        x = torch.randn(6, 4, 5, 5, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0]).view(1, 4, 1, 1) + 2
        part = x[:5] if rank == 0 else x[5:]  # 5 samples against 1
        layers[0](part)
        layers[1](part.mean((2, 3)))
        layers[2](part)
        out.append([{b: getattr(m, b).clone() for b in WHITEN_STATE if hasattr(m, b)} for m in layers])
    # an explicit partial-block fold of several layers together: one pair of collectives
    before = len(counter.calls)
    for m in layers:
        m(x[:3] if rank == 0 else x[:0]) if m is not layers[1] else m((x[:3] if rank == 0 else x[:0]).mean((2, 3)))
    fold_layers(layers)
    fold_calls = len(counter.calls) - before
    out.append([{b: getattr(m, b).clone() for b in WHITEN_STATE if hasattr(m, b)} for m in layers])
    return {"states": out, "total_calls": len(counter.calls), "fold_calls": fold_calls}


def test_standalone_layers_agree_across_ranks_and_with_single_process(spawned):
    r0, r1 = [r["standalone"] for r in spawned]
    # reference: one process sees the whole of every batch
    torch.manual_seed(0)
    layers = [
        wl.GradWhitenConv2d(4, 3, 3, padding=1, block_size=2),
        wl.RecursiveWhitenLinear(4, 2, block_size=2),
        wl.DirectWhiten(4, block_size=2),
    ]
    g = torch.Generator().manual_seed(7)
    ref = []
    for step in range(4):
        x = torch.randn(6, 4, 5, 5, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0]).view(1, 4, 1, 1) + 2
        layers[0](x)
        layers[1](x.mean((2, 3)))
        layers[2](x)
        ref.append([{b: getattr(m, b).clone() for b in WHITEN_STATE if hasattr(m, b)} for m in layers])
    layers[0](x[:3])
    layers[1](x[:3].mean((2, 3)))
    layers[2](x[:3])
    fold_layers(layers)
    ref.append([{b: getattr(m, b).clone() for b in WHITEN_STATE if hasattr(m, b)} for m in layers])

    for step, (a, b, r) in enumerate(zip(r0["states"], r1["states"], ref)):
        for i, (la, lb, lr) in enumerate(zip(a, b, r)):
            for k in lr:
                assert torch.equal(la[k], lb[k]), f"step {step} layer {i}: {k} differs between ranks"
                torch.testing.assert_close(la[k], lr[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} layer {i} {k}: {m}")
    assert int(r0["states"][-1][0]["num_blocks"]) == 3
    # Without a coordinator each layer folds on its own: 2 collectives per layer per block.
    # fold_layers on several layers at once: 2 collectives in all.
    assert r0["fold_calls"] == r1["fold_calls"] == 2
    assert r0["total_calls"] == 2 * 3 * 2 + 2


# ---------------------------------------------------------------------------
# The real SyncBatchNorm: it has no CPU kernel, so this needs two GPUs (NCCL).
# ---------------------------------------------------------------------------
def _syncbn_model(device):
    torch.manual_seed(0)
    model = nn.Sequential(
        wl.GradWhitenConv2d(3, 8, 3, padding=1, bias=False, block_size=BLOCK), nn.BatchNorm2d(8), nn.ReLU(),
        wl.RecursiveWhitenConv2d(8, 8, 3, padding=1, bias=False, block_size=BLOCK), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )
    install_coordinator(model)
    return model.to(device)


def _syncbn_worker(rank: int, world: int) -> list:
    device = torch.device("cuda", rank)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_syncbn_model(device))
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    half = GLOBAL_BATCH // world
    snaps = []
    for s in range(2 * BLOCK):
        x, y = global_batch(s)  # float32, like _syncbn_model (no `variant` here: a NameError on two GPUs before)
        x, y = x[rank * half:(rank + 1) * half].to(device), y[rank * half:(rank + 1) * half].to(device)
        opt.zero_grad()
        (F.cross_entropy(ddp(x), y, reduction="sum") * world / GLOBAL_BATCH).backward()
        opt.step()
        snaps.append({k: v.cpu() for k, v in snapshot(model).items()})
    return snaps


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="SyncBatchNorm has no CPU kernel: needs two GPUs (the CPU stand-in is GlobalStatNorm)")
def test_ddp_with_syncbatchnorm_on_two_gpus():
    r0, r1 = run_distributed(_syncbn_worker, world_size=2, backend="nccl")
    ref_model = _syncbn_model(torch.device("cuda", 0))  # plain BatchNorm over the whole batch
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    for s, (a, b) in enumerate(zip(r0, r1)):
        x, y = global_batch(s)
        opt.zero_grad()
        F.cross_entropy(ref_model(x.cuda()), y.cuda()).backward()
        opt.step()
        ref = snapshot(ref_model)
        for k in a:
            if "num_blocks" in k or any(w in k for w in ("running_mean", "running_cov", "whitening_matrix",
                                                           "grad_transform")):
                assert torch.equal(a[k], b[k]), f"step {s}: {k} differs between ranks"
            torch.testing.assert_close(a[k], ref[k].cpu(), rtol=1e-3, atol=1e-4, msg=lambda m: f"step {s}: {k}: {m}")
    assert int(r0[-1]["0.num_blocks"]) == 2


# ---------------------------------------------------------------- uneven inputs
def _uneven(rank: int, world: int, short: int) -> dict:
    """Two ranks under ``Join([ddp, wl.joinable(ddp)])``, rank 1 ``short`` batches short: every rank trains to the
    end; after it, the whitening state of both ranks, and every 2 steps along the way on rank 0."""
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4, num_classes=4).double(), "grad", block_size=3)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(10 + rank)
    steps = 10 - (short if rank == 1 else 0)
    with Join([ddp, wl.joinable(ddp)]):
        for _ in range(steps):
            x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 1
            opt.zero_grad()
            F.cross_entropy(ddp(x), torch.randint(0, 4, (4,), generator=gen)).backward()
            opt.step()
    whitening = {name for name, _ in wl.whitening_layers(model)}
    out = {f"{n}.{k}": getattr(m, k).clone() for n, m in wl.whitening_layers(model)
           for k in ("running_mean", "running_cov", "whitening_matrix", "grad_transform", "num_blocks")}
    out.update({f"{n}.batches_in_block": torch.tensor(m.batches_in_block) for n, m in wl.whitening_layers(model)})
    assert whitening
    return out


@pytest.mark.slow
@pytest.mark.parametrize("short", [4, 1])
def test_join_with_uneven_inputs_trains_and_keeps_the_ranks_whitening_identical(short):
    """DDP's uneven inputs (``Join``) with the whitening's joinable: a rank 4 batches short (a fold while it has
    joined) and 1 batch short (the extra step ends no block, the next block's count stays in step): both ranks
    train to the end, and their whitening state (means, covariances, transforms, block counts, the batches of the
    partial block) is bit-identical."""
    from dist_utils import run_distributed

    r0, r1 = run_distributed(_uneven, short)
    assert r0.keys() == r1.keys() and any(k.endswith("num_blocks") for k in r0)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    assert {int(v) for k, v in r0.items() if k.endswith("num_blocks")} == {3}  # 10 forwards, block 3


def _logging_forward(rank: int, world: int) -> dict:
    """Rank 0 alone runs the module inside DDP in training mode (logging) between steps."""
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4, num_classes=4).double(), "grad", block_size=3)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(20 + rank)
    for step in range(7):
        x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) + 1
        opt.zero_grad()
        F.cross_entropy(ddp(x), torch.randint(0, 4, (4,), generator=gen)).backward()
        opt.step()
        if rank == 0 and step % 2 == 0:
            with torch.no_grad(), pytest.warns(RuntimeWarning, match="called without DDP") if step == 0 else \
                    contextlib.nullcontext():
                ddp.module(x)  # the module itself, on one rank
    return {f"{n}.{k}": getattr(m, k).clone() for n, m in wl.whitening_layers(model)
            for k in ("running_mean", "grad_transform", "num_blocks")}


@pytest.mark.slow
def test_a_training_forward_of_one_rank_folds_nothing_alone():
    """A training-mode forward of the module inside DDP on rank 0 only (logging) gathers and counts nothing: no rank
    folds alone (it would hang), and both ranks end with the same whitening state."""
    from dist_utils import run_distributed

    r0, r1 = run_distributed(_logging_forward)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    assert {int(v) for k, v in r0.items() if k.endswith("num_blocks")} == {2}
