"""The statistics of a model's layers added together at the end of its forward: the layers hand their
batches to the fold coordinator, which adds those of one input shape with a few operations for all of them
(``functional.accumulate_moments_grouped``) into slices of one stacked accumulator."""
import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_utils import assert_states_close, coordinator_of, layers_alone
from torch import nn
from torch.utils.checkpoint import checkpoint

import whitenlayers as wl
from whitenlayers.functional import (
    accumulate_moments,
    accumulate_moments_grouped,
    moments_accumulator,
    stacked_moments_accumulator,
)

LAYOUTS = ["rows", "channels_last", "nchw"]


def _batch(layout, b, m, gen, dtype):
    if layout == "rows":
        return torch.randn(b, m, generator=gen, dtype=dtype) * 2 + 1
    x = torch.randn(b, m, 3, 2, generator=gen, dtype=dtype) * 2 + 1
    return x.to(memory_format=torch.channels_last) if layout == "channels_last" else x


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 4), b=st.integers(1, 5), m=st.integers(1, 9), layout=st.sampled_from(LAYOUTS),
       shifted=st.sampled_from(["none", "all", "some"]), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_sums_are_each_layers_own_sums(layers, b, m, layout, shifted, bf16, seed):
    """Stacked, every layer's ``sum (x - k)(x - k)^T`` and ``sum (x - k)`` equal :func:`accumulate_moments`' own:
    in float64 to rounding; a bf16 batch (converted to float32 first on the CPU) to float32 rounding. Shifts for
    none, all, or some of the batches (the others summed about 0, as a zero shift)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if bf16 else torch.float64
    xs = [_batch(layout, b, m, gen, torch.float64).to(torch.bfloat16 if bf16 else dtype) for _ in range(layers)]
    shifts = [torch.randn(1, m, *([1] * (xs[0].dim() - 2)), generator=gen).to(dtype) for _ in range(layers)]
    if shifted == "some":
        shifts = [k if i % 2 else None for i, k in enumerate(shifts)]
        if all(k is None for k in shifts):
            shifts[0] = torch.zeros(1, m, *([1] * (xs[0].dim() - 2)), dtype=dtype)
    given_shifts = None if shifted == "none" else shifts
    acc = stacked_moments_accumulator(layers, m, dtype)
    own = [moments_accumulator(m, dtype) for _ in range(layers)]
    for _ in range(2):  # added twice: into what is there
        accumulate_moments_grouped(acc, xs, given_shifts)
        for a, x, k in zip(own, xs, shifts):
            accumulate_moments(a, x, None if given_shifts is None else k)
    tol = 1e-5 if bf16 else 1e-12
    for i in range(layers):
        scale = float(own[i][:m, : m + 1].abs().max()) + 1.0
        assert float((acc[i, :m, : m + 1] - own[i][:m, : m + 1]).abs().max()) <= tol * scale
        assert not acc[i, m].any()  # the ones row is left alone


def test_grouped_sums_refuse_mismatched_batches():
    acc = stacked_moments_accumulator(2, 3)
    with pytest.raises(ValueError, match=r"one shape with 3 features.*\(4, 3\).*\(5, 3\)"):
        accumulate_moments_grouped(acc, [torch.randn(4, 3), torch.randn(5, 3)])
    with pytest.raises(ValueError, match=r"acc of shape \(2, 4, 4\), 3 batches"):
        accumulate_moments_grouped(acc, [torch.randn(4, 3)] * 3)


def _model(method="grad", dtype=torch.float64, **kw):
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4).to(dtype), method, block_size=3, **kw)
    return model.to(memory_format=torch.channels_last)


def _batches(n, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=gen, dtype=dtype) + 1).to(memory_format=torch.channels_last)
            for _ in range(n)]


def _train(model, batches, *, hand_over=True, views=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not hand_over:  # each layer adding its own batch
        layers_alone(model)
    with wl.functional.fused_moments(True):
        for x in batches:
            opt.zero_grad()
            loss = sum(model(x * (1 + v)).logsumexp(1).mean() for v in range(views))
            loss.backward()
            opt.step()
    return model


_coordinator = coordinator_of


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("views", [1, 2])
def test_handed_batches_train_as_each_layer_adding_its_own(method, views):
    """CUDA's path (``fused_moments``): a model whose layers hand their batches over (grouped by shape at the end
    of each forward) trains as one whose layers add their own, to float64 rounding, folds included (7 steps,
    block 3); with two forwards per step too (each layer hands over two batches per backward)."""
    a = _train(_model(method), _batches(7), views=views)
    b = _train(_model(method), _batches(7), hand_over=False, views=views)
    arenas = _coordinator(a)._arenas
    assert arenas and max(len(v.layers) for v in arenas.values()) >= 3  # grouped, not one by one
    assert not _coordinator(b)._arenas
    assert_states_close(a.state_dict(), b.state_dict(), rtol=1e-10, atol=1e-12)


class _TwoMeans(nn.Module):
    """Convs of one input shape, two of them fed a batch with a large mean (summed about a shift after the first
    fold), two a batch about 0 (summed unshifted): one group whose members differ in that."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 4, 3, padding=1, bias=False) for _ in range(4))

    def forward(self, x):
        return sum(conv(x + 10.0 * (i % 2)).mean((2, 3)) for i, conv in enumerate(self.convs))


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_stacked_accumulators_are_kept_across_blocks(method):
    """A group's stacked accumulator is made once and kept across folds: a block's first forward, where only the
    batches summed about 0 are handed over (the others start the block's shift), adds those one by one instead of
    stacking them anew (and the whole group again at the next forward). Sums as each layer's own (10 steps, block
    3)."""
    def model():
        torch.manual_seed(0)
        return wl.convert_model(_TwoMeans().double(), method, block_size=3, targets="all", include_stem=True,
                                include_classifier=True).to(memory_format=torch.channels_last)

    a = _train(model(), _batches(4))
    unshifted = [layer._block.unshifted for _, layer in wl.whitening_layers(a)]
    assert unshifted == [True, False, True, False]  # the case this test is about
    kept = {key: arena.acc for key, arena in _coordinator(a)._arenas.items()}  # (held: no id reused)
    _train(a, _batches(6, seed=2))
    arenas = _coordinator(a)._arenas
    assert kept and arenas.keys() == kept.keys() and all(arenas[key].acc is acc for key, acc in kept.items())
    b = _train(_train(model(), _batches(4), hand_over=False), _batches(6, seed=2), hand_over=False)
    assert_states_close(a.state_dict(), b.state_dict(), rtol=1e-10, atol=1e-12)


