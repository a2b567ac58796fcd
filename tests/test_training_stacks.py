"""A converted model inside the training stacks people combine it with (docs/training.md, the "Works with" table).

Each test is one row of that table: activation checkpointing (both kinds), gradient accumulation, EMA and
weight averaging (``AveragedModel``, ``update_bn``, timm's ``ModelEmaV3``), state-dict consumers that expect
tensors (safetensors, Hugging Face ``save_pretrained`` and its ``Trainer``), Lightning checkpoints, ONNX (both
exporters), ``torch.export``, ``torch.jit``, and FSDP (1 and 2, two gloo ranks). A test whose package is absent
skips; CI installs the ``integrations`` extra (timm needs torchvision, so its test runs by hand in a side venv).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn
from torch.utils.checkpoint import checkpoint

from torch_versions import needs

import whitenlayers as wl

from dist_utils import run_distributed

METHODS = ("grad", "recursive", "direct")
#: torch.jit.trace records the layers' shape checks (channels, a kernel's taps, a 1x1 kernel; BatchNorm's batch
#: size in training mode) as constants: fixed by the layer and the traced input's shape, so its TracerWarnings about
#: them are expected.
TRACED_SHAPE_CHECKS = pytest.mark.filterwarnings(
    "ignore:Converting a tensor to a Python boolean might cause the trace to be incorrect:torch.jit.TracerWarning")
F64 = torch.float64


def resnet(method, seed=0, **kw):
    torch.manual_seed(seed)
    model = wl.models.cifar_resnet(8, num_classes=5, width=4)
    return wl.convert_model(model, method=method, **kw)


def batches(n, size=8, hw=8, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, hw, hw, generator=g, dtype=dtype) * 2 + 1, torch.randint(0, 5, (size,), generator=g))
            for _ in range(n)]


def train(model, data, lr=0.1, keep_grads=False):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    grads = []
    for x, y in data:
        opt.zero_grad()
        Fn.cross_entropy(model(x), y).backward()
        if keep_grads:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def whitening_state(model, skip=("absorbed_offset",)):
    """Every whitening buffer and counter of ``model``, by qualified name (the partial block included); not the
    rule's identity (``whitening_rule``: its config, which the runs compared may set apart, e.g.
    ``accumulation_steps``)."""
    out = {}
    for name, layer in wl.whitening_layers(model):
        name = name.replace(".inner", "")
        for key, value in layer.state_dict().items():
            if key in ("weight", "bias", "whitening_rule") or key in skip:
                continue
            out[f"{name}.{key}"] = value
        for counter in ("transform_failures", "skipped_folds", "nonfinite_blocks", "clamped_steps"):
            out[f"{name}.{counter}"] = torch.tensor(getattr(layer, counter))
    return out


def ulps(ref, n):
    """``n`` units of ``ref``'s dtype (its machine epsilon) relative to ``ref``'s largest entry, as ``assert_close``
    keywords: the tolerance between two code paths that round differently (docs/robustness.md, "What is
    bit-identical"). Normwise: an entry near zero is held to the tensor's scale, not its own. Exact for integers."""
    if not ref.is_floating_point():
        return dict(rtol=0.0, atol=0.0)
    tol = n * torch.finfo(ref.dtype).eps
    return dict(rtol=tol, atol=tol * ref.abs().max().item())


def assert_same(a, b, rtol=0.0, atol=0.0, n_ulps=None):
    """Bit-identical (the default: one code path), or within ``rtol``/``atol``, or within ``ulps(b[k], n_ulps)``."""
    assert a.keys() == b.keys()
    for k in a:
        tol = dict(rtol=rtol, atol=atol) if n_ulps is None else ulps(b[k], n_ulps)
        torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m: f"{k}: {m}")


# --------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint`` (what timm's ``set_grad_checkpointing`` does per stage)."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed(model, reentrant):
    for stage in ("layer1", "layer2", "layer3"):
        setattr(model, stage, Checkpointed(getattr(model, stage), reentrant))
    return model


