"""The fold coordinator only folds together what the layers would fold alone: a converted model trains the same with
its coordinator (the layers whose block ended folded at the forward's end, stacked: one batched transform per width)
as with every layer folding at its own block's end (``state_utils.layers_alone``), to float64 rounding (a batched
eigendecomposition against one per layer). Every step is the layers' own."""
import copy
import pickle

import pytest
import torch
from state_utils import assert_states_close, coordinator_of, layers_alone
from torch import nn

import whitenlayers as wl

DT = torch.float64


class _Net(nn.Module):
    """Convs centred by their layer and absorbed by a BatchNorm, and a linear head converted too."""

    def __init__(self, momentum=0.1, track=True):
        super().__init__()
        self.net = wl.models.cifar_resnet(8, width=4)
        for m in self.net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.momentum = momentum
                m.track_running_stats = track
                if not track:
                    m.running_mean = m.running_var = m.num_batches_tracked = None
        self.extra = nn.Conv2d(16, 16, 1, bias=True)  # centred convs: with a bias, and without
        self.extra2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)

    def forward(self, x):
        n = self.net
        x = n.layer3(n.layer2(n.layer1(n.bn1(n.conv1(x)).relu())))
        x = self.extra2(self.extra(x).relu()).relu()
        return n.fc(x.mean((2, 3)))


def _model(method, together=True, **kw):
    torch.manual_seed(0)
    net = _Net(**{k: kw.pop(k) for k in ("momentum", "track") if k in kw}).to(DT)
    model = wl.convert_model(net, method, block_size=3, targets="all", include_classifier=True, **kw)
    return model if together else layers_alone(model)


def _train(model, steps=8, fused=False, channels_last=False, views=1):
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    with wl.functional.fused_moments(fused):
        for _ in range(steps):
            x = torch.randn(4, 3, 8, 8, generator=gen, dtype=DT) * 2 + 1
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            opt.zero_grad()
            sum(model(x * (1 + v)).logsumexp(1).mean() for v in range(views)).backward()
            opt.step()
    return model


def _assert_identical(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


#: A batched eigendecomposition against one per layer, float64: the folds' results differ by rounding.
TOL = dict(rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("kw", [{}, {"stats_every": 2}, {"momentum": None}, {"track": False}],
                         ids=["defaults", "stats_every", "cumulative_bn", "bn_without_running_stats"])
def test_the_coordinators_folds_train_as_the_layers_alone(method, channels_last, kw):
    """Folds included (8 steps, block 3), the CPU's statistics path and CUDA's (``fused_moments``): every parameter,
    buffer and accumulator with the coordinator equal to the layers folding alone; absorbed centring with a
    BatchNorm's momentum, a cumulative average or no running statistics, and ``stats_every``."""
    for fused in (False, True):
        together = _train(_model(method, **kw), fused=fused, channels_last=channels_last, views=2)
        alone = _train(_model(method, False, **kw), fused=fused, channels_last=channels_last, views=2)
        assert_states_close(together.state_dict(), alone.state_dict(), **TOL)


def test_a_layer_called_twice_and_a_forward_under_no_grad_inside_the_model():
    """A layer called twice in one forward (its block ending at the first call: folded before the second) and a part
    of the forward run under no_grad: training as the layers alone."""
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False, dtype=DT)
            self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=DT)
            self.frozen_part = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=DT)
            self.head = nn.Linear(4, 2, dtype=DT)

        def forward(self, x):
            x = self.a(self.a(self.stem(x).relu()).relu())
            with torch.no_grad():
                y = self.frozen_part(x)
            return self.head((x + y).mean((2, 3)))

    def run(together):
        torch.manual_seed(0)
        model = wl.convert_model(Odd(), "grad", block_size=2, targets="all")
        return _train(model if together else layers_alone(model), steps=5)

    assert_states_close(run(True).state_dict(), run(False).state_dict(), **TOL)


def test_scopes_are_not_pickled_or_copied():
    model = _model("grad")
    _train(model, steps=2)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not coordinator_of(clone).scopes
        _train(clone, steps=2)
    assert not coordinator_of(model).scopes


