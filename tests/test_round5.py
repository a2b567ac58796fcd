"""Issue 74, round five: a hook added after conversion, the direct model's plain checkpoint, exit with a fold in
flight."""
import copy
import re

import pytest
import torch
from torch import nn

import whitenlayers as wl
from whitenlayers import models

F64 = torch.float64


def cifar_resnet(seed):
    torch.manual_seed(seed)
    return models.cifar_resnet(8, width=4).to(F64)


def train_steps(model, steps, seed=1):
    """A few SGD steps on correlated, offset data (float64)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        base = torch.randn(8, 1, 16, 16, generator=g, dtype=F64)
        x = base + 0.3 * torch.randn(8, 3, 16, 16, generator=g, dtype=F64) + 2.0
        y = torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def inputs(seed=5):
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=F64) + 2.0


# --------------------------------------------------------------------------
# The direct model's plain checkpoint: what plain_state_dict's error message says to do
# --------------------------------------------------------------------------
def test_the_direct_plain_checkpoint_loads_back_as_the_message_says():
    model = wl.convert_model(cifar_resnet(0), method="direct", block_size=1)
    train_steps(model, 3)
    model.eval()
    x = inputs()
    want = model(x)
    with pytest.raises(ValueError, match="padded direct conv") as err:
        wl.plain_state_dict(model)
    message = str(err.value)
    assert "plain_state_dict(model, strict=False)" in message and "wl.load_plain_state_dict" in message
    sd = wl.plain_state_dict(model, strict=False)
    assert any(re.search(r"\.conv1\.0\.weight$", k) for k in sd)  # the padded 3x3 convs' 1x1 whitening convs
    other = wl.convert_model(cifar_resnet(1), method="direct")
    assert wl.load_plain_state_dict(other, sd) == ([], [])
    # T (x - mu) with mu = -T^-1 b from the 1x1 conv's bias (a float64 solve): the measured gap is ~1e-15
    torch.testing.assert_close(other.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)
    # and the export of the loaded model is the checkpoint's function again
    again = wl.plain_state_dict(other, strict=False)
    assert set(again) == set(sd)
    exported = wl.to_plain_model(copy.deepcopy(other))
    torch.testing.assert_close(exported.eval()(x), want, rtol=0, atol=1000 * torch.finfo(F64).eps)
    # training goes on from there: the next fold takes the new statistics
    train_steps(other, 2)
    assert all(torch.isfinite(p).all() for p in other.parameters())