def _sums_during_forward(model, x, **ctx):
    """Each layer's accumulator as it is right after the layer's forward, and at the end of the model's."""
    during = {}
    layers = [m for _, m in wl.whitening_layers(model)]
    hooks = [m.register_forward_hook(lambda mod, i, o: during.__setitem__(mod, mod._block.acc.clone()))
             for m in layers]
    try:
        with wl.functional.fused_moments(True):
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return {m: (during[m], m._block.acc.clone()) for m in layers}


def test_a_training_forward_hands_its_batches_over_and_the_hook_adds_them():
    model = _model()
    x, y = _batches(2)
    _train(model, [x])  # the first block's first batch (its shift) is added by each layer
    sums = _sums_during_forward(model, y)
    handed = [m for m, (during, after) in sums.items() if not torch.equal(during, after)]
    assert len(handed) == len(sums)  # every layer's batch was added at the forward's end


@pytest.mark.parametrize("how", ["no_grad", "checkpoint", "frozen weight", "save_on_cpu", "replica"])
def test_batches_that_would_not_outlive_their_layer_are_added_at_once(how):
    """Nothing is held that the forward would free: without a recorded backward, under activation checkpointing or
    any saved-tensor hooks, or for a layer whose weight needs no gradient, a layer adds its own batch; so does a
    ``DataParallel`` replica."""
    model = _model()
    x, y = _batches(2)
    _train(model, [x])
    layers = [m for _, m in wl.whitening_layers(model)]
    if how == "no_grad":
        with torch.no_grad():
            sums = _sums_during_forward(model, y)
    elif how == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            sums = _sums_during_forward(model, y)
    elif how == "replica":  # DataParallel's replicas share their accumulators with the module they copy
        for m in [model, *layers]:  # (DataParallel marks every module of a replica)
            m.__dict__["_is_replica"] = True
        sums = _sums_during_forward(model, y)
    elif how == "frozen weight":
        for m in layers:
            m.weight.requires_grad_(False)
        sums = _sums_during_forward(model, y.requires_grad_(True))
    else:
        wrapped = nn.Sequential(model)
        wrapped.forward = lambda t: checkpoint(model, t, use_reentrant=False)
        sums = _sums_during_forward(wrapped, y)
    assert all(torch.equal(during, after) for during, after in sums.values())


