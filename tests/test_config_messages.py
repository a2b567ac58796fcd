"""Issue 75: a hyper-parameter out of its range is an error naming the config, its methods (and the layer or
``convert_model`` call where one raised it) and saying what the parameter is, on one line."""
from __future__ import annotations

import dataclasses

import pytest

import whitenlayers as wl
from whitenlayers.config import EVDConfig, RecursiveConfig, field_range

BAD = {"block_size": 0, "accumulation_steps": 0, "stats_every": 0, "alpha": 1.5, "beta": 1.0, "eps": 0.0,
       "stats_fraction": 1.5, "gmax": 0.5, "gains": "whatever", "gamma": 0.0, "delta": 0.0, "c_rel": -1.0,
       "c_abs": -1.0}


def _message(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


@pytest.mark.parametrize("cls,methods", [(EVDConfig, "methods 'grad' and 'direct'"),
                                         (RecursiveConfig, "method 'recursive'")])
def test_every_field_out_of_range_names_the_config_its_methods_and_what_the_field_is(cls, methods):
    for f in dataclasses.fields(cls):
        value = BAD[f.name]
        text = _message(lambda: cls(**{f.name: value}))  # noqa: B023 (called at once)
        assert text == (f"{cls.__name__} ({methods}): {f.name} ({f.metadata['help']}) must be "
                        f"{field_range(f.name)}, but got {f.name}={value!r}")
        assert "\n" not in text


EVD = "EVDConfig (methods 'grad' and 'direct'): "
RECURSIVE = "RecursiveConfig (method 'recursive'): "


@pytest.mark.parametrize("make,prefix", [
    (lambda: wl.GradWhitenConv2d(3, 4, 3, alpha=1.5), "GradWhitenConv2d: " + EVD + "alpha ("),
    (lambda: wl.DirectWhiten(3, config=EVDConfig(), gmax=0.5), "DirectWhiten: " + EVD + "gmax ("),
    (lambda: wl.RecursiveWhitenLinear(3, 2, gamma=2.0), "RecursiveWhitenLinear: " + RECURSIVE + "gamma ("),
    (lambda: wl.convert_model(wl.models.cifar_resnet(8), method="recursive", alpha=1.5),
     "convert_model(method='recursive'): " + RECURSIVE + "alpha ("),
])
def test_a_layer_or_conversion_names_itself_first(make, prefix):
    text = _message(make)
    assert text.startswith(prefix) and "\n" not in text
