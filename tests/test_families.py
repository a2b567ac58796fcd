"""Model families beyond ResNet (issue 14): targets, the conversion report, messages, converting again.

CI has no torchvision, timm or transformers: the models are the stand-ins of
``tests/stand_ins.py`` with the real ones' structure and class names
(MobileNetV2's inverted residual blocks, ResNeXt's grouped bottlenecks, a ViT
with ``nn.Linear`` attention or ``nn.MultiheadAttention``, Hugging Face's
``ResNetBottleNeckLayer``). ``docs/coverage.py`` runs the same checks on every
torchvision model where torchvision is installed.
"""
import copy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as Fn
from torch import nn

import whitenlayers as wl
import stand_ins as testing
from whitenlayers import models

METHODS = ["grad", "recursive", "direct"]
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("single_thread")  # (tests/conftest.py)


FAMILIES = {
    # name: (builder, input size, converted with default targets, converted with targets="all", grouped (all))
    "mobilenet": (lambda: testing.mobilenet_like(width=4), 32, 0, 15, 5),
    "resnext": (lambda: testing.resnext_like(width=4), 32, 16, 16, 4),
    "vit": (lambda: testing.vit_like(), 16, 0, 8, 0),
    "vit-mha": (lambda: testing.vit_like(attention="mha"), 16, 0, 4, 0),
    "hf-resnet": (lambda: testing.hf_resnet_like((1, 1, 1, 1)), 32, 16, 16, 0),
}


def batch(size, seed, b=4):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, 1, size, size, generator=g)
    return base + 0.3 * torch.randn(b, 3, size, size, generator=g) + 1.0, torch.randint(0, 10, (b,), generator=g)


