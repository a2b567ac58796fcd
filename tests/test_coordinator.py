"""The fold coordinator only does together what the layers would do alone: a converted model trains the same with
its shared nodes and grouped statistics as with every layer doing its own work (``state_utils.layers_alone``): to the
bit where the arithmetic is the same (the shared weight-gradient node, on the CPU's statistics path), to float64
rounding where it is not (grouped sums, the shared ``W T`` products)."""
import copy
import pickle

import pytest
import torch
from state_utils import assert_states_close, coordinator_of, layers_alone
from torch import nn

import whitenlayers as wl
import whitenlayers.coordinator as coordinator_module
from whitenlayers.coordinator import SharedWeightProduct

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


def _model(method, shared=True, **kw):
    torch.manual_seed(0)
    net = _Net(**{k: kw.pop(k) for k in ("momentum", "track") if k in kw}).to(DT)
    model = wl.convert_model(net, method, block_size=3, targets="all", include_classifier=True, **kw)
    return model if shared else layers_alone(model)


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


@pytest.mark.parametrize("method", ["grad", "recursive"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("kw", [{}, {"stats_every": 2}, {"momentum": None}, {"track": False}],
                         ids=["defaults", "stats_every", "cumulative_bn", "bn_without_running_stats"])
def test_the_shared_weight_node_trains_bit_identically(method, channels_last, kw):
    """Folds included (8 steps, block 3), the CPU's statistics path: every parameter, buffer and accumulator equal
    to the bit with the shared weight-gradient node and with a ``WeightGradTransform`` per layer; absorbed
    centring with a BatchNorm's momentum, a cumulative average or no running statistics, and ``stats_every``."""
    shared = _train(_model(method, **kw), channels_last=channels_last)
    alone = _train(_model(method, False, **kw), channels_last=channels_last)
    _assert_identical(shared, alone)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_on_cudas_path_the_model_trains_as_its_layers_alone(method, channels_last):
    """CUDA's statistics path (``fused_moments``): the batches handed over and added grouped, the ``direct``
    wrappers' ``W T`` from one shared node: the same training as the layers alone, to float64 rounding."""
    shared = _train(_model(method), fused=True, channels_last=channels_last, views=2)
    alone = _train(_model(method, False), fused=True, channels_last=channels_last, views=2)
    assert_states_close(shared.state_dict(), alone.state_dict(), rtol=1e-10, atol=1e-12)


def test_a_layer_called_twice_and_a_forward_under_no_grad_inside_the_model():
    """A layer called twice in one forward takes the shared node at its first call only; a part of the forward run
    under no_grad hands nothing over; training is bit-identical to the layers alone."""
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

    def run(shared):
        torch.manual_seed(0)
        model = wl.convert_model(Odd(), "grad", block_size=2, targets="all")
        return _train(model if shared else layers_alone(model), steps=5)

    _assert_identical(run(True), run(False))


def test_scopes_are_not_pickled_or_copied():
    model = _model("grad")
    _train(model, steps=2)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not coordinator_of(clone).scopes
        _train(clone, steps=2)
    assert not coordinator_of(model).scopes


@pytest.mark.parametrize("fused", [False, True])
def test_conv1d_and_conv3d_share_and_train_bit_identically(fused):
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

    def run(shared):
        torch.manual_seed(0)
        model = wl.convert_model(ConvNd().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        assert len(wl.whitening_layers(model)) == 3
        return _train(model if shared else layers_alone(model), fused=fused)

    a, b = run(True), run(False)
    if fused:  # grouped sums: float64 rounding
        assert_states_close(a.state_dict(), b.state_dict(), rtol=1e-10, atol=1e-12)
    else:
        _assert_identical(a, b)


def test_one_product_node_and_hooked_wrappers_alone(monkeypatch):
    """One backward call of the shared product per forward, for every fused wrapper; a wrapper with a hook on its
    layer is not fused (its hook sees the whitened input) and takes no product."""
    calls = []
    original = SharedWeightProduct.backward

    def counted(ctx, *grads):
        calls.append(sum(g is not None for g in grads))
        return original(ctx, *grads)

    monkeypatch.setattr(SharedWeightProduct, "backward", staticmethod(counted))
    model = _model("direct")
    wrappers = [m for m in model.modules() if isinstance(m, wl.DirectWhitenWrapper)]
    seen = []
    wrappers[1].layer.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    _train(model, steps=2)
    assert calls == [len(wrappers) - 1] * 2
    assert len(seen) == 2  # the hooked layer was called on its own, with the whitened input


def test_a_bad_input_is_refused_by_the_layer_inside_the_model():
    """The layer's own check, naming it, whatever the coordinator prepared."""
    model = _model("grad")
    name, layer = wl.whitening_layers(model)[2]
    handle = layer.register_forward_pre_hook(lambda m, args: (args[0].float(),))  # the model is float64
    with pytest.raises(TypeError, match=rf"{name}.*expected an input of dtype torch.float64"):
        model(torch.randn(2, 3, 8, 8, dtype=DT))
    handle.remove()
    model(torch.randn(2, 3, 8, 8, dtype=DT)).sum().backward()  # and trains on afterwards


def test_a_forward_without_its_end_hook_leaves_no_state_on_the_layers():
    """The coordinator's end hook removed by hand: the next forward adds what the last one left in its scope; the
    layers hold nothing of the coordinator's, and fold at their own blocks' ends."""
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
    def run(shared):
        torch.manual_seed(0)
        model = wl.convert_model(_Net(), method, block_size=3, targets="all", include_classifier=True).cuda()
        model = (model if shared else layers_alone(model)).to(memory_format=torch.channels_last)
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


def _ddp_shared(rank, world, defer):
    """A rank's training under DDP: with the shared nodes (runs of ``DISTRIBUTED_RUN``), with a node per layer, and
    with the layers alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    default = coordinator_module.DISTRIBUTED_RUN
    for how in ("shared", "a node per layer", "alone"):
        coordinator_module.DISTRIBUTED_RUN = 1 if how == "a node per layer" else default
        torch.manual_seed(0)
        model = wl.convert_model(_Net().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        if how == "alone":
            layers_alone(model)
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
        out[how] = {k: v.clone() for k, v in model.state_dict().items()}
    coordinator_module.DISTRIBUTED_RUN = default
    return out


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["default", "deferred"])
def test_under_ddp_the_shared_nodes_train_bit_identically(defer):
    """Under DDP (two gloo ranks) the weights go through shared nodes in runs of ``DISTRIBUTED_RUN`` layers (or the
    deferral's hooks): the same training to the bit as a node per layer and as the layers alone, on each rank."""
    from dist_utils import run_distributed

    for rank_result in run_distributed(_ddp_shared, defer):
        for key in rank_result["alone"]:
            assert torch.equal(rank_result["shared"][key], rank_result["alone"][key]), key
            assert torch.equal(rank_result["shared"][key], rank_result["a node per layer"][key]), key


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

    out = {}
    default = coordinator_module.DISTRIBUTED_RUN
    for run in (default, 1):
        coordinator_module.DISTRIBUTED_RUN = run
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
        out[run] = {k: v.clone() for k, v in model.state_dict().items()}
    coordinator_module.DISTRIBUTED_RUN = default
    return out


@pytest.mark.slow
def test_shared_runs_under_ddp_with_layers_skipped():
    """Under ``DDP(find_unused_parameters=True)``, a layer skipped by a forward still gets a view of its run's
    shared node (made before the forward) but no gradient: DDP takes it as unused, and training is bit-identical to
    a node per layer (two gloo ranks, 8 steps, folds included)."""
    from dist_utils import run_distributed

    for rank_result in run_distributed(_ddp_skipping):
        runs, per_layer = rank_result.values()
        assert runs.keys() == per_layer.keys()
        for key in runs:
            assert torch.equal(runs[key], per_layer[key]), key


@pytest.mark.parametrize("fused", [False, True])
def test_deferred_layers_take_their_own_weight_path(fused):
    """``defer_grad_transform`` in one process: the deferred layers take no shared node (their weight through the
    deferral's hook): the same training as the layers alone."""
    def run(shared):
        model = _model("grad", shared)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(model, opt)
        _train(model, fused=fused)
        deferral.remove()
        return model

    a, b = run(True), run(False)
    if fused:
        assert_states_close(a.state_dict(), b.state_dict(), rtol=1e-10, atol=1e-12)
    else:
        _assert_identical(a, b)


@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_channels_last_weights_get_their_gradients_in_their_own_strides(method):
    """DDP's buckets take a gradient as it is only when its strides are its parameter's (else a copy and a warning,
    "Grad strides do not match bucket view strides"): the 1x1 products keep channels_last's strides, as the plain
    model's convolutions do."""
    model = _train(_model(method), steps=1, channels_last=True)
    weights = [(n, p) for n, p in model.named_parameters() if p.dim() == 4 and p.grad is not None]
    assert any(p.shape[-2:] == (1, 1) for _, p in weights)  # the 1x1 shortcut is exercised
    assert [(n, p.grad.stride()) for n, p in weights] == [(n, p.stride()) for n, p in weights]