# Reentrant checkpointing runs each forward first under no_grad, where a centring layer takes the plain conv's
# bias path instead of its training path (conv, then the in-place add of -W mu): another rounding, 1 ulp of a
# conv output, carried through 7 SGD steps (measured on an AMD EPYC, float64: up to 11 ulps of a buffer's largest
# entry, 22 of a gradient's). Allowed: 64 ulps for the whitening state (moments and the eigh-derived transforms
# after 2 folds), 256 for gradients and weights (backward through 8 layers, 7 steps). A statistic counted twice is
# off by ~100%, ~1e13 times these (checked in the test); the counters stay exact.
STATE_ULPS, GRAD_ULPS = 64, 256


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "centred"])
@pytest.mark.parametrize("method", METHODS)
def test_activation_checkpointing_trains_like_the_plain_run(method, absorb, reentrant):
    """The recomputation in backward is not a batch: same counters, buffers, gradients and weights as without
    checkpointing. (BatchNorm's running statistics are left out: BatchNorm counts the recomputation, a known
    PyTorch flaw; ``absorbed_offset`` follows its BatchNorm, so it is left out too.)"""
    data = batches(7, dtype=F64)
    ref = resnet(method, block_size=3, absorb_centring=absorb).double()
    ref_grads = train(ref, data, keep_grads=True)
    model = checkpointed(resnet(method, block_size=3, absorb_centring=absorb).double(), reentrant)
    grads = train(model, data, keep_grads=True)
    assert all(int(layer.num_blocks) == 2 and layer.batches_in_block == 1 for _, layer in wl.whitening_layers(model))
    # non-reentrant: the same kernels in the same order, bit-identical; reentrant: another code path (see STATE_ULPS)
    state_ulps, grad_ulps = (STATE_ULPS, GRAD_ULPS) if reentrant else (None, None)
    state, ref_state = whitening_state(model), whitening_state(ref)
    assert_same(state, ref_state, n_ulps=state_ulps)
    for g, r in zip(grads, ref_grads):
        assert_same({k.replace(".inner", ""): v for k, v in g.items()}, r, n_ulps=grad_ulps)
    params = {k.replace(".inner", ""): v for k, v in model.named_parameters()}
    assert_same(params, dict(ref.named_parameters()), n_ulps=grad_ulps)
    # the tolerance is no blanket: a doubled covariance (statistics gathered twice) fails it loudly
    doubled = {k: 2 * v if k.endswith(".running_cov") else v for k, v in ref_state.items()}
    with pytest.raises(AssertionError, match="running_cov"):
        assert_same(doubled, ref_state, n_ulps=STATE_ULPS)


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_recomputed_forward_uses_the_transform_of_the_original_forward(method):
    """block_size=1, reentrant: the fold at the end of the forward must not reach that batch's backward."""
    layer = wl.GradWhitenConv2d if method == "grad" else wl.RecursiveWhitenConv2d
    torch.manual_seed(0)
    conv = layer(3, 4, 3, padding=1, bias=False, block_size=1, dtype=F64)
    for _ in range(2):  # non-trivial mu and Q_s in force
        conv(torch.randn(6, 3, 5, 5, dtype=F64) * torch.tensor([1.0, 0.2, 3.0], dtype=F64).view(1, 3, 1, 1) + 2)
    x = torch.randn(6, 3, 5, 5, dtype=F64) * 3 + 1
    twin = copy.deepcopy(conv)
    q, mu, c = conv.grad_transform.clone(), conv.running_mean.clone(), conv.bias_correction.clone()
    out = checkpoint(conv, x.requires_grad_(), use_reentrant=True)
    assert int(conv.num_blocks) == 3 and not torch.equal(conv.grad_transform, q)  # folded after the forward
    out.square().sum().backward()
    twin.zero_grad()
    twin(x.detach()).square().sum().backward()  # no checkpointing: the backward of the same forward
    torch.testing.assert_close(conv.weight.grad, twin.weight.grad, rtol=1e-12, atol=1e-12)
    # and that gradient is the centred gradient times the Q_s in force at the forward
    w = conv.weight.detach().clone().requires_grad_()
    Fn.conv2d(Fn.pad(x.detach(), (1, 1, 1, 1)) - mu.view(1, 3, 1, 1), w, c).square().sum().backward()
    torch.testing.assert_close(conv.weight.grad, torch.einsum("oihw,ij->ojhw", w.grad, q), rtol=1e-9, atol=1e-9)
    assert int(conv.num_blocks) == 3  # the recomputation folded nothing