@pytest.mark.parametrize("fused", [False, True])
def test_conv1d_and_conv3d_train_as_the_layers_alone(fused):
    class ConvNd(nn.Module):
        """1-D and 3-D convs (one absorbed by its BatchNorm, one centred with a bias) in one model."""

        def __init__(self):
            super().__init__()
            self.stem1 = nn.Conv1d(3, 4, 3, padding=1, bias=False)
            self.c1 = nn.Conv1d(4, 6, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm1d(6)
            self.c3 = nn.Conv3d(6, 5, 3, padding=1, bias=True)
            self.head = nn.Linear(5, 2)

        def forward(self, x):  # x: (B, 3, 8, 8)
            a = self.bn1(self.c1(self.stem1(x.flatten(2)).relu())).relu()  # (B, 6, 64)
            b = self.c3(a.view(a.shape[0], 6, 4, 4, 4)).relu()
            return self.head(b.mean((2, 3, 4)))

    def run(together):
        torch.manual_seed(0)
        model = wl.convert_model(ConvNd().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        assert len(wl.whitening_layers(model)) == 3
        return _train(model if together else layers_alone(model), fused=fused)

    assert_states_close(run(True).state_dict(), run(False).state_dict(), **TOL)


def test_a_bad_input_is_refused_by_the_layer_inside_the_model():
    """The layer's own check, naming it, inside the model's forward."""
    model = _model("grad")
    name, layer = wl.whitening_layers(model)[2]
    handle = layer.register_forward_pre_hook(lambda m, args: (args[0].float(),))  # the model is float64
    with pytest.raises(TypeError, match=rf"{name}.*expected an input of dtype torch.float64"):
        model(torch.randn(2, 3, 8, 8, dtype=DT))
    handle.remove()
    model(torch.randn(2, 3, 8, 8, dtype=DT)).sum().backward()  # and trains on afterwards


def test_a_forward_without_its_end_hook_leaves_no_state_on_the_layers():
    """The coordinator's end hook removed by hand: a block that ended in a forward is folded at the layer's next
    forward; the layers hold nothing of the coordinator's."""
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = wl.models.cifar_resnet(8, width=4).to(DT)

        def forward(self, x, skip=False):
            n = self.net
            x = n.bn1(n.conv1(x)).relu()
            return n.fc(n.layer3(n.layer2(x if skip else n.layer1(x))).mean((2, 3)))

    model = wl.convert_model(Skips(), "grad", block_size=2)
    coordinator_of(model).handle.remove()
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    model(x, skip=True).sum().backward()
    for _ in range(3):
        model(x).sum().backward()
    assert all(int(m.num_blocks) >= 1 for _, m in wl.whitening_layers(model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["grad", "direct"])
def test_on_cuda_the_model_trains_as_its_layers_alone(method):
    """On CUDA (its statistics path, bf16 autocast): to float32 rounding (cuDNN's convolution backward need not be
    bit-reproducible)."""
    def run(together):
        torch.manual_seed(0)
        model = wl.convert_model(_Net(), method, block_size=3, targets="all", include_classifier=True).cuda()
        model = (model if together else layers_alone(model)).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(8):
            x = (torch.randn(8, 3, 8, 8, generator=gen) * 2 + 1).cuda().to(memory_format=torch.channels_last)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().logsumexp(1).mean()
            loss.backward()
            opt.step()
        return model

    assert_states_close(run(True).state_dict(), run(False).state_dict(), rtol=2e-3, atol=2e-4)


def _ddp_default_and_deferred(rank, world):
    """A rank's training under DDP: the default weight-gradient transform (an autograd node per layer) and
    ``defer_grad_transform`` (a hook per weight)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for defer in (False, True):
        torch.manual_seed(0)
        model = wl.convert_model(_Net().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(ddp, opt) if defer else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(7):
            x = torch.randn(4, 3, 8, 8, generator=gen, dtype=DT) * 2 + 1
            opt.zero_grad()
            ddp(x.chunk(world)[rank]).logsumexp(1).mean().backward()
            opt.step()
        if deferral is not None:
            deferral.remove()
        out[defer] = {k: v.clone() for k, v in model.state_dict().items()}
    out["shared"] = _same_on_every_rank(model)
    return out


def _same_on_every_rank(model):
    """The keys of ``model``'s state that DDP keeps equal across ranks: its parameters and its whitening layers'
    state (not their partial blocks, each rank's own; not a BatchNorm's running statistics)."""
    layers = [name + "." for name, _ in wl.whitening_layers(model)]
    params = {name for name, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k in params
            or (k.startswith(tuple(layers)) and not k.endswith("_extra_state"))]


@pytest.mark.slow
def test_under_ddp_the_deferred_transform_trains_bit_identically():
    """Under DDP (two gloo ranks) the weights' gradients transformed by a hook on each weight
    (``defer_grad_transform``): the same training to the bit as the default, on each rank; the ranks equal."""
    from dist_utils import run_distributed

    results = run_distributed(_ddp_default_and_deferred)
    for rank_result in results:
        for key in rank_result[False]:
            assert torch.equal(rank_result[False][key], rank_result[True][key]), key
        for key in rank_result["shared"]:
            assert torch.equal(rank_result[False][key], results[0][False][key]), key


class _Skipping(nn.Module):
    """Six convs, one of them skipped on some forwards (DDP's ``find_unused_parameters``)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4 if i else 3, 4, 3, padding=1) for i in range(6))
        self.fc = nn.Linear(4, 3)

    def forward(self, x, skip=-1):
        for i, conv in enumerate(self.convs):
            if i != skip:
                x = torch.relu(conv(x))
        return self.fc(x.mean((2, 3)))


def _ddp_skipping(rank, world):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = wl.convert_model(_Skipping().to(DT), "grad", targets="all", include_stem=True,
                             include_classifier=True, block_size=3)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5 + rank)
    for step in range(8):
        x = torch.randn(2, 3, 6, 6, generator=gen, dtype=DT)
        opt.zero_grad()
        F.cross_entropy(ddp(x, skip=step % 3 + 1 if step % 2 else -1), torch.zeros(2, dtype=torch.long)).backward()
        opt.step()
    return {k: model.state_dict()[k].clone() for k in _same_on_every_rank(model)}


@pytest.mark.slow
def test_under_ddp_layers_skipped_by_some_forwards_train_in_step():
    """Under ``DDP(find_unused_parameters=True)`` a layer skipped by a forward gets no gradient (DDP takes it as
    unused) and counts no batch: two gloo ranks, 8 steps, folds included, end bit-identical."""
    from dist_utils import run_distributed

    first, second = run_distributed(_ddp_skipping)
    assert first.keys() == second.keys() and any(k.endswith("grad_transform") for k in first)
    for key in first:
        assert torch.equal(first[key], second[key]), key


@pytest.mark.parametrize("fused", [False, True])
def test_deferred_layers_train_as_the_default(fused):
    """``defer_grad_transform`` in one process: the weight's hook transforms each backward's gradient as the default
    autograd node does: the same training, to the bit."""
    def run(defer):
        model = _model("grad")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(model, opt) if defer else None
        _train(model, fused=fused)
        if deferral is not None:
            deferral.remove()
        return model

    _assert_identical(run(True), run(False))


def test_a_layer_read_inside_the_forward_sees_its_batch():
    """``block_statistics()`` inside the model's forward (a hook on the layer) holds the forward's batch."""
    model = _model("grad")
    _train(model, steps=1)
    layer = model.extra2  # (centred by itself: a hook on it sees its output as it is)
    seen = {}
    handle = layer.register_forward_hook(lambda mod, i, o: seen.update(stats=mod.block_statistics()))
    model(torch.randn(4, 3, 8, 8, dtype=DT))
    handle.remove()
    after = layer.block_statistics()
    torch.testing.assert_close(seen["stats"].scatter, after.scatter, rtol=0, atol=0)
    assert float(seen["stats"].count) == float(after.count) > 0


def test_a_forward_that_raises_still_folds_the_blocks_that_ended_in_it():
    """The coordinator's end hook is always called: a block that ended in a forward that raised afterwards is
    folded, and training goes on."""
    model = _model("grad")
    _train(model, steps=2)  # the blocks' third batch ends them
    handle = model.net.fc.register_forward_hook(lambda mod, inputs, output: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(4, 3, 8, 8, dtype=DT))
    handle.remove()
    layers = [m for _, m in wl.whitening_layers(model)]
    assert all(int(m.num_blocks) == 1 and not m.fold_block.fold_pending for m in layers[:-1])  # (not the head's)
    assert not coordinator_of(model).scopes  # the forward's scope is closed
    _train(model, steps=1)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_channels_last_weights_get_their_gradients_in_their_own_strides(method):
    """DDP's buckets take a gradient as it is only when its strides are its parameter's (else a copy and a warning,
    "Grad strides do not match bucket view strides"): the 1x1 products keep channels_last's strides, as the plain
    model's convolutions do."""
    model = _train(_model(method), steps=1, channels_last=True)
    weights = [(n, p) for n, p in model.named_parameters() if p.dim() == 4 and p.grad is not None]
    assert any(p.shape[-2:] == (1, 1) for _, p in weights)  # the 1x1 shortcut is exercised
    assert [(n, p.grad.stride()) for n, p in weights] == [(n, p.stride()) for n, p in weights]
