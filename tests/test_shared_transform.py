"""One autograd node for a converted model's weight-gradient transforms: the fold coordinator's pre-hook puts the grad
/ recursive layers' weights through ``SharedWeightGradTransform`` before the forward, and the layers use those views
(registering their forward's ``Q_s``) instead of one ``WeightGradTransform`` each."""
import pytest
import torch
from state_utils import assert_states_close, coordinator_of, layers_alone
from torch import nn
from torch.utils.checkpoint import checkpoint

import whitenlayers as wl
from whitenlayers.coordinator import SharedWeightGradTransform

DT = torch.float64


def _model(method="grad", shared=True, **kw):
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=4).to(DT), method, block_size=2, **kw)
    return model if shared else layers_alone(model)


@pytest.fixture
def backward_calls(monkeypatch):
    calls = []
    original = SharedWeightGradTransform.backward

    def counted(ctx, *grads):
        calls.append(sum(g is not None for g in grads))
        return original(ctx, *grads)

    monkeypatch.setattr(SharedWeightGradTransform, "backward", staticmethod(counted))
    return calls


def _train(model, steps=6, views=1, accumulate=1, wrap=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(1)
    run = model if wrap is None else wrap(model)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(4, 3, 8, 8, generator=gen, dtype=DT) + 1
            sum(run(x * (1 + v)).logsumexp(1).mean() for v in range(views)).backward()
        opt.step()
    return model


@pytest.mark.parametrize("method", ["grad", "recursive"])
@pytest.mark.parametrize("views,accumulate", [(1, 1), (2, 1), (1, 2)])
def test_one_shared_node_trains_as_a_function_per_layer(method, views, accumulate, backward_calls):
    """Folds included (block 2, 6 steps): the same parameters and state as the per-layer Function, float64; one
    backward call of the shared node per forward, for all the model's grad layers."""
    shared = _train(_model(method), views=views, accumulate=accumulate)
    layers = len(wl.whitening_layers(shared))
    assert backward_calls == [layers] * (6 * views * accumulate)
    reference = _train(_model(method, shared=False), views=views, accumulate=accumulate)
    assert_states_close(shared.state_dict(), reference.state_dict(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_with_the_shared_node(use_reentrant):
    """A checkpointed forward: its recomputation takes the per-layer Function (the views were used by the original
    forward, or, reentrant, by nothing), and training equals the same checkpointed run with a Function per layer
    (BatchNorm's running statistics see the recomputation in both)."""
    def wrap(model):
        return lambda x: checkpoint(model, x.requires_grad_(True), use_reentrant=use_reentrant)

    checkpointed = _train(_model(), wrap=wrap)
    reference = _train(_model(shared=False), wrap=wrap)
    assert_states_close(checkpointed.state_dict(), reference.state_dict(), rtol=1e-12, atol=1e-14)


def test_views_no_layer_used_are_dropped_and_nothing_is_shared_without_a_backward(backward_calls):
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = wl.models.cifar_resnet(8, width=4).to(DT)

        def forward(self, x, skip=False):
            if skip:  # the first stage's blocks are not called
                return self.net.fc(self.net.layer3(self.net.layer2(self.net.bn1(self.net.conv1(x)).relu())).mean((2, 3)))
            return self.net(x)

    model = wl.convert_model(Skips(), "grad", block_size=2)
    layers = [m for _, m in wl.whitening_layers(model)]
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    with pytest.warns(RuntimeWarning, match="saw no input"):
        for _ in range(2):
            model(x, skip=True).sum().backward()
    assert not coordinator_of(model).scopes  # the scope and its unused views are gone with the forward
    assert backward_calls and all(n < len(layers) for n in backward_calls)  # the unused layers took no gradient
    backward_calls.clear()
    with torch.no_grad():
        model(x)
    model.eval()(x)
    assert not coordinator_of(model).scopes and backward_calls == []


def test_deferred_and_frozen_layers_keep_their_own_path(backward_calls):
    model = _model()
    layers = [m for _, m in wl.whitening_layers(model)]
    layers[0].weight.requires_grad_(False)
    deferral = wl.defer_grad_transform(model)
    model(torch.randn(2, 3, 8, 8, dtype=DT)).sum().backward()
    assert backward_calls == []  # every other layer is deferred: nothing to share
    deferral.remove()
    model(torch.randn(2, 3, 8, 8, dtype=DT)).sum().backward()
    assert backward_calls == [len(layers) - 1]


def test_a_layer_called_twice_shares_its_first_call_only(backward_calls):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False, dtype=DT)
            self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=DT)
            self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False, dtype=DT)
            self.head = nn.Linear(4, 2, dtype=DT)

        def forward(self, x):
            x = self.stem(x).relu()
            return self.head(self.b(self.a(self.b(self.a(x).relu()).relu()).relu()).mean((2, 3)))

    def run(shared):
        torch.manual_seed(0)
        model = wl.convert_model(Twice(), "grad", block_size=2, targets="all")
        return _train(model if shared else layers_alone(model), steps=5)

    a = run(True)
    assert backward_calls == [2] * 5
    assert_states_close(a.state_dict(), run(False).state_dict(), rtol=1e-12, atol=1e-14)
