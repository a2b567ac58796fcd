"""Planned forwards (issue 48): the fold coordinator's pre-hook decides what each grad / recursive layer's next
training forward does (``layers._base.share_weight_transforms``, ``_GradWhitenMixin._step_plan``), and the layer's
forward runs the operations with few checks. Within one process that is the full path's operations in the full
path's order: training is bit-identical, which these tests assert against the same model with plans switched off."""
import pytest
import torch
from torch import nn

import whitenlayers as wl
import whitenlayers.convert._common as convert_common
from whitenlayers.autograd import SharedWeightProduct
from whitenlayers.coordinator import FoldCoordinator
from whitenlayers.layers._base import _GradWhitenMixin

DT = torch.float64


def _coordinator(model):
    return next(h for h in model._forward_hooks.values() if isinstance(h, FoldCoordinator))


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


def _model(method, planned, **kw):
    torch.manual_seed(0)
    net = _Net(**{k: kw.pop(k) for k in ("momentum", "track") if k in kw}).to(DT)
    model = wl.convert_model(net, method, block_size=3, targets="all", include_classifier=True, **kw)
    if not planned:
        for _, layer in wl.whitening_layers(model):
            layer.__dict__["_step_plan_off"] = True
    return model


@pytest.fixture(autouse=True)
def _plans_switchable(monkeypatch):
    """A layer marked ``_step_plan_off`` takes the full path (the reference); the others are planned."""
    original = _GradWhitenMixin._step_plan

    def step_plan(self, view, state, sink):
        return None if self.__dict__.get("_step_plan_off") else original(self, view, state, sink)

    monkeypatch.setattr(_GradWhitenMixin, "_step_plan", step_plan)


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
@pytest.mark.parametrize("fused,channels_last", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("kw", [{}, {"stats_every": 2}, {"momentum": None}, {"track": False}],
                         ids=["defaults", "stats_every", "cumulative_bn", "bn_without_running_stats"])
def test_planned_forwards_train_bit_identically(method, fused, channels_last, kw):
    """Folds included (8 steps, block 3): every parameter, buffer and accumulator equal to the bit, on the CPU's
    own path and on CUDA's (statistics handed to the coordinator), absorbed centring with a BatchNorm's momentum, a
    cumulative average or no running statistics, and ``stats_every``."""
    planned = _train(_model(method, True, **kw), fused=fused, channels_last=channels_last)
    reference = _train(_model(method, False, **kw), fused=fused, channels_last=channels_last)
    _assert_identical(planned, reference)


def test_forwards_planned_are_the_model_layers_training_forwards():
    """Every layer's first training forward in the model takes its plan; a second forward per step (two views) and
    eval mode, no_grad and inference_mode forwards take the full path; a plan left unused is dropped."""
    model = _model("grad", True)
    layers = [m for _, m in wl.whitening_layers(model)]
    taken = []
    original = _GradWhitenMixin._run_plan

    def run_plan(self, plan, x):
        taken.append(self)
        return original(self, plan, x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_GradWhitenMixin, "_run_plan", run_plan)
        _train(model, steps=2, views=2)
        assert len(taken) == 2 * 2 * len(layers)  # each forward's layers, once each (one call per forward)
        taken.clear()
        x = torch.randn(2, 3, 8, 8, dtype=DT)
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(x)
        model.eval()(x).sum().backward()
        assert taken == []
    assert not any("_planned" in m.__dict__ for m in layers)


def test_a_layer_called_twice_and_a_forward_under_no_grad_inside_the_model():
    """A layer called twice in one forward plans its first call only; a part of the forward run under no_grad
    takes the full path (its layers' plans are dropped); training is bit-identical to the full path."""
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

    def run(planned):
        torch.manual_seed(0)
        model = wl.convert_model(Odd(), "grad", block_size=2, targets="all")
        if not planned:
            for _, layer in wl.whitening_layers(model):
                layer.__dict__["_step_plan_off"] = True
        return _train(model, steps=5)

    _assert_identical(run(True), run(False))


def test_plans_are_not_pickled_or_copied():
    import copy
    import pickle

    model = _model("grad", True)
    _train(model, steps=2)
    for _, layer in wl.whitening_layers(model):
        assert "_absorb_plan" in layer.__dict__ or layer._centring_ref is None
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not any(k in layer.__dict__ for _, layer in wl.whitening_layers(clone)
                       for k in ("_absorb_plan", "_planned", "_shared_weight"))
        _train(clone, steps=2)
    _coordinator(model)  # still installed


# ---------------------------------------------------------------- direct
def _direct_model(planned, **kw):
    torch.manual_seed(0)
    model = wl.convert_model(_Net().to(DT), "direct", block_size=3, targets="all", include_classifier=True, **kw)
    _coordinator(model).on_forward = convert_common.plan_forward if planned else None
    return model


@pytest.mark.parametrize("fused,channels_last", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("kw", [{}, {"stats_every": 2}], ids=["defaults", "stats_every"])
def test_planned_direct_wrappers_train_as_their_full_path(fused, channels_last, kw):
    """A fused ``direct`` wrapper's planned forward (``W T`` of every wrapper from one shared node made before the
    model's forward): the same training as each wrapper's full path, float64, folds included. Not to the bit: the
    shared node's backward multiplies ``d(W T)`` by ``T^T`` itself, where the full path's product takes autograd's
    backward; the statistics and counts are the same operations."""
    planned = _train(_direct_model(True, **kw), fused=fused, channels_last=channels_last)
    reference = _train(_direct_model(False, **kw), fused=fused, channels_last=channels_last)
    sa, sb = planned.state_dict(), reference.state_dict()
    for key in sb:
        if sb[key].is_floating_point():
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-12, atol=1e-13, msg=key)
        else:
            assert torch.equal(sa[key], sb[key]), key


def test_direct_plans_one_product_node_and_leave_hooked_wrappers_alone(monkeypatch):
    """One backward call of the shared product per forward, for every fused wrapper; a wrapper with a hook on its
    layer is not fused (its hook sees the whitened input) and not planned; nothing is left on the layers."""
    calls = []
    original = SharedWeightProduct.backward

    def counted(ctx, *grads):
        calls.append(sum(g is not None for g in grads))
        return original(ctx, *grads)

    monkeypatch.setattr(SharedWeightProduct, "backward", staticmethod(counted))
    model = _direct_model(True)
    wrappers = [m for m in model.modules() if isinstance(m, convert_common.DirectWhitenWrapper)]
    seen = []
    wrappers[1].layer.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    _train(model, steps=2)
    assert calls == [len(wrappers) - 1] * 2
    assert len(seen) == 2  # the hooked layer was called on its own, with the whitened input
    assert not any(k in w.whiten.__dict__ for w in wrappers for k in ("_planned",))


class _ConvNd(nn.Module):
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


@pytest.mark.parametrize("fused", [False, True])
def test_planned_conv1d_and_conv3d_train_bit_identically(fused):
    def run(planned):
        torch.manual_seed(0)
        model = wl.convert_model(_ConvNd().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        assert len(wl.whitening_layers(model)) == 3
        if not planned:
            for _, layer in wl.whitening_layers(model):
                layer.__dict__["_step_plan_off"] = True
        return _train(model, fused=fused)

    _assert_identical(run(True), run(False))


def test_a_planned_layer_refuses_a_bad_input_as_its_full_path_does():
    """An input the layer's check refuses is not taken by its plan: the full path's error, naming the layer."""
    model = _model("grad", True)
    name, layer = wl.whitening_layers(model)[2]
    handle = layer.register_forward_pre_hook(lambda m, args: (args[0].float(),))  # the model is float64
    with pytest.raises(TypeError, match=rf"{name}.*expected an input of dtype torch.float64"):
        model(torch.randn(2, 3, 8, 8, dtype=DT))
    handle.remove()
    model(torch.randn(2, 3, 8, 8, dtype=DT)).sum().backward()  # and trains on afterwards


def test_a_plan_left_by_a_forward_without_its_end_hook_is_replaced():
    """A layer not called in a forward keeps its plan when the coordinator's end hook is gone (removed by hand); the
    next forward plans it again over the old one (a plan is data, never the method that makes it)."""
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = wl.models.cifar_resnet(8, width=4).to(DT)

        def forward(self, x, skip=False):
            n = self.net
            x = n.bn1(n.conv1(x)).relu()
            return n.fc(n.layer3(n.layer2(x if skip else n.layer1(x))).mean((2, 3)))

    model = wl.convert_model(Skips(), "grad", block_size=2)
    _coordinator(model).handle.remove()
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    model(x, skip=True).sum().backward()
    left = [m for _, m in wl.whitening_layers(model) if "_planned" in m.__dict__]
    assert left  # layer1's convs were not called
    for _ in range(3):
        model(x).sum().backward()
    assert all(int(m.num_blocks) >= 1 for _, m in wl.whitening_layers(model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["grad", "direct"])
def test_planned_forwards_on_cuda_train_as_the_full_path(method):
    """On CUDA (its statistics path, bf16 autocast): the planned model trains as the one without plans, to float32
    rounding (cuDNN's convolution backward need not be bit-reproducible)."""
    def run(planned):
        torch.manual_seed(0)
        model = wl.convert_model(_Net(), method, block_size=3, targets="all", include_classifier=True).cuda()
        if not planned:
            _coordinator(model).on_forward = None
        model = model.to(memory_format=torch.channels_last)
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

    a, b = run(True).state_dict(), run(False).state_dict()
    for key in b:
        if b[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=2e-3, atol=2e-4, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key


def _ddp_planned(rank, world, defer):
    """A rank's training under DDP: a planned model and one whose layers take the full path (no plan, an instance
    attribute over the method), and how many planned forwards the first ran."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import whitenlayers.layers._base as layers_base

    out = {}
    for planned in (True, False, "a node per layer"):
        run = layers_base.DISTRIBUTED_RUN
        if planned == "a node per layer":  # planned, each weight through a node of its own
            layers_base.DISTRIBUTED_RUN = 1
        torch.manual_seed(0)
        model = wl.convert_model(_Net().to(DT), "grad", block_size=3, targets="all", include_classifier=True)
        runs = []
        for _, layer in wl.whitening_layers(model):
            if planned:
                original = layer._run_plan
                layer.__dict__["_run_plan"] = lambda plan, x, original=original: runs.append(1) or original(plan, x)
            else:
                layer.__dict__["_step_plan"] = lambda view, state, sink: None
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
        layers_base.DISTRIBUTED_RUN = run
        out[planned] = ({k: v.clone() for k, v in model.state_dict().items()}, len(runs))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["default", "deferred"])
def test_planned_forwards_under_ddp_train_bit_identically(defer):
    """Under DDP (two gloo ranks) the layers' steps are planned, their weights through shared nodes in runs of
    ``DISTRIBUTED_RUN`` layers (or the deferral's hooks): the same training to the bit as the full path, and as
    planned steps with a node per layer, on each rank."""
    from dist_utils import run_distributed

    results = run_distributed(_ddp_planned, defer)
    layers = 9
    for rank_result in results:
        (planned, runs), (full, none) = rank_result[True], rank_result[False]
        per_layer, per_layer_runs = rank_result["a node per layer"]
        assert runs == per_layer_runs == 7 * layers and none == 0
        for key in full:
            assert torch.equal(planned[key], full[key]), key
            assert torch.equal(planned[key], per_layer[key]), key


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
    """A rank's training under ``DDP(find_unused_parameters=True)`` with a layer skipped on every other step: with
    runs of shared nodes, and with a node per layer."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import whitenlayers.layers._base as layers_base

    out = {}
    default = layers_base.DISTRIBUTED_RUN
    for run in (default, 1):
        layers_base.DISTRIBUTED_RUN = run
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
    layers_base.DISTRIBUTED_RUN = default
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
def test_deferred_layers_are_planned_with_their_own_weight_path(fused):
    """``defer_grad_transform`` in one process: the deferred layers take no shared node but are planned (their
    weight through the deferral's hook): bit-identical to the full path, and every layer's forward planned."""
    def run(planned):
        model = _model("grad", planned)
        runs = []
        for _, layer in wl.whitening_layers(model):
            original = layer._run_plan
            layer.__dict__["_run_plan"] = lambda plan, x, original=original: runs.append(plan[0]) or original(plan, x)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        deferral = wl.defer_grad_transform(model, opt)
        gen = torch.Generator().manual_seed(1)
        with wl.functional.fused_moments(fused):
            for _ in range(8):
                x = torch.randn(4, 3, 8, 8, generator=gen, dtype=DT) * 2 + 1
                opt.zero_grad()
                model(x).logsumexp(1).mean().backward()
                opt.step()
        deferral.remove()
        return model, runs

    (a, runs), (b, none) = run(True), run(False)
    assert len(runs) == 8 * len(wl.whitening_layers(a)) and all(view is None for view in runs) and not none
    _assert_identical(a, b)
