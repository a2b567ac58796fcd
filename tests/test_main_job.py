"""Issue 75's main job: the small datasets' network, the figure's panels (every band whole, bands in every panel,
the zoom's connectors off the data, the load under the time panels) and the machine in ``config.json``."""
from __future__ import annotations

import importlib.util
import os
import pathlib

import numpy as np
import pytest
import torch

import whitenlayers.experiment as ex
from whitenlayers.experiment import figure as run_figure, report
from whitenlayers.experiment.config import fingerprint
from whitenlayers.experiment.data import load_dataset

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cfg(*argv):
    return ex.resolve_config(ex.build_parser().parse_args(list(argv)))


def test_mnist5k_trains_on_14x14_digits_the_others_as_they_are():
    assert _cfg().downsample == 2 and _cfg("--downsample", "1").downsample == 1
    assert _cfg("--dataset", "digits").downsample == 1 and _cfg("--dataset", "cifar10").downsample == 1
    with pytest.raises(ValueError, match="--downsample must be >= 1"):
        _cfg("--downsample", "0")
    # a checkpoint written before the option resumes at 1, not at the new default
    record = _cfg("--downsample", "1").to_record()
    old = {k: v for k, v in record.items() if k != "downsample"}
    assert fingerprint(old) == fingerprint(record) != fingerprint(_cfg().to_record())


def test_downsampled_bundle_averages_each_block_of_pixels():
    bundle = load_dataset("synthetic")
    pooled = bundle.downsampled(2)
    h, w = bundle.image_size
    assert pooled.image_size == (h // 2, w // 2) and pooled.train.images.shape[-2:] == (h // 2, w // 2)
    x = bundle.train.images[:4]  # float images: the plain mean of each 2x2 block
    n, c = x.shape[:2]
    expected = x.reshape(n, c, h // 2, 2, w // 2, 2).mean(dim=(3, 5))
    torch.testing.assert_close(pooled.train.images[:4], expected)  # another summation order: float32's tolerance
    assert torch.equal(pooled.train.labels, bundle.train.labels) and len(pooled.test) == len(bundle.test)
    assert "average-pooled 2x2" in pooled.notes[-1] and bundle.downsampled(1) is bundle


def test_the_convergence_study_keeps_its_28x28_digits():
    spec = importlib.util.spec_from_file_location("convergence", ROOT / "docs" / "convergence.py")
    c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c)
    name, args = dict(c.STAGES["stats-val"]()).popitem()  # an mnist5k stage
    cmd = c.command(name, args)
    assert "mnist5k" in cmd or "digits" in cmd
    assert cmd[cmd.index("--downsample") + 1] == "1" and cmd.count("--downsample") == 1


def _rows(epochs=6):
    """Three methods, three seeds, with the default run's shape: a wide spread at epoch 2 (one baseline seed far
    below the others), a tie at the end, kappa and rho rising, loss falling."""
    rng = np.random.default_rng(0)
    rows = []
    for m, lift in (("baseline", 0.0), ("grad", 0.2), ("recursive", 0.35)):
        for seed in range(3):
            t = 0.0
            for e in range(1, epochs + 1):
                acc = {1: 40.0, 2: (22.0, 79.0, 39.0)[seed] + 30 * lift}.get(e, 95.0 + rng.normal(0, 0.4))
                t += 4.0 + lift
                rows.append(dict(method=m, seed=seed, epoch=e, lr=0.1, train_loss=2.0 / e ** 1.5 * (1 + 0.3 * seed),
                                 train_acc=acc, test_loss=1.0, test_acc=min(acc, 99.0),
                                 kappa_mean=0.4 + lift + 0.02 * e, kappa_sem=0.01, rho_mean=0.38 + lift + 0.02 * e,
                                 rho_sem=0.01, epoch_time=4.0 + lift, eval_time=0.5, train_time=t, cpu_time=4.0,
                                 load1=1.2 + 0.1 * e, wall_clock=0.0))
    return rows


@pytest.fixture
def figure():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = run_figure.metrics_figure(_rows(), "test", ["baseline", "grad", "recursive"])
    yield fig
    plt.close(fig)


def _bands(ax):
    from matplotlib.collections import PolyCollection

    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_every_panel_shades_the_seeds_spread_and_shows_it_whole(figure):
    panels = figure.axes[:6]
    for ax in panels:
        bands = _bands(ax)
        assert len(bands) == 3, (ax.get_title(), len(bands))  # one per method, the training loss vs epoch's too
        lo, hi = ax.get_ylim()
        for band in bands:
            ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
            assert lo <= ys.min() and ys.max() <= hi, (ax.get_title(), ys.min(), ys.max(), lo, hi)


def test_the_zoom_is_boxed_without_connectors_across_the_curves(figure):
    from matplotlib.patches import ConnectionPatch

    accuracy = figure.axes[0]
    assert accuracy.child_axes, "the run's early accuracy dwarfs the late differences: the panel has a zoom"
    indicators = [a for a in accuracy.get_children() if hasattr(a, "connectors")]  # matplotlib >= 3.10
    connectors = [c for i in indicators for c in i.connectors] or accuracy.findobj(ConnectionPatch)
    assert connectors and not any(c.get_visible() for c in connectors)


def test_the_time_panels_say_the_load_that_stretched_their_seconds(figure):
    for ax in figure.axes[3:5]:
        assert "load 1.3-1.8 on" in ax.get_xlabel(), ax.get_xlabel()


def test_l3_cache_reads_the_level_3_entry():
    l3 = report.l3_cache()
    if not os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        pytest.skip("no sysfs cache entries here")
    assert l3 is None or l3.split()[1] in ("KiB", "MiB")
    assert report.cpu_description() == report.cpu_model() + (f", {l3} L3" if l3 else "")
