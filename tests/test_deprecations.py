"""Moved and renamed public names keep working for one release, with a ``DeprecationWarning``."""
import importlib

import pytest

import whitenlayers as wl


def test_whitenlayers_data_is_an_alias_of_the_runners_data():
    from whitenlayers.experiment import data as new

    old = importlib.import_module("whitenlayers.data")
    with pytest.warns(DeprecationWarning, match="whitenlayers.experiment.data"):
        assert old.load_dataset is new.load_dataset
    with pytest.warns(DeprecationWarning):
        with pytest.raises(AttributeError):
            old.no_such_name  # noqa: B018


@pytest.mark.parametrize("name", ["mobilenet_like", "resnext_like", "vit_like", "hf_resnet_like", "Bottleneck",
                                  "InvertedResidual"])
def test_stand_in_models_moved_to_testing(name):
    with pytest.warns(DeprecationWarning, match=f"whitenlayers.testing.{name}"):
        assert getattr(wl.models, name) is getattr(wl.testing, name)
    with pytest.raises(AttributeError):
        wl.models.no_such_model  # noqa: B018


def test_core_package_does_not_import_the_runner():
    """Importing the layers loads nothing of the experiment runner (its data, IO, report)."""
    import subprocess
    import sys

    code = ("import sys, whitenlayers as wl; wl.convert_model(wl.models.cifar_resnet(8), 'grad'); "
            "print(sorted(m for m in sys.modules if m.startswith('whitenlayers.experiment') or m == 'whitenlayers.data'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("module,old,new", [
    ("whitenlayers", "WhiteningStatistics", "WhiteningLayer"),
    ("whitenlayers", "DirectWhitened", "DirectWhitenWrapper"),
    ("whitenlayers", "export_model", "to_plain_model"),
    ("whitenlayers.stats", "WhiteningStatistics", "WhiteningLayer"),
    ("whitenlayers.layers", "WhiteningStatistics", "WhiteningLayer"),
    ("whitenlayers.convert", "DirectWhitened", "DirectWhitenWrapper"),
    ("whitenlayers.convert", "export_model", "to_plain_model"),
    # where pickles of whole models converted with method="direct" before the rename look the class up
    ("whitenlayers.convert._common", "DirectWhitened", "DirectWhitenWrapper"),
])
def test_renamed_public_names_keep_their_old_name_for_one_release(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is renamed {new}"):
        assert getattr(mod, old) is getattr(wl, new)
    assert old not in wl.__all__ and new in wl.__all__


def test_old_names_still_work_as_before():
    model = wl.convert_model(wl.models.cifar_resnet(8, width=8), method="direct")
    with pytest.warns(DeprecationWarning):
        assert all(isinstance(m, wl.WhiteningStatistics) for _, m in wl.whitening_layers(model))
    with pytest.warns(DeprecationWarning):
        plain = wl.export_model(model.eval())
    assert not wl.whitening_layers(plain)