def max_rel_diff(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", METHODS)
def test_family_converts_keeps_function_trains_and_exports_exactly(family, method):
    build, size, n_default, n_all, n_grouped = FAMILIES[family]
    torch.manual_seed(0)
    plain = build()
    assert len(wl.conversion_report(plain).converted) == n_default
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MultiheadAttention of vit-mha is reported (tested below)
        model, report = wl.convert_model(model, method, targets="all", block_size=2, report=True)
    layers = wl.whitening_layers(model)
    assert len(layers) == len(report.converted) == n_all
    assert sum(1 for _, m in layers if m.groups > 1) == n_grouped
    x, y = batch(size, 0)
    plain.eval(), model.eval()
    assert max_rel_diff(model(x), plain(x)) <= 1e-6  # function preserved at conversion
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        xb, yb = batch(size, step + 1)
        opt.zero_grad()
        loss = Fn.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(int(m.num_blocks) == 1 for _, m in layers)  # every converted layer was called and folded
    model.eval()
    ref = model(x)
    exported = wl.to_plain_model(copy.deepcopy(model))
    assert not wl.whitening_layers(exported)
    assert max_rel_diff(exported(x), ref) <= 1e-5


def test_resnext50_standin_converts_all_52_block_convs_by_default():
    model = testing.resnext_like((3, 4, 6, 3), width=4, groups=4, width_per_group=2)
    wl.convert_model(model)
    layers = wl.whitening_layers(model)
    assert len(layers) == 52
    grouped = [n for n, m in layers if m.groups > 1]
    assert len(grouped) == 16 and all(n.endswith("conv2") for n in grouped)
    assert type(model.conv1) is nn.Conv2d and type(model.fc) is nn.Linear


def test_hugging_face_resnet50_standin_converts_52_by_default():
    model = testing.hf_resnet_like((3, 4, 6, 3))
    names = [n for n, _ in wl.whitening_layers(wl.convert_model(model))]
    assert len(names) == 52
    assert sum(n.endswith("shortcut.convolution") for n in names) == 4
    assert "resnet.embedder.embedder.convolution" not in names  # the stem
    basic = wl.convert_model(testing.hf_resnet_like((2, 2, 2, 2), layer_type="basic"))
    assert len(wl.whitening_layers(basic)) == 16 + 3  # ResNetBasicLayer blocks: ResNet-18's layout


def test_include_stem_and_classifier():
    model = testing.mobilenet_like(width=4)
    stem, head = "features.0.0", "classifier.1"
    rep = wl.conversion_report(model, targets="all")
    assert stem not in rep.converted and head not in rep.converted
    assert rep.skipped[stem].startswith("the stem") and rep.skipped[head].startswith("the classifier")
    rep = wl.conversion_report(model, targets="all", include_stem=True, include_classifier=True)
    assert stem in rep.converted and head in rep.converted and len(rep.converted) == 17
    rep = wl.conversion_report(models.resnet20(), include_stem=True, include_classifier=True)  # blocks + both
    assert len(rep.converted) == 20 and {"conv1", "fc"} <= set(rep.converted)
    rep = wl.conversion_report(testing.vit_like(), targets="all", include_linear=False)
    assert rep.converted == [] and "include_linear=False" in rep.skipped["blocks.0.mlp.0"]


def test_report_lists_every_layer_with_a_reason():
    model = testing.vit_like(attention="mha")
    with pytest.warns(UserWarning, match=r"left out 2 layer\(s\).*'blocks\.0\.attn\.attn' \(nn\.MultiheadAttention"):
        _, rep = wl.convert_model(model, targets="all", report=True)
    names = [d.name for d in rep.decisions]
    assert names == ["conv_proj", "blocks.0.attn.attn", "blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.attn.attn",
                     "blocks.1.mlp.0", "blocks.1.mlp.2", "head"]
    assert set(rep.unsupported) == {"blocks.0.attn.attn", "blocks.1.attn.attn"}
    assert all(d.reason for d in rep.decisions if d.status == "skipped")
    assert "4 converted, 4 left out" in str(rep)
    # a second report on the converted model: the converted layers are whitening layers now
    rep2 = wl.conversion_report(model, targets="all")
    assert len(rep2.existing) == 4 and rep2.converted == []


def test_no_word_is_missing_when_nothing_is_converted():
    class Block(nn.Module):  # not a recognised residual block
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

        def forward(self, x):
            return x + self.dw(x)

    model = nn.Sequential(nn.Conv2d(3, 8, 1), Block(), nn.Conv2d(8, 4, 1))
    with pytest.warns(UserWarning) as rec:
        wl.convert_model(model)
    msg = str(rec[0].message)
    assert "no layer to convert" in msg and "not inside a residual block" in msg and "targets='all'" in msg
    assert "nn.Conv2d inside" not in msg  # the old, wrong wording for a depthwise-only model
    wl.convert_model(model, block_types=Block)  # the depthwise conv converts when its block is named
    assert [n for n, _ in wl.whitening_layers(model)] == ["1.dw"]

    with pytest.warns(UserWarning) as rec:
        wl.convert_model(testing.mobilenet_like(width=4), predicate=lambda n, m: False)
    msg = str(rec[0].message)
    assert "the predicate selected none of the 16 layer(s)" in msg and "pass block_types or a predicate" not in msg

    conv1d = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Conv1d(4, 4, 3), nn.ConvTranspose1d(4, 2, 3))
    with pytest.warns(UserWarning) as rec:
        wl.convert_model(conv1d)
    msg = str(rec[0].message)
    assert "transposed convolutions are not supported" in msg and "not inside a residual block" in msg
    with pytest.warns(UserWarning, match="no layer to convert: the model has no nn.Conv1d"):
        wl.convert_model(nn.Sequential(nn.ReLU()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wl.convert_model(conv1d, targets="all", include_stem=True)  # the classifier is the transposed conv
    assert [n for n, _ in wl.whitening_layers(conv1d)] == ["0", "2"]


def test_converting_again_with_other_method_or_arguments_raises():
    model = wl.convert_model(models.resnet20(width=4), method="grad")
    keys = list(model.state_dict())
    with pytest.raises(ValueError, match=r"already converted with method='grad'.*method='recursive'.*to_plain_model"):
        wl.convert_model(model, method="recursive")
    with pytest.raises(ValueError, match=r"block_size=10.*block_size=3.*layer\.config"):
        wl.convert_model(model, block_size=3)
    with pytest.raises(ValueError, match="already converted with method='grad'"):
        wl.convert_model(model, method="direct")
    assert list(model.state_dict()) == keys
    direct = wl.convert_model(models.resnet20(width=4), method="direct", alpha=0.5)
    with pytest.raises(ValueError, match="alpha=0.5"):
        wl.convert_model(direct, method="direct")
    # same method and arguments: converts what is still plain, e.g. more targets
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wl.convert_model(model, targets="all")
    assert len(wl.whitening_layers(model)) == 18
    wl.convert_model(model, include_stem=True, include_classifier=True)
    assert len(wl.whitening_layers(model)) == 20


def test_max_features_leaves_out_impractically_wide_layers():
    """VGG's first classifier layer has 25088 inputs: a 25088 x 25088 whitening state. 'all' caps at 8192."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(),
                          nn.Linear(16, 16), nn.Linear(16, 2))
    rep = wl.conversion_report(model, targets="all", max_features=64)
    assert rep.converted == ["4"] and "128 input features per group exceed max_features=64" in rep.unsupported["2"]
    assert wl.conversion_report(model, targets="all").converted == ["2", "4"]  # default cap 8192
    vggish = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(25088, 2, bias=False), nn.Linear(2, 2))
    rep = wl.conversion_report(vggish, targets="all")
    assert "2" in rep.unsupported and "about 12.6 GB" in rep.unsupported["2"]
    grouped = nn.Sequential(nn.Conv2d(3, 64, 1), nn.Conv2d(64, 64, 3, groups=2), nn.Conv2d(64, 64, 3, groups=64),
                            nn.Conv2d(64, 2, 1))
    assert wl.conversion_report(grouped, targets="all", max_features=16).converted == ["2"]  # per group
    with pytest.raises(ValueError, match="max_features"):
        wl.conversion_report(model, max_features=0)


def test_target_argument_errors():
    model = models.resnet20()
    with pytest.raises(ValueError, match="targets must be one of"):
        wl.convert_model(model, targets="everything")
    with pytest.raises(ValueError, match="predicate decides alone"):
        wl.convert_model(model, targets="all", predicate=lambda n, m: True)
    with pytest.raises(ValueError, match="predicate decides alone"):
        wl.convert_model(model, predicate=lambda n, m: True, include_stem=True)
    with pytest.raises(ValueError, match="block_types only applies"):
        wl.convert_model(model, targets="all", block_types="BasicBlock")
    assert not wl.whitening_layers(model)


class FunctionalAttention(nn.Module):
    """Uses its layers' weights without calling them, as torchvision's Swin ``ShiftedWindowAttention`` does."""

    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q = Fn.linear(x, self.qkv.weight, self.qkv.bias)[..., : x.shape[-1]]
        return x + Fn.linear(q, self.proj.weight, self.proj.bias)


def swin_like():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), FunctionalAttention(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def test_layers_used_without_being_called_are_found():
    # without example_input: converted, and the first fold warns that they saw no input
    model = wl.convert_model(swin_like(), targets="all", block_size=2)
    assert len(wl.whitening_layers(model)) == 3
    with pytest.warns(RuntimeWarning, match=r"2 whitening layer\(s\) saw no input.*'1\.qkv', '1\.proj'"):
        for _ in range(2):
            model(torch.randn(5, 4)).sum().backward()
    # with example_input: left out and reported; the stem and classifier are the first and last layers called
    with pytest.warns(UserWarning, match=r"left out 2 layer\(s\).*'1\.qkv' \(not called as a module"):
        model, rep = wl.convert_model(swin_like(), targets="all", example_input=torch.randn(2, 4), report=True)
    assert rep.converted == ["2"] and rep.skipped["0"].startswith("the stem")
    assert rep.skipped["4"].startswith("the classifier")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(12):
            model(torch.randn(5, 4)).sum().backward()
    # the probe forward changes nothing: training flags and BatchNorm statistics are kept
    net = testing.mobilenet_like(width=4).train()
    before = copy.deepcopy(net.state_dict())
    rep = wl.conversion_report(net, targets="all", example_input=torch.randn(2, 3, 16, 16))
    assert net.training and all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    assert len(rep.converted) == 15


def test_direct_linear_on_token_inputs_whitens_the_last_dim():
    lin = nn.Linear(6, 3)
    model = nn.Sequential(nn.Identity(), lin, nn.Identity())
    wl.convert_model(model, "direct", predicate=lambda n, m: True, include_linear=True, block_size=1)
    x = torch.randn(4, 5, 6) * torch.linspace(0.5, 3, 6) + 1
    y = model(x)  # one fold, on all 20 tokens
    whiten = model[1].whiten
    assert int(whiten.num_blocks) == 1 and y.shape == (4, 5, 3)
    torch.testing.assert_close(whiten.running_mean, x.reshape(-1, 6).mean(0).to(whiten.running_mean.dtype))
    model.eval()
    ref = lin((x - whiten.running_mean) @ whiten.whitening_matrix.t())
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_coverage_script_self_test(tmp_path):
    """docs/coverage.py --self-test runs the coverage checks on the stand-ins and writes the table."""
    out = tmp_path / "COVERAGE.md"
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "coverage.py"), "--self-test", "--quick", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
    text = out.read_text()
    assert "| resnext_like" in text and "pending" in text
    assert "FAIL" not in text


def _coverage_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coverage_script", ROOT / "docs" / "coverage.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["coverage_script"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class _Slow(nn.Module):
    def forward(self, x):
        import time

        time.sleep(30)
        return x


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked processes and /proc")
def test_coverage_isolated_checks_end_at_the_time_limit():
    """--isolate: a check past --timeout is a 'not run' row naming the limit, and the next checks still run."""
    cov = _coverage_module()
    build = lambda: models.resnet20(width=4)
    rows = list(cov.check_isolated("r20", build, (2, 3, 8, 8), [("grad", "blocks"), ("direct", "all")], timeout=120))
    assert [(r.method, r.targets, r.status) for r in rows] == [("grad", "blocks", "ok"), ("direct", "all", "ok")]
    slow = lambda: nn.Sequential(nn.Conv2d(3, 4, 3), _Slow())
    rows = list(cov.check_isolated("slow", slow, (2, 3, 8, 8), [("grad", "all"), ("grad", "blocks")], timeout=1))
    assert [r.targets for r in rows] == ["all", "blocks"]
    assert all(r.status == "not run: over the 1 s time limit" and not r.ok for r in rows)
    assert "not run" in cov.totals(rows)[0]


@pytest.mark.parametrize("method", ["grad", "recursive"])
def test_absorbed_centring_of_grouped_and_conv1d_layers_trains_like_centred(method):
    """Grouped, depthwise and Conv1d layers followed by a BatchNorm absorb their centring like Conv2d ones."""

    class Audio(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 8, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x):  # (B, 3, H, W) -> rows as a sequence
            return self.bn(self.conv(x.flatten(2))).mean(-1)

    def make(absorb):
        torch.manual_seed(0)
        model = nn.ModuleDict({"cnn": testing.mobilenet_like(width=4), "seq": Audio()}).double()
        wl.convert_model(model["cnn"], method, targets="all", block_size=2, absorb_centring=absorb)
        wl.convert_model(model["seq"], method, predicate=lambda n, m: True, block_size=2, absorb_centring=absorb)
        return model

    a, c = make(True), make(False)
    layers = dict(wl.whitening_layers(a["cnn"]))
    assert all(layers[n].centring == "absorbed" for n in layers if n != "features.6.0")  # the head conv feeds ReLU6
    assert sum(1 for m in layers.values() if m.groups > 1 and m.centring == "absorbed") == 5
    assert a["seq"].conv.centring == "absorbed"
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (a, c)]
    for step in range(4):
        x, _ = batch(16, step)
        x = x.double()
        for m, opt in zip((a, c), opts):
            torch.manual_seed(step)  # the same dropout mask
            opt.zero_grad()
            (m["cnn"](x).square().mean() + m["seq"](x).square().mean()).backward()
            opt.step()
    for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=n)
    a.eval(), c.eval()
    x, _ = batch(16, 9)
    torch.testing.assert_close(a["cnn"](x.double()), c["cnn"](x.double()), rtol=1e-9, atol=1e-10)
    exported = wl.to_plain_model(copy.deepcopy(a["cnn"]))
    torch.testing.assert_close(exported(x.double()), a["cnn"](x.double()), rtol=1e-9, atol=1e-10)