def test_timm_set_grad_checkpointing():
    """timm's own checkpointing of a converted resnet18 (run by hand in a side venv with timm)."""
    timm = pytest.importorskip("timm")

    def make():
        torch.manual_seed(0)
        return wl.convert_model(timm.create_model("resnet18", num_classes=5), method="grad", block_size=2)

    data = batches(3, size=4, hw=32)
    ref = make()
    ref_grads = train(ref, data, lr=0.01, keep_grads=True)
    model = make()
    model.set_grad_checkpointing(True)
    grads = train(model, data, lr=0.01, keep_grads=True)
    assert all(int(layer.num_blocks) == 1 for _, layer in wl.whitening_layers(model))
    assert_same(whitening_state(model), whitening_state(ref), rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        assert_same(g, r, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------
def conv_net(method, seed=0, **kw):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1, bias=False),
                        nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 5))
    return wl.convert_model(net, method=method, targets="all", include_stem=True, **kw).double()


def train_accumulated(model, data, k):
    """SGD steps, each over ``k`` micro-batches of a batch of ``data`` (loss scaled by ``1/k``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(k), y.chunk(k)):
            (Fn.cross_entropy(model(xm), ym) / k).backward()
        opt.step()
    return model


@pytest.mark.parametrize("method", METHODS)
def test_gradient_accumulation_equals_the_big_batch(method):
    """accumulation_steps=k: a block is block_size optimizer steps of k micro-batches each, so folds fall on
    optimizer-step boundaries and the accumulated run is the big-batch run (to float tolerance)."""
    data = batches(6, size=16, dtype=F64)
    big = conv_net(method, block_size=2)
    train(big, data, lr=0.05)
    acc = train_accumulated(conv_net(method, block_size=2, accumulation_steps=4), data, 4)
    assert all(int(layer.num_blocks) == 3 for _, layer in wl.whitening_layers(acc))
    assert_same(whitening_state(acc, skip=("_extra_state",)), whitening_state(big, skip=("_extra_state",)),
                rtol=1e-9, atol=1e-10)
    assert_same(dict(acc.named_parameters()), dict(big.named_parameters()), rtol=1e-9, atol=1e-10)
    # without the setting, blocks count micro-batches and every optimizer step mixes two transforms
    plain = train_accumulated(conv_net(method, block_size=2), data, 4)
    assert all(int(layer.num_blocks) == 12 for _, layer in wl.whitening_layers(plain))


def _ddp_accumulation_worker(rank, world, method):
    import contextlib
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(conv_net(method, block_size=2, accumulation_steps=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(4, size=16, dtype=F64):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's half, in two micro-batches
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                (Fn.cross_entropy(model(xm), ym) / 2).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()
            if not k.endswith(("_extra_state", "whitening_rule"))}  # (the rule's config: accumulation_steps differs)


@pytest.mark.parametrize("method", ["grad", "direct"])
def test_gradient_accumulation_under_ddp_no_sync_equals_the_big_batch(method):
    results = run_distributed(_ddp_accumulation_worker, method)
    big = conv_net(method, block_size=2)
    train(big, batches(4, size=16, dtype=F64), lr=0.05)
    want = {k: v for k, v in big.state_dict().items() if not k.endswith(("_extra_state", "whitening_rule"))}
    assert_same(results[0], results[1])
    assert_same(results[0], want, rtol=1e-9, atol=1e-10)


# --------------------------------------------------------------------------
# State as tensors: EMA, safetensors, old checkpoints
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_state_dict_holds_only_tensors_and_resumes_mid_block(method):
    model = resnet(method, block_size=2)
    train(model, batches(3))
    sd = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    other = resnet(method, seed=5, block_size=2)
    other.load_state_dict({k: v.clone() for k, v in sd.items()})
    more = batches(3, seed=9)
    train(model, more)
    train(other, more)
    assert_same(other.state_dict(), model.state_dict())


def test_safetensors_round_trip_resumes_bit_for_bit(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = resnet("grad", block_size=2)
    train(model, batches(3))
    st.save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    other = resnet("grad", seed=5, block_size=2)
    other.load_state_dict(st.load_file(str(tmp_path / "model.safetensors")))
    more = batches(3, seed=9)
    train(model, more)
    train(other, more)
    assert_same(other.state_dict(), model.state_dict())


def test_version_1_checkpoint_with_dict_extra_state_and_bias_in_the_parameter_is_refused():
    """Version 1 (pre-release: the partial block as a dict, a layer's bias compensation inside its bias parameter):
    an error naming the layer and the version; the layer is left as it was."""
    torch.manual_seed(0)
    layer = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=3)
    for _ in range(4):
        layer(torch.randn(5, 3, 6, 6) + 2)
    sd = layer.state_dict()
    old = {k: v for k, v in sd.items() if k not in ("_extra_state", "bias_correction")}
    old["bias"] = layer.bias.detach() + layer.bias_correction  # where version 1 kept the compensation
    old["_extra_state"] = {"version": 1, "acc_batches": 1}
    old = type(sd)(old)
    old._metadata = {"": {"version": 1}}
    new = wl.GradWhitenConv2d(3, 4, 3, padding=1, block_size=3)
    bias = new.bias.detach().clone()
    with pytest.raises(RuntimeError, match=r"GradWhitenConv2d \(num_features=3\): this checkpoint was written by a "
                                           r"pre-release whitenlayers \(version 1\); it cannot be loaded"):
        new.load_state_dict(old)
    assert torch.equal(new.bias.detach(), bias) and int(new.num_blocks) == 0


def test_torch_ema_and_swa_average_the_whitening_state_like_batchnorm():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = resnet("grad", block_size=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for x, y in batches(4):
        train(model, [(x, y)])
        ema.update_parameters(model)
    layer, bn = ema.module.layer1[0].conv1, ema.module.layer1[0].bn1
    # counters are averaged like BatchNorm's num_batches_tracked (meaningless in an average, unused in eval)
    assert int(layer.num_blocks) == int(bn.num_batches_tracked)
    ema.eval()
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(ema(x), wl.to_plain_model(copy.deepcopy(ema.module))(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("average", ["ema", "swa"])
def test_keep_counters_averages_the_state_and_keeps_num_blocks(average):
    """``AveragedModel(use_buffers=True)`` truncates an averaged ``num_blocks`` (an EMA of a model whose first update
    came before its first fold stays at 0: the averaged layers count as never folded). With
    ``wl.keep_counters`` every integer buffer is the model's, every floating one the same average as without it."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = resnet("grad", block_size=2)
    inner = get_ema_multi_avg_fn(0.9) if average == "ema" else None
    kept = AveragedModel(model, multi_avg_fn=wl.keep_counters(inner), use_buffers=True)
    averaged = AveragedModel(model, multi_avg_fn=inner, use_buffers=True)
    for x, y in batches(6):
        train(model, [(x, y)])
        kept.update_parameters(model)
        averaged.update_parameters(model)
    assert int(model.layer1[0].conv1.num_blocks) == 3
    for (name, k), (_, a), (_, m) in zip(kept.module.state_dict().items(), averaged.module.state_dict().items(),
                                         model.state_dict().items()):
        if k.is_floating_point():
            assert torch.equal(k, a), name  # the same average, the same operations
        else:
            assert torch.equal(k, m), name  # num_blocks, num_batches_tracked: the model's


@pytest.mark.parametrize("method", METHODS)
def test_update_bn_inside_frozen_keeps_the_whitening_state(method):
    """``update_bn`` re-estimates the BatchNorms of an averaged model; inside ``wl.frozen`` the whitening state is
    untouched, and the averaged model then computes what its plain architecture with the same weights computes
    after the same ``update_bn``."""
    from torch.optim.swa_utils import AveragedModel, update_bn
    model = resnet(method, block_size=1)
    swa = AveragedModel(model)
    for x, y in batches(3):
        train(model, [(x, y)])
        swa.update_parameters(model)
    loader = [(x,) for x, _ in batches(3, seed=4)]
    before = {k: v.clone() for k, v in whitening_state(swa.module).items()}
    with wl.frozen(swa):
        update_bn(loader, swa)
    assert_same(whitening_state(swa.module), before)
    assert not any(layer.frozen for _, layer in wl.whitening_layers(swa))
    if method == "direct":  # unfrozen, update_bn would fold: the direct whitening (part of the function) moves
        moved = copy.deepcopy(swa)
        update_bn(loader, moved)
        assert int(wl.whitening_layers(moved)[0][1].num_blocks) > int(before["layer1.0.conv1.whiten.num_blocks"])
        return
    plain = wl.models.cifar_resnet(8, num_classes=5, width=4)
    plain.load_state_dict({k: v for k, v in swa.module.state_dict().items() if k in plain.state_dict()
                           and "running" not in k and "num_batches" not in k}, strict=False)
    update_bn(loader, plain)
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(swa.eval()(x), plain.eval()(x), rtol=1e-4, atol=1e-5)


def test_timm_model_ema():
    """timm's ModelEmaV3 / V2 iterate over state-dict values as tensors (run by hand in a side venv with timm)."""
    timm_utils = pytest.importorskip("timm.utils")
    model = resnet("grad", block_size=1)
    emas = [timm_utils.ModelEmaV3(model, decay=0.9), timm_utils.ModelEmaV2(model, decay=0.9)]
    for step, (x, y) in enumerate(batches(3)):
        train(model, [(x, y)])
        emas[0].update(model, step=step)
        emas[1].update(model)
    x = torch.randn(4, 3, 8, 8)
    for ema in emas:
        out = ema.module.eval()(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, wl.to_plain_model(copy.deepcopy(ema.module))(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Hugging Face and Lightning
# --------------------------------------------------------------------------
def hf_resnet(method="grad", seed=0, **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return wl.convert_model(transformers.ResNetForImageClassification(config), method=method, **kw)


def test_hugging_face_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("safetensors.torch")
    model = hf_resnet(block_size=2)
    assert len(wl.whitening_layers(model)) == 7  # two bottleneck blocks: 3 convs each, one shortcut conv
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(3, size=4, hw=16):
        opt.zero_grad()
        model(pixel_values=x, labels=y % 3).loss.backward()
        opt.step()
    model.save_pretrained(tmp_path / "converted")  # safetensors: every state-dict entry a tensor
    other = hf_resnet(seed=3, block_size=2)
    other.load_state_dict(st.load_file(str(tmp_path / "converted" / "model.safetensors")))
    assert_same(other.state_dict(), model.state_dict())
    # the plain architecture, for inference anywhere: save_pretrained of the plain checkpoint
    model.save_pretrained(tmp_path / "plain", state_dict=wl.plain_state_dict(model))
    plain = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "plain")
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(plain.eval()(pixel_values=x).logits, model.eval()(pixel_values=x).logits,
                               rtol=1e-5, atol=1e-5)


class _Images(torch.utils.data.Dataset):
    def __init__(self, n=12):
        self.data = batches(1, size=n, hw=16, seed=7)[0]

    def __len__(self):
        return len(self.data[1])

    def __getitem__(self, i):
        return {"pixel_values": self.data[0][i], "labels": self.data[1][i] % 3}


@needs((2, 6), "transformers' Trainer resuming from a checkpoint (it refuses torch.load before: CVE-2025-32434)")
def test_hugging_face_trainer_checkpoints_resume_mid_block(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def fit(model, out, steps, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=steps, save_steps=3, report_to=[], use_cpu=True, seed=0,
            per_device_train_batch_size=4, learning_rate=0.05, disable_tqdm=True, dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=_Images()).train(resume_from_checkpoint=resume)
        return model

    straight = fit(hf_resnet(block_size=2), tmp_path / "a", 5)  # its checkpoint at step 3 is mid-block
    resumed = fit(hf_resnet(seed=1, block_size=2), tmp_path / "b", 5, resume=str(tmp_path / "a" / "checkpoint-3"))
    assert all(layer.batches_in_block == 1 for _, layer in wl.whitening_layers(resumed))
    assert_same(whitening_state(resumed), whitening_state(straight), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_grad_norm", [1e9, 0.01], ids=["no-clipping", "clipping"])
def test_hugging_face_trainer_with_the_deferred_transform_trains_like_the_default(tmp_path, max_grad_norm):
    """The Trainer steps Accelerate's ``AcceleratedOptimizer``, a wrapper whose own step runs no optimizer hooks:
    ``defer_grad_transform`` given the wrapper (from a callback) is accepted, and the hooks on the weights transform
    in the backward whatever steps. The Trainer clips by default (``max_grad_norm=1.0``): with a threshold reached
    on every step it clips the transformed gradient, as with the default. Float32, two code paths (the product in
    a hook on the weight or in an autograd node per forward): a few float32 ulps apart."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Defer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            assert not isinstance(optimizer, torch.optim.SGD)  # the wrapper
            self.deferral = wl.defer_grad_transform(model, optimizer)

    def fit(defer):
        model = hf_resnet(block_size=2)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(defer)), max_steps=5, save_strategy="no", report_to=[], use_cpu=True,
            seed=0, per_device_train_batch_size=4, learning_rate=0.05, disable_tqdm=True,
            dataloader_num_workers=0, max_grad_norm=max_grad_norm, logging_steps=1)
        callbacks = [Defer()] if defer else []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Images(), callbacks=callbacks)
        trainer.train()
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]  # before clipping
        assert len(norms) == 5 and all((n > max_grad_norm) == (max_grad_norm < 1) for n in norms), norms
        return model

    default, deferred = fit(False), fit(True)
    assert int(wl.whitening_layers(deferred)[0][1].num_blocks) == 2
    assert_same(dict(deferred.named_parameters()), dict(default.named_parameters()), rtol=1e-5, atol=1e-6)
    assert_same(whitening_state(deferred), whitening_state(default), rtol=1e-5, atol=1e-6)


def test_lightning_checkpoint_resumes_mid_block(tmp_path):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = resnet("grad", block_size=2)

        def training_step(self, batch, _):
            return Fn.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    data = batches(3)
    loader = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*data)])), batch_size=8)

    def trainer(epochs):
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))

    straight = Module()
    trainer(2).fit(straight, loader)
    first = Module()
    t = trainer(1)
    t.fit(first, loader)  # 3 batches, block_size 2: one batch of the second block pending
    t.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = Module()
    trainer(2).fit(resumed, loader, ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert int(wl.whitening_layers(resumed)[0][1].num_blocks) == 3
    assert_same(whitening_state(resumed), whitening_state(straight))


# --------------------------------------------------------------------------
# Export: ONNX, torch.export, torch.jit
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dynamo", [False, pytest.param(True, marks=needs((2, 7), "the dynamo-based ONNX exporter of a "
                                                                              "converted model"))],
                         ids=["torchscript-exporter", "dynamo-exporter"])
def test_onnx_export(tmp_path, monkeypatch, dynamo):
    monkeypatch.chdir(tmp_path)  # (a failing dynamo export writes its report_dynamo_export.sarif into the cwd)
    onnx = pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    model = resnet("grad", block_size=1)
    train(model, batches(2))
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    path = str(tmp_path / "model.onnx")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=dynamo)
    onnx.checker.check_model(onnx.load(path))
    ort = pytest.importorskip("onnxruntime")
    got = ort.InferenceSession(path).run(None, {ort.InferenceSession(path).get_inputs()[0].name: x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-4, atol=1e-5)


@TRACED_SHAPE_CHECKS
# torch before 2.6 says that a training-mode export keeps the package's snapshot operator whole (as it should)
@pytest.mark.filterwarnings("ignore:At pre-dispatch tracing, we will assume:UserWarning")
@pytest.mark.parametrize("method", METHODS)
def test_torch_export_and_jit_trace(method):
    model = resnet(method, block_size=1)
    train(model, batches(2))
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    want = model(x)
    torch.testing.assert_close(torch.export.export(model, (x,), strict=False).module()(x), want)
    with torch.no_grad():  # with autograd on, the trace holds the layers' autograd Functions (PythonOps)
        torch.testing.assert_close(torch.jit.trace(model, (x,))(x), want)


@TRACED_SHAPE_CHECKS
@pytest.mark.parametrize("method", METHODS)
def test_jit_trace_right_after_a_fold(method):
    """Traced under ``no_grad`` in eval mode as the first forward after a fold (the layers' per-block caches
    empty): the trace and its check run record the same graph (no cache filled by the first run), and it matches
    eager."""
    model = resnet(method, block_size=1)
    train(model, batches(2))
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        torch.testing.assert_close(traced(x), model(x))


@TRACED_SHAPE_CHECKS
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_jit_trace_with_autograd_on_says_to_trace_under_no_grad(method, mode):
    model = resnet(method, block_size=1)
    train(model, batches(1))
    model.train(mode == "train")
    first = wl.whitening_layers(model)[0][0]
    with pytest.raises(RuntimeError, match=rf"'{first}'.*torch\.jit\.trace with autograd enabled.*"
                                           r"eval mode under torch\.no_grad\(\)"):
        torch.jit.trace(model, (torch.randn(2, 3, 8, 8),))


def test_jit_script_says_what_to_do_instead():
    model = resnet("grad", block_size=1)
    with pytest.raises(RuntimeError, match=r"GradWhitenConv2d 'layer1.0.conv1'.*torch.jit.script cannot compile.*"
                                           r"to_plain_model"):
        torch.jit.script(model)
    plain = torch.jit.script(wl.to_plain_model(copy.deepcopy(model)).eval())
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(plain(x), model.eval()(x))


# --------------------------------------------------------------------------
# FSDP
# --------------------------------------------------------------------------
def fsdp_net(bias):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=bias), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1, bias=bias),
                        nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=bias), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 4))
    return wl.convert_model(net, method="grad", targets="all", include_stem=True, block_size=2)


def fsdp_data(step, rank=None, world=1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 3, 6, 6, generator=g) * 2 + 1, torch.randint(0, 4, (8,), generator=g)
    if rank is None:
        return x, y
    n = 8 // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def fsdp_train(model, rank=None, world=1, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = fsdp_data(step, rank, world)
        opt.zero_grad()
        Fn.cross_entropy(model(x), y).backward()  # mean over the rank's half: FSDP averages over ranks
        opt.step()


def _fsdp_worker(rank, world, flavour):
    out = {}
    for bias in (True, False):
        model = fsdp_net(bias)
        if flavour == "fsdp1":
            from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
            wrapped = FSDP(model, device_id=torch.device("cpu"))
            fsdp_train(wrapped, rank, world)
            with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
                sd = wrapped.state_dict()
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            reshard = flavour == "fsdp2"
            mesh = init_device_mesh("cpu", (world,))  # without a mesh, fully_shard moves the model to CUDA if any
            for layer in [m for _, m in wl.whitening_layers(model)]:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            fsdp_train(model, rank, world)
            sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        out[bias] = {k: v.detach().clone() for k, v in sd.items() if not k.endswith("_extra_state")}
    return out


def _fsdp_deferral_worker(rank, world, flavour):
    model = fsdp_net(False)
    if flavour == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in [m for _, m in wl.whitening_layers(model)]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        wl.defer_grad_transform(model, opt)
    except ValueError as e:
        return str(e)
    return "not refused"


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2"])
def test_fsdp_refuses_the_deferred_transform_up_front(flavour):
    """FSDP's forward uses a gathered copy of each weight, not the parameter the deferral would hook:
    ``defer_grad_transform`` refuses a sharded model when it is called, naming what shards it (not at the first
    step, nor as a missing optimizer)."""
    results = run_distributed(_fsdp_deferral_worker, flavour)
    for message in results:
        assert "is sharded" in message, message
        assert ("FullyShardedDataParallel" if flavour == "fsdp1" else "fully_shard") in message, message


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["fsdp1", "fsdp2", "fsdp2-no-reshard"])
def test_fsdp_trains_like_one_process(flavour):
    """Two gloo ranks, each half of the batch, folds included: every parameter and whitening buffer equals one
    process on the whole batch (the partial block, local to each rank until the fold, aside)."""
    if flavour == "fsdp1":
        pytest.importorskip("torch.distributed.fsdp")
    results = run_distributed(_fsdp_worker, flavour)
    for bias in (True, False):
        ref = fsdp_net(bias)
        fsdp_train(ref)
        want = {k: v for k, v in ref.state_dict().items() if not k.endswith("_extra_state")}
        assert int(ref[0].num_blocks) == 2
        assert_same(results[0][bias], results[1][bias])  # ranks bit-identical
        assert_same(results[0][bias], want, rtol=1e-5, atol=1e-5)
