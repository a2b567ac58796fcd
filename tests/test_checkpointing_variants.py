"""Activation checkpointing variants over a converted model's blocks (issue 74): selective checkpointing that saves
the convolutions' outputs, and ``torch.compile`` of a root whose forward checkpoints its blocks."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn
import torch.utils.checkpoint as checkpointing
from torch.utils.checkpoint import checkpoint
from torch_versions import SELECTIVE_CHECKPOINTING

import whitenlayers as wl

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
STAGES = ("layer1", "layer2", "layer3")
#: Compiled against eager, float64: the compiled graph sums a batch's statistics about the shift tensor, eager may
#: not, and AOTAutograd orders some sums apart; over 7 SGD steps and 2 folds that measured up to 33 epsilons of a
#: tensor's largest entry (grad: a whitening matrix; direct: 14, a BatchNorm bias). A statistic counted twice (a
#: recomputation counted as a batch) is off by ~100%, ~1e13 times more.
N_EPS_COMPILED = 128


def _save_convolutions(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: the convolutions' outputs kept, everything else recomputed."""
    if op is torch.ops.aten.convolution.default:
        return checkpointing.CheckpointPolicy.MUST_SAVE
    return checkpointing.CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant ``torch.utils.checkpoint``, selective (``policy``) or not."""

    def __init__(self, inner: nn.Module, policy=None):
        super().__init__()
        self.inner, self.policy = inner, policy

    def forward(self, x):
        if self.policy is None:
            return checkpoint(self.inner, x, use_reentrant=False)
        return checkpoint(self.inner, x, use_reentrant=False,
                          context_fn=functools.partial(checkpointing.create_selective_checkpoint_contexts, self.policy))


def _resnet(method, checkpointed, policy=None, **kwargs):
    torch.manual_seed(0)
    model = wl.models.cifar_resnet(8, num_classes=5, width=4).double()
    if checkpointed:  # the stages wrapped before the conversion: the root's coordinator sees every layer
        for stage in STAGES:
            setattr(model, stage, Checkpointed(getattr(model, stage), policy))
    return wl.convert_model(model, method=method, block_size=3, **kwargs)


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=gen, dtype=F64) * 2 + 1, torch.randint(0, 5, (8,), generator=gen))
            for _ in range(n)]


def _train(model, data, call=None):
    """SGD over ``data``, calling ``call`` (default: the model; e.g. its compiled form)."""
    call = model if call is None else call
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        Fn.cross_entropy(call(x), y).backward()
        opt.step()


def _named(model, tensors):
    """``{name: tensor}`` of a model's parameters or buffers, the checkpoint wrappers' ``.inner`` left out."""
    return {name.replace(".inner", ""): value for name, value in tensors(model)}


def _whitening_buffers(model):
    """The whitening layers' buffers (BatchNorm's are not: it counts a recomputation, a known PyTorch flaw; so
    ``absorbed_offset``, which follows its running mean, is left out too)."""
    names = {name.replace(".inner", "") for name, _ in wl.whitening_layers(model)}
    return {k: v for k, v in _named(model, nn.Module.named_buffers).items()
            if k.rsplit(".", 1)[0] in names and not k.endswith("absorbed_offset")}


def _assert_trains_alike(model, ref, n_eps):
    """Weights and whitening buffers of ``model`` within ``n_eps`` float64 epsilons (relative to each tensor's
    largest entry) of ``ref``'s; integer counters exactly."""
    ours = {**_named(model, nn.Module.named_parameters), **_whitening_buffers(model)}
    theirs = {**_named(ref, nn.Module.named_parameters), **_whitening_buffers(ref)}
    assert ours.keys() == theirs.keys() and any(key.endswith(".running_mean") for key in ours)
    for key, value in ours.items():
        want = theirs[key]
        tol = n_eps * torch.finfo(F64).eps if want.is_floating_point() else 0.0
        scale = want.abs().max().item() if want.is_floating_point() and want.numel() else 0.0
        torch.testing.assert_close(value, want, rtol=tol, atol=tol * scale, msg=lambda m, key=key: f"{key}: {m}")


# --------------------------------------------------------------------------
# Selective checkpointing that saves the convolutions' outputs
# --------------------------------------------------------------------------
@SELECTIVE_CHECKPOINTING
@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "centred"])
@pytest.mark.parametrize("method", ["grad", "recursive", "direct"])
def test_selective_checkpointing_saving_convolutions_trains_like_no_checkpointing(method, absorb):
    """A layer that centres its own input adds the centring term to its convolution's output: not in place where
    selective checkpointing may have cached that output ("Tensor cached during selective activation checkpoint has
    been mutated", before). The same kernels on the same values as without checkpointing: bit-identical."""
    data = _batches(7)
    ref = _resnet(method, False, absorb_centring=absorb)
    _train(ref, data)
    model = _resnet(method, True, _save_convolutions, absorb_centring=absorb)
    _train(model, data)
    assert all(int(layer.num_blocks) == 2 and layer.batches_in_block == 1 for _, layer in wl.whitening_layers(model))
    _assert_trains_alike(model, ref, n_eps=0)


# --------------------------------------------------------------------------
# torch.compile of a root whose forward checkpoints its blocks
# --------------------------------------------------------------------------
def _compiled_counters(model, data):
    """Train ``model`` compiled at the root (``aot_eager``: dynamo and AOTAutograd, no code generation); dynamo's
    graph count and graph breaks."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    _train(model, data, torch.compile(model, backend="aot_eager"))
    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grad", "direct"])
def test_compiled_root_with_checkpointed_blocks_compiles_them_and_trains_like_eager(method):
    """``checkpoint(block, x, use_reentrant=False)`` for each block, the root compiled: the plain model's graph count
    and no graph break (before: the library's list of a forward's calls, mutated inside the checkpoint's
    higher-order operator, broke the graph: 2 graphs, the blocks eager). The batches and folds counted as in eager,
    and the folds at the blocks' ends wait for the backward, which recomputes the layers' buffer copies from the
    buffers themselves (a fold after the forward failed it: a buffer "modified by an inplace operation")."""
    data = _batches(7)
    torch.manual_seed(0)
    plain = wl.models.cifar_resnet(8, num_classes=5, width=4).double()
    for stage in STAGES:
        setattr(plain, stage, Checkpointed(getattr(plain, stage)))
    plain_graphs, plain_breaks = _compiled_counters(plain, data)
    model = _resnet(method, True)
    graphs, breaks = _compiled_counters(model, data)
    assert (graphs, breaks) == (plain_graphs, plain_breaks) == (1, {})
    assert all(int(layer.num_blocks) == 2 and layer.batches_in_block == 1 for _, layer in wl.whitening_layers(model))
    eager = _resnet(method, True)
    _train(eager, data)
    _assert_trains_alike(model, eager, n_eps=N_EPS_COMPILED)
