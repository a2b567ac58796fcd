"""Renamed names keep working for one release, with a ``FutureWarning`` that names the new one (as torch does)."""
import subprocess
import sys

import pytest
import torch

import whitenlayers as wl


@pytest.mark.parametrize("name,new", [("WhiteningLayer", wl.WhiteningLayer), ("recomputing", wl.layers.recomputing),
                                      ("loading_plain_checkpoint", wl.layers.checkpoint.loading_plain_checkpoint)])
def test_the_stats_subpackage_is_an_alias_of_layers(name, new):
    import whitenlayers.stats as old

    with pytest.warns(FutureWarning, match=f"whitenlayers.stats is renamed whitenlayers.layers \\({name}"):
        assert getattr(old, name) is new
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_eig_failures_is_renamed_transform_failures():
    layer = wl.GradWhitenLinear(3, 2)
    layer.transform_failures = 2
    with pytest.warns(FutureWarning, match="eig_failures is renamed transform_failures"):
        assert layer.eig_failures == 2
    with pytest.warns(FutureWarning, match="eig_failures is renamed transform_failures"):
        layer.eig_failures = 5
    assert layer.transform_failures == 5 and "eig_failures" not in layer.__dict__


def test_method_says_what_convert_model_took_and_rule_name_the_rule():
    for method in ("grad", "recursive", "direct"):
        model = wl.convert_model(wl.models.cifar_resnet(8, width=4), method=method)
        layers = [layer for _, layer in wl.whitening_layers(model)]
        assert {layer.method for layer in layers} == {method}
        assert {layer.rule_name for layer in layers} == {"recursive" if method == "recursive" else "evd"}


def test_rule_fields_only_on_layers_whose_rule_has_them():
    grad, rec = wl.GradWhitenLinear(3, 2), wl.RecursiveWhitenLinear(3, 2)
    assert grad.gmax == 10.0 and not hasattr(grad, "gamma") and "gamma" not in dir(grad) and "gmax" in dir(grad)
    assert rec.gamma == 0.99 and not hasattr(rec, "gmax") and "gamma" in dir(rec)
    rec.gamma = 0.9  # a field: a new config, validated
    assert rec.config.gamma == 0.9
    with pytest.raises(ValueError, match="gamma"):
        rec.gamma = 2.0
    with pytest.raises(AttributeError):
        grad.gamma  # noqa: B018
    assert torch.equal(grad.running_mean, torch.zeros(3))  # buffers and parameters as before


def test_core_package_does_not_import_the_runner():
    """Importing the layers loads nothing of the experiment runner (its data, IO, report)."""
    code = ("import sys, whitenlayers as wl; wl.convert_model(wl.models.cifar_resnet(8), 'grad'); "
            "print(sorted(m for m in sys.modules if m.startswith('whitenlayers.experiment')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
