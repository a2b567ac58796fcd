"""Where a converted model meets quantization (torch.ao) and differential privacy (Opacus): refused, at the step that
would otherwise go on silently, with an error that names the layer and says what to do."""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import whitenlayers as wl
from whitenlayers import models

quantization = pytest.importorskip("torch.ao.quantization")
# These tests use torch.ao.quantization's eager API and Opacus on purpose (to show what a converted model does with
# them): their own warnings (the API's deprecation, its observers' and quantized tensors' notices, Opacus' insecure
# RNG for experiments) are not what is tested.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max to specify the range:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor, torch.quantize_per_channel and other:UserWarning"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning"),
]
METHODS = ["grad", "recursive", "direct"]


def _net(method):
    torch.manual_seed(0)
    return wl.convert_model(models.cifar_resnet(8, width=4), method, block_size=2)


@pytest.mark.parametrize("method", METHODS)
def test_eager_prepare_qat_is_refused_naming_the_layer(method):
    model = _net(method)
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    with pytest.raises(ValueError, match=r"'layer1\.0\.conv1.*'.*no quantized form.*to_plain_model"):
        quantization.prepare_qat(model)


def test_eager_prepare_for_calibration_is_refused():
    model = _net("grad").eval()
    model.qconfig = quantization.get_default_qconfig("fbgemm")
    with pytest.raises(ValueError, match="no quantized form"):
        quantization.prepare(model)


def test_layers_kept_in_float_on_purpose_get_a_clear_error_for_a_quantized_input():
    """qconfig = None on the whitening layers is the user's choice (they stay float); a quantized tensor reaching
    one then fails with the layer's name and the stubs to add, not a dtype mismatch deep inside."""
    model = _net("grad")
    for _, layer in wl.whitening_layers(model):
        layer.qconfig = None
        assert layer.qconfig is None
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    model = quantization.prepare_qat(model)  # accepted: the whitening layers stay in float
    assert "weight_fake_quant" in model.conv1._modules  # the plain stem is prepared as usual
    layer = model.layer1[0].conv1
    assert not hasattr(layer, "weight_fake_quant")
    x = torch.quantize_per_tensor(torch.rand(2, 4, 8, 8), 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match=r"'layer1\.0\.conv1'.*quantized.*DeQuantStub"):
        layer(x)


def test_a_whitening_layer_without_a_qconfig_reads_as_unset():
    layer = wl.GradWhitenConv2d(4, 4, 3)
    assert not hasattr(layer, "qconfig")
    assert getattr(layer, "qconfig", "parent") == "parent"  # what propagate_qconfig_ reads
    copy.deepcopy(layer)
    layer.qconfig = None
    assert copy.deepcopy(layer).qconfig is None


def test_fx_symbolic_tracing_says_what_to_do():
    model = _net("grad")
    with pytest.raises(TypeError, match=r"torch\.fx symbolic tracing.*to_plain_model.*is_leaf_module"):
        torch.fx.symbolic_trace(model)


def test_fx_tracing_with_the_layers_as_leaves_works():
    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, (wl.WhiteningLayer, wl.DirectWhitenWrapper)) or super().is_leaf_module(m, name)

    model = _net("grad").eval()
    graph = torch.fx.GraphModule(model, Leaves().trace(model))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(graph(x), model(x))


def test_convert_model_refuses_a_model_prepared_for_qat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    model = quantization.prepare_qat(model)
    assert "weight_fake_quant" in model[0]._modules
    with pytest.raises(ValueError, match=r"convert_model: '0'.*prepared for quantization"):
        wl.convert_model(model, "grad", targets="all", include_stem=True, include_classifier=True)


# ----------------------------------------------------------------------------------------------------- Opacus
@pytest.mark.parametrize("method", METHODS)
def test_opacus_validator_flags_every_method(method):
    opacus = pytest.importorskip("opacus")
    from opacus.validators import ModuleValidator

    model = _net(method)
    errors = ModuleValidator.validate(model, strict=False)
    ours = [e for e in errors if "un-noised statistics" in str(e)]
    assert len(ours) == len(wl.whitening_layers(model))
    assert "layer1.0.conv1" in str(ours[0]) and "to_plain_model" in str(ours[0])
    engine = opacus.PrivacyEngine()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8),
                                                                      torch.zeros(8, dtype=torch.long)), batch_size=4)
    with pytest.raises(Exception, match="un-noised statistics"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
                            noise_multiplier=1.0, max_grad_norm=1.0)


def test_opacus_validator_keeps_plain_models_and_copies():
    pytest.importorskip("opacus")
    from opacus.validators import ModuleValidator

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.LazyLinear(2))
    assert ModuleValidator.validate(plain, strict=False) == []
    direct = _net("direct")
    flagged = [e for e in ModuleValidator.validate(copy.deepcopy(direct), strict=False) if "un-noised" in str(e)]
    assert len(flagged) == len(wl.whitening_layers(direct))
    exported = wl.to_plain_model(copy.deepcopy(direct))
    assert not [e for e in ModuleValidator.validate(exported, strict=False) if "un-noised statistics" in str(e)]


@pytest.mark.slow  # 5-7 CPU s each (measured at load 16): a fresh interpreter importing torch and opacus
@pytest.mark.parametrize("first", ["whitenlayers", "opacus"])
def test_opacus_checks_are_registered_whatever_is_imported_first(first):
    pytest.importorskip("opacus")
    order = ["import whitenlayers as wl", "import opacus.validators"]
    code = "\n".join(order if first == "whitenlayers" else order[::-1]) + textwrap.dedent("""
        from opacus.validators import ModuleValidator
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4), "direct")
        errors = ModuleValidator.validate(model, strict=False)
        print(sum("un-noised statistics" in str(e) for e in errors), len(wl.whitening_layers(model)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found, layers = out.stdout.split()
    assert found == layers and int(layers) > 0


@pytest.mark.slow  # 5.0 CPU s (measured at load 16): a fresh interpreter importing torch and opacus
def test_opacus_imported_after_conversion_needs_the_documented_call():
    """No import hook: a model converted before Opacus is first imported is checked once
    ``register_opacus_validators()`` is called (what the privacy docs say to do), and no ``sys.meta_path`` finder
    of the library's is installed."""
    pytest.importorskip("opacus")
    code = textwrap.dedent("""
        import sys
        import whitenlayers as wl
        assert not any(type(f).__module__.startswith("whitenlayers") for f in sys.meta_path)
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4), "grad")
        from opacus.validators import ModuleValidator
        before = sum("un-noised statistics" in str(e) for e in ModuleValidator.validate(model, strict=False))
        wl.privacy.register_opacus_validators()
        after = sum("un-noised statistics" in str(e) for e in ModuleValidator.validate(model, strict=False))
        print(before, after, len(wl.whitening_layers(model)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after, layers = map(int, out.stdout.split())
    assert before == 0 and after == layers > 0
