"""Tests of the runner's configuration (whitenlayers.experiment.config).

Covered: option resolution and presets, the whitening flags derived from the
layers' config dataclasses (one per field, help from the field metadata,
defaults per method, validation naming the argument), ``--layer-kw``, the
runner reaching every layer option of every method, the ``config.json``
record and the resume fingerprint, and ``--help``.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from whitenlayers import experiment as ex
from whitenlayers import models as wl_models
from whitenlayers.config import EVDConfig, RecursiveConfig
from whitenlayers.convert import whitening_layers
from whitenlayers.experiment.config import METHOD_REGISTRY, RunConfig, fingerprint
from whitenlayers.experiment.data import load_synthetic
from whitenlayers.experiment.engine import Run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _cfg(*argv):
    return ex.resolve_config(ex.build_parser().parse_args(list(argv)))


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------
def test_defaults_and_presets():
    cfg = _cfg()
    assert cfg.dataset == "mnist5k" and cfg.methods == ["baseline", "grad", "recursive"]
    assert cfg.seeds == [0, 1, 2] and cfg.milestones == [cfg.epochs // 2, 3 * cfg.epochs // 4]
    assert (cfg.model, cfg.width, cfg.whitening) == ("resnet20", 8, {"block_size": 2})  # the short default run
    assert cfg.downsample == 2 and _cfg("--dataset", "digits").downsample == 1  # mnist5k's digits at 14x14
    c10 = _cfg("--dataset", "cifar10")
    assert (c10.width, c10.whitening, c10.augment, c10.seeds, c10.downsample) == (16, {}, "auto", [0], 1)
    assert _cfg("--quick").seeds == [0]
    cifar = _cfg("--preset", "paper-cifar")
    assert (cifar.dataset, cifar.model, cifar.epochs, cifar.batch_size) == ("cifar100", "resnet110", 200, 128)
    assert (cifar.lr, cifar.momentum, cifar.weight_decay, cifar.milestones) == (0.1, 0.9, 5e-4, [100, 150])
    assert cifar.augment == "crop-flip" and cifar.whitening == {}  # the layers' (paper) defaults
    assert ex.layer_kwargs(cifar, "grad") == {} and ex.layer_kwargs(cifar, "recursive") == {}
    imnet = _cfg("--preset", "paper-imagenet", "--dataset", "imagefolder:/x")
    assert (imnet.model, imnet.epochs, imnet.milestones, imnet.weight_decay) == ("resnet50", 90, [30, 60], 1e-4)
    assert _cfg("--preset", "paper-cifar", "--epochs", "3", "--quick").epochs == 3  # explicit beats quick and preset
    with pytest.raises(ValueError, match="imagefolder"):
        _cfg("--preset", "paper-imagenet")
    # a preset on a small dataset keeps the layers' block size; an explicit one merges with the automatic values
    assert _cfg("--preset", "paper-cifar", "--dataset", "synthetic").whitening == {}
    assert _cfg("--alpha", "0.5").whitening == {"block_size": 2, "alpha": 0.5}
    assert _cfg("--preset", "paper-cifar", "--alpha", "0.5").whitening == {"alpha": 0.5}
    # GPU switches default off
    assert (cfg.amp, cfg.compile, cfg.channels_last) == ("none", False, False)
    assert _cfg("--amp", "bf16", "--compile", "--channels-last").amp == "bf16"


def test_fold_async_reaches_the_whitening_conversions_only():
    cfg = _cfg("--fold-async", "--block-size", "3", "--methods", "baseline,grad,recursive,kfac")
    assert cfg.fold_async and not _cfg().fold_async
    assert ex.method_kwargs(cfg, "grad") == {"block_size": 3, "fold_async": True}
    assert ex.method_kwargs(cfg, "recursive") == {"block_size": 3, "fold_async": True}
    assert ex.method_kwargs(cfg, "baseline") == {} and ex.method_kwargs(cfg, "kfac") == {}
    assert ex.layer_kwargs(cfg, "grad") == {"block_size": 3}  # the layers' options, validated by their config
    assert ex.method_kwargs(_cfg("--block-size", "3"), "grad") == {"block_size": 3}
    model = ex.METHOD_REGISTRY["grad"].apply(wl_models.cifar_resnet(8, width=4), ex.method_kwargs(cfg, "grad"))
    assert any(getattr(h, "fold_async", False) for h in model._forward_hooks.values())


def test_whitening_options_and_errors():
    cfg = _cfg("--block-size", "3", "--beta", "0.5", "--layer-kw", "recursive.alpha=0.2", "--seeds", "0-2")
    assert cfg.seeds == [0, 1, 2]
    assert ex.layer_kwargs(cfg, "grad") == {"block_size": 3, "beta": 0.5}
    assert ex.layer_kwargs(cfg, "direct") == {"block_size": 3}  # DirectWhiten takes no beta
    assert ex.layer_kwargs(cfg, "recursive") == {"block_size": 3, "beta": 0.5, "alpha": 0.2}
    assert ex.layer_kwargs(cfg, "baseline") == {}
    for bad, match in ((["--alpha", "1.5"], "alpha"), (["--methods", "grad,foo"], "foo"), (["--model", "resnet21"], "6n"),
                       (["--layer-kw", "direct.beta=0.1"], "direct"), (["--stats-fraction", "0"], "stats_fraction"),
                       (["--gains", "pca"], "gains"), (["--layer-kw", "recursive.gamma=0"],
                        r"recursive layers: RecursiveConfig \(method 'recursive'\): gamma \(leakage"),
                       (["--layer-kw", "grad.block_size=2.5"], "block_size"), (["--layer-kw", "baseline.alpha=0.1"],
                                                                               "method must be one of"),
                       (["--layer-kw", "grad-alpha=0.1"], "METHOD.KEY=VALUE")):
        with pytest.raises(ValueError, match=match):
            _cfg(*bad)


def test_whitening_flags_are_derived_from_the_config_dataclasses():
    parser = ex.build_parser()
    actions = {a.dest: a for a in parser._actions}
    fields = {f.name: f for cls in (EVDConfig, RecursiveConfig) for f in dataclasses.fields(cls)
              if f.name != "accumulation_steps"}  # the runner trains without gradient accumulation
    assert set(ex.WHITEN_FIELDS) == set(fields)  # a flag per field, stats_fraction included
    for name, f in fields.items():
        assert "--" + name.replace("_", "-") in actions[name].option_strings
        assert f.metadata["help"].replace("%", "%%") in actions[name].help
    # the per-method defaults come from the dataclasses
    assert "grad, direct, grad-patch 0.9; recursive 0.1" in actions["alpha"].help
    assert "valid: in [0, 1)" in actions["alpha"].help and "the paper's g_max" in actions["gmax"].help
    assert f"{RecursiveConfig.gamma:g}" in actions["gamma"].help
    assert "10" in actions["block_size"].help and "2 for mnist5k" in actions["block_size"].help
    # the methods' layer options: the config fields, less beta for direct
    runner = lambda names, *more: tuple(n for n in names if n not in ("accumulation_steps",) + more)  # noqa: E731
    assert METHOD_REGISTRY["grad"].option_names == runner(EVDConfig.field_names())
    assert METHOD_REGISTRY["recursive"].option_names == runner(RecursiveConfig.field_names())
    assert METHOD_REGISTRY["direct"].option_names == runner(EVDConfig.field_names(), "beta")
    assert METHOD_REGISTRY["grad-patch"].option_names == runner(EVDConfig.field_names())
    assert METHOD_REGISTRY["baseline"].option_names == ()


#: A valid value, away from every method's default, for each whitening option.
EVERY_OPTION = dict(block_size=3, alpha=0.5, eps=1e-4, stats_fraction=0.5, stats_every=2, beta=0.3, gmax=5.0, gains="zca",
                    gamma=0.9, delta=0.5, c_rel=0.05, c_abs=1e-5)


def test_runner_sets_every_layer_option(tmp_path):
    assert set(EVERY_OPTION) == set(ex.WHITEN_FIELDS)  # a new option must be added here
    argv = ["--quick", "--dataset", "synthetic", "--methods", "grad,recursive,direct", "--out", str(tmp_path)]
    for name, value in EVERY_OPTION.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    argv += ["--layer-kw", "recursive.alpha=0.2", "--layer-kw", "direct.eps=0.001"]
    cfg = _cfg(*argv)
    bundle = load_synthetic()
    ctx = ex.Context("cpu", 1)
    try:
        for method in cfg.methods:
            expected = {k: EVERY_OPTION[k] for k in METHOD_REGISTRY[method].option_names}
            expected.update({"recursive": {"alpha": 0.2}, "direct": {"eps": 0.001}}.get(method, {}))
            layers = whitening_layers(Run(cfg, bundle, method, 0, ctx).model)
            assert len(layers) == 6
            for name, layer in layers:
                for key, value in expected.items():
                    assert getattr(layer, key) == value, (method, name, key)
    finally:
        ctx.close()


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------
def test_record_round_trip_and_fingerprint():
    cfg = _cfg("--quick", "--beta", "0.5", "--layer-kw", "recursive.alpha=0.2")
    record = cfg.to_record()
    assert record["block_size"] == 2 and record["beta"] == 0.5 and record["gamma"] is None  # flat, as before
    assert record["layer_kw"] == {"recursive": {"alpha": 0.2}} and record["seeds"] == [0]
    assert RunConfig.from_record(dict(record, git="abc", world_size=1)) == cfg
    # a fingerprint written before --amp/--compile/--channels-last/--stats-fraction existed still matches
    old = {k: v for k, v in fingerprint(record).items()}
    old.update(alpha=None, gamma=None, delta=None)
    assert fingerprint(old) == fingerprint(record)
    assert fingerprint(_cfg("--quick", "--beta", "0.5", "--layer-kw", "recursive.alpha=0.2",
                            "--amp", "bf16").to_record()) != fingerprint(record)
    assert "epochs" not in fingerprint(record) and "epochs" in fingerprint(dict(record, schedule="cosine"))


def test_direct_construction_resolves_and_validates():
    cfg = RunConfig(dataset="synthetic", methods="grad,direct", epochs=8)
    assert cfg.methods == ["grad", "direct"] and cfg.milestones == [4, 6] and cfg.width == 8
    assert cfg.out == os.path.join("runs", "synthetic-resnet20")
    with pytest.raises(ValueError, match="lr"):
        RunConfig(lr=0.0)
    with pytest.raises(ValueError, match="unknown whitening option"):
        RunConfig(whitening={"foo": 1})


def test_help_documents_options_and_torchrun():
    out = subprocess.run([sys.executable, "-m", "whitenlayers.experiment", "--help"], capture_output=True, text=True,
                         env=_env(), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    for word in ("--methods", "--dataset", "--preset", "--resume", "--block-size", "--seeds", "--device",
                 "--nnodes", "--rdzv_endpoint", "--master_addr", "--stats-fraction", "--amp", "--compile",
                 "--channels-last"):
        assert word in out.stdout
    text = " ".join(out.stdout.split())
    assert "six-panel figure" in text and "checkpoints/" in text  # plot_metrics draws a 2 x 3 grid


def test_step_options_validate_and_enter_the_fingerprint():
    cfg = _cfg("--quick", "--eval-every-steps", "5", "--stop-acc", "85", "--max-steps", "40", "--schedule", "linear")
    assert (cfg.eval_every_steps, cfg.stop_acc, cfg.max_steps) == (5, 85.0, 40)
    base = _cfg("--quick")
    assert (base.eval_every_steps, base.stop_acc, base.max_steps) == (0, None, None)  # off unless given
    fp = fingerprint(cfg.to_record())
    assert fp["max_steps"] == 40 and fp["stop_acc"] == 85.0 and "epochs" not in fp  # the budget, not --epochs
    assert "eval_every_steps" not in fp  # evaluating more often trains the same model
    assert "max_steps" not in fingerprint(base.to_record())  # checkpoints made before the options still resume
    for bad, match in ((["--eval-every-steps", "-1"], "eval-every-steps"), (["--max-steps", "0"], "max-steps"),
                       (["--max-steps", "10"], "schedule linear or constant"),  # the default step schedule
                       (["--stop-acc", "0"], "stop-acc"), (["--stop-acc", "101"], "stop-acc"),
                       (["--precise-bn", "-1"], "precise-bn")):
        with pytest.raises(ValueError, match=match):
            _cfg(*bad)
