"""``DirectWhitenWrapper`` computes ``layer(whiten(x))`` as ``layer(x - mu)`` with the weight ``W T`` (issue 48):
the same outputs, gradients and statistics as whitening the input, to rounding."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_utils import assert_states_close
from torch import nn

import whitenlayers as wl
from whitenlayers.convert import DirectWhitenWrapper

DT = torch.float64


def _wrapper(layer, seed=0):
    """A wrapper around ``layer`` whose DirectWhiten has a non-trivial ``T`` and ``mu`` (a fold after a skewed
    batch with a large mean)."""
    torch.manual_seed(seed)
    m = layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels
    wrapper = DirectWhitenWrapper(wl.DirectWhiten(m, block_size=1, dtype=DT), layer)
    mix = torch.randn(m, m, dtype=DT)
    shape = (16, m) if isinstance(layer, nn.Linear) else (8, m) + (5,) * (layer.weight.dim() - 2)
    x = torch.randn(shape, dtype=DT)
    x = torch.movedim(torch.movedim(x, 1, -1) @ mix, -1, 1) + 3.0
    with torch.no_grad():
        wrapper.whiten(x)  # one block: T and mu in force
    assert not torch.allclose(wrapper.whiten.whitening_matrix, torch.eye(m, dtype=DT))
    wrapper.whiten.config = dataclasses.replace(wrapper.whiten.config, block_size=100)  # no fold in the test
    return wrapper, x


def _unfused(wrapper):
    """Calls the two modules in turn: a hook on the layer (that does nothing) keeps the wrapper from fusing."""
    return wrapper.layer.register_forward_hook(lambda mod, inputs, output: None)


def _step(wrapper, x):
    x = x.clone().requires_grad_(True)
    out = wrapper(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in wrapper.named_parameters()}
    wrapper.zero_grad()
    return out.detach(), x.grad, grads, wrapper.whiten.block_statistics()


CONVS = [
    lambda: nn.Conv2d(4, 6, 3, padding=1, dtype=DT),
    lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, stride=2, bias=False, dtype=DT),
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect", dtype=DT),
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular", bias=False, dtype=DT),
    lambda: nn.Conv2d(4, 6, 1, dtype=DT),
    lambda: nn.Conv1d(4, 6, 3, padding=1, dtype=DT),
    lambda: nn.Conv3d(4, 6, 3, padding=1, padding_mode="replicate", dtype=DT),
    lambda: nn.Linear(4, 6, dtype=DT),
]


@settings(max_examples=24, deadline=None)
@given(which=st.integers(0, len(CONVS) - 1), seed=st.integers(0, 2**16), channels_last=st.booleans(),
       training=st.booleans())
def test_fused_wrapper_equals_whitening_the_input(which, seed, channels_last, training):
    """Outputs, input and weight gradients, and the block statistics gathered: those of ``layer(whiten(x))``, in
    float64 to rounding, for every padding mode, strides, dilations, 1-D/2-D/3-D convolutions and linear layers."""
    wrapper, x = _wrapper(CONVS[which](), seed)
    if channels_last and x.dim() == 4:
        wrapper = wrapper.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    wrapper.train(training)
    fused = _step(wrapper, x)
    handle = _unfused(wrapper)
    wrapper.whiten.discard_block()  # the same block for both
    plain = _step(wrapper, x)
    handle.remove()
    for a, b in zip(fused[:2], plain[:2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-10, atol=1e-9, msg=name)
    if training:
        torch.testing.assert_close(fused[3].scatter, plain[3].scatter, rtol=1e-12, atol=1e-9)


def test_a_linear_layer_on_rows_of_a_3d_input_is_fused_too():
    wrapper, _ = _wrapper(nn.Linear(4, 3, dtype=DT))
    x = torch.randn(2, 5, 4, dtype=DT) + 1
    fused = wrapper(x)
    handle = _unfused(wrapper)
    torch.testing.assert_close(fused, wrapper(x), rtol=1e-12, atol=1e-12)
    handle.remove()


def test_hooks_on_either_module_see_their_calls():
    """A hook on the DirectWhiten or on the layer (diagnostics, user code) sees the modules called in turn."""
    wrapper, x = _wrapper(nn.Conv2d(4, 6, 3, padding=1, dtype=DT))
    seen = []
    for module in (wrapper.whiten, wrapper.layer):
        handle = module.register_forward_hook(lambda mod, i, o: seen.append(type(mod).__name__))
        wrapper(x)
        handle.remove()
    assert seen == ["DirectWhiten", "Conv2d"]
    assert wrapper._fusable()


def test_fused_wrapper_under_bf16_autocast_keeps_the_weight_product_in_float32():
    """Under autocast the product ``W T`` is made in the weight's dtype (not bf16) and the output is close to the
    whitened input's (bf16 rounding)."""
    wrapper, x = _wrapper(nn.Conv2d(4, 6, 3, padding=1, dtype=torch.float32))
    wrapper = wrapper.float()
    x = x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = wrapper(x)
        handle = _unfused(wrapper)
        plain = wrapper(x)
        handle.remove()
    assert fused.dtype == plain.dtype == torch.bfloat16
    fused, plain = fused.detach().float(), plain.detach().float()
    torch.testing.assert_close(fused, plain, rtol=0.05, atol=0.05 * float(plain.abs().max()))


def test_a_converted_direct_model_trains_as_whitening_its_inputs():
    """A whole converted ResNet (direct, block 2): five steps with the fused wrappers and with hooks that make
    every wrapper call its two modules: the same state, float64."""
    def run(fused):
        torch.manual_seed(0)
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4).double(), "direct", block_size=2)
        handles = [] if fused else [m.layer.register_forward_hook(lambda mod, i, o: None)
                                    for m in model.modules() if isinstance(m, DirectWhitenWrapper)]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(4, 3, 8, 8, generator=gen, dtype=DT) + 1
            opt.zero_grad()
            model(x).logsumexp(1).mean().backward()
            opt.step()
        for h in handles:
            h.remove()
        return model.state_dict()

    assert_states_close(run(True), run(False), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("groups", [2])
def test_a_grouped_whitening_is_not_fused(groups):
    layer = nn.Conv2d(4, 4, 3, padding=1, groups=groups, dtype=DT)
    wrapper = DirectWhitenWrapper(wl.DirectWhiten(4, groups=groups, dtype=DT), layer)
    assert not wrapper._fusable()