def test_a_forward_that_raises_still_adds_the_batches_handed_over():
    model = _model()
    x, y = _batches(2)
    _train(model, [x])
    layers = [m for _, m in wl.whitening_layers(model)]
    before = [m._block.acc.clone() for m in layers]

    def fail(mod, inputs, output):
        raise RuntimeError("boom")

    handle = model.fc.register_forward_hook(fail)
    with wl.functional.fused_moments(True), pytest.raises(RuntimeError, match="boom"):
        model(y)
    handle.remove()
    assert all(not torch.equal(b, m._block.acc) for b, m in zip(before, layers))
    assert not _coordinator(model).scopes  # the collection is closed


def test_an_input_written_in_place_after_its_layer_is_refused_by_name():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x, write=False):
            out = self.fc(x)
            if write:
                x.mul_(2)  # the layer's input, after the layer read it
            return out

    model = wl.convert_model(Writes(), "grad", block_size=10, include_stem=True)
    with wl.functional.fused_moments(True):
        model(torch.randn(6, 4, dtype=torch.float64))  # the block's first batch (its shift): added by the layer
        with pytest.raises(RuntimeError, match=r"fc.*modified in place"):
            model(torch.randn(6, 4, dtype=torch.float64), write=True)


def test_a_layer_read_inside_the_forward_sees_its_batch():
    """``block_statistics()`` inside the model's forward (a hook) adds the batches handed over so far first."""
    model = _model()
    x, y = _batches(2)
    _train(model, [x])
    layer = [m for _, m in wl.whitening_layers(model)][3]
    seen = {}
    handle = layer.register_forward_hook(lambda mod, i, o: seen.update(stats=mod.block_statistics()))
    with wl.functional.fused_moments(True):
        model(y)
    handle.remove()
    after = layer.block_statistics()
    torch.testing.assert_close(seen["stats"].scatter, after.scatter, rtol=0, atol=0)
    assert float(seen["stats"].count) == float(after.count)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict", "reset one layer"])
def test_stacked_accumulators_stay_each_layers_own(how):
    """The layers' accumulators are slices of one stacked tensor per group: a copy, a pickle or a checkpoint has
    accumulators of its own (no slice of the original's stack), and a new block of one layer (a reset) zeroes its
    slice only."""
    model = _model()
    xs = _batches(3)
    _train(model, xs[:2])  # mid-block (block 3): partial sums in the stacked accumulators
    layers = [m for _, m in wl.whitening_layers(model)]
    assert any(m._block.acc._base is not None and m._block.acc._base.dim() == 3 for m in layers)
    before = [m._block.acc.clone() for m in layers]
    if how == "reset one layer":
        layers[2].discard_block()
        assert not layers[2]._block.acc.any()
        assert all(torch.equal(b, m._block.acc) for i, (b, m) in enumerate(zip(before, layers)) if i != 2)
        return
    if how == "deepcopy":
        other = copy.deepcopy(model)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(model))
    else:
        other = _model()
        other.load_state_dict(model.state_dict())
    copies = [m for _, m in wl.whitening_layers(other)]
    for m, c in zip(layers, copies):
        torch.testing.assert_close(c.block_statistics().scatter, m.block_statistics().scatter, rtol=0, atol=0)
        assert c._block.acc.untyped_storage().data_ptr() != m._block.acc.untyped_storage().data_ptr()
        assert c._block.acc._base is None or c._block.acc._base.dim() == 2  # its own accumulator, not a stack's slice
    _train(other, xs[2:])  # the copy trains on: the original's sums stay as they were
    assert all(torch.equal(b, m._block.acc) for b, m in zip(before, layers))
    reference = _train(_model(), xs, hand_over=False)
    for c, r in zip(copies, [m for _, m in wl.whitening_layers(reference)]):
        assert int(c.num_blocks) == int(r.num_blocks) == 1
        torch.testing.assert_close(c.running_cov, r.running_cov, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c.running_mean, r.running_mean, rtol=1e-10, atol=1e-12)


def test_a_layer_called_twice_in_one_forward_adds_both_batches():
    """A layer called twice in a forward hands over two batches: the second is added on its own (one stacked
    product adds into each accumulator once), and the sums are those of the layer adding its own."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False, dtype=torch.float64)
            self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=torch.float64)
            self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=torch.float64)
            self.head = nn.Linear(4, 2, dtype=torch.float64)

        def forward(self, x):
            x = self.stem(x).relu()
            x = self.b(self.a(x).relu()).relu()
            x = self.b(self.a(x).relu()).relu()  # a and b again: same input shapes as their first calls
            return self.head(x.mean((2, 3)))

    def run(hand_over):
        torch.manual_seed(0)
        model = wl.convert_model(Twice(), "grad", block_size=4, targets="all").to(memory_format=torch.channels_last)
        return _train(model, _batches(5), hand_over=hand_over)

    a, b = run(True), run(False)
    assert _coordinator(a)._arenas  # a and b grouped (first calls), their second calls on their own
    assert_states_close(a.state_dict(), b.state_dict(), rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shifted", [False, True])
def test_grouped_bf16_sums_on_cuda_are_each_layers_own(shifted):
    """On CUDA a bf16 batch summed about 0 goes into the batched products as it is (float32 output, in place where
    the torch has it); summed about a shift, in float32: each layer's own sums either way, to float32 rounding."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(8, 16, 6, 6, generator=gen, device=dev).to(memory_format=torch.channels_last).bfloat16()
          for _ in range(3)]
    shifts = [torch.randn(1, 16, 1, 1, generator=gen, device=dev) for _ in range(3)] if shifted else None
    acc = stacked_moments_accumulator(3, 16, device=dev)
    own = [moments_accumulator(16, device=dev) for _ in range(3)]
    accumulate_moments_grouped(acc, xs, shifts)
    for i, (a, x) in enumerate(zip(own, xs)):
        accumulate_moments(a, x, None if shifts is None else shifts[i])
        scale = float(a[:16, :17].abs().max())
        assert float((acc[i, :16, :17] - a[:16, :17]).abs().max()) <= 1e-5 * scale


def test_a_forward_whose_end_hook_is_gone_holds_its_batches_one_forward_at_most():
    """Without the coordinator's end hook (removed by hand), the next forward's start adds what the last one handed
    over: no batch is held longer than one forward."""
    model = _model()
    x, y, z = _batches(3)
    _train(model, [x])
    coordinator = _coordinator(model)
    coordinator.handle.remove()
    layers = len(wl.whitening_layers(model))
    with wl.functional.fused_moments(True):
        model(y)
        assert [len(scope.batches) for scope in coordinator.scopes.values()] == [layers]  # held: no end hook
        model(z)
        assert [len(scope.batches) for scope in coordinator.scopes.values()] == [layers]  # y's added, z's held
