"""Every benchmark script runs in its tiny configuration (seconds): the scripts cannot rot.

No timing is asserted (timings are the scripts' output, not a property of the code).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Every test here runs a benchmark script in a subprocess (2 s to minutes each): CI's slow step runs them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = ["fold_cost.py", "fold_scale.py", "gpu.py", "layer_step.py", "crossover.py", "step_time.py", "block_size.py", "ablation.py",
           "hot_path.py", "compile_step.py", "host_overhead.py", "gpu_host.py", "stats_precision.py", "cuda_graphs.py",
           "fold_async.py", "grouped_stats.py"]


def _run(args, tmp_path, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_tiny(script, tmp_path):
    out = tmp_path / "out.json"
    proc = _run([str(BENCH / script), "--tiny", "--json", str(out)], tmp_path)
    data = json.loads(out.read_text())
    assert "| --- |" in data["markdown"]  # at least one Markdown table
    assert "| --- |" in proc.stdout


def test_run_all_tiny(tmp_path):
    out = tmp_path / "RESULTS.md"
    _run([str(BENCH / "run_all.py"), "--tiny", "--only", "fold_cost", "--out", str(out)], tmp_path)
    text = out.read_text()
    assert "python benchmarks/fold_cost.py --tiny" in text
    assert "torch" in text and "| --- |" in text


def test_gpu_session_script_parses_and_names_its_parts(tmp_path):
    """benchmarks/gpu_session.sh (run on a device machine only): valid shell, and an unknown part is refused."""
    script = str(BENCH / "gpu_session.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    proc = subprocess.run(["bash", script, "no-such-part"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "bench|short|tests|compile|compile50" in proc.stderr
    assert (tmp_path / "machine.txt").exists()


def test_gpu_compiled_resnet50_tiny(tmp_path):
    """gpu.py's compiled table on the step table's ResNet-50 (``--compile-model resnet50``; CUDA graphs on a GPU):
    plain and recursive each compile, the converted model in 2 graphs."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "gpu.py"), "--tiny", "--skip", "resnet50,resnet110,kernels", "--compile-model", "resnet50",
          "--compile-variants", "plain,recursive", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["compiled"]
    assert [r[1] for r in rows] == ["plain", "recursive"] and rows[1][-1] == 2


def test_host_overhead_ablation_tiny(tmp_path):
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--ablate", "recursive", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows][:3] == ["plain", "full", "full path (no planned steps)"] and len(rows) == 8
    assert rows[-1][0].startswith("essential")


def test_host_overhead_folds_tiny(tmp_path):
    """``--folds`` times whole-model folds of each method: at least one per method, each a positive time."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--folds", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows] == ["grad", "recursive", "direct"]
    assert all(r[1] >= 1 and r[2] > 0 for r in rows)  # folds timed, ms per fold


def test_host_overhead_ddp_tiny(tmp_path):
    """``--ddp`` under torchrun (two gloo ranks): every variant timed on both ranks, each against the plain model
    with the same buffer sync."""
    out = tmp_path / "out.json"
    _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", str(BENCH / "host_overhead.py"), "--tiny", "--ddp",
          "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows][:4] == ["plain", "grad", "grad, not planned", "grad, a node per layer"]
    assert len(rows) == 10 and all(r[1] > 0 and r[2] > 0 for r in rows)  # both ranks' medians
    assert rows[0][3] == 1.0 and rows[7][3] == 1.0  # each plain model against itself


def test_gpu_probe_library_fold_compares_the_two_eigh_paths(monkeypatch):
    """gpu_probe.py's library-fold probe (CUDA only in the script) runs on a CPU taking the GPU's paths: the
    per-layer path makes one ``eigh`` call per wide layer, the batched one fewer, and the probe restores both."""
    monkeypatch.syspath_prepend(str(BENCH))
    import torch

    import whitenlayers as wl
    from whitenlayers.rules import EVDRule

    gpu_probe = pytest.importorskip("gpu_probe")
    before = (EVDRule.batch_key, torch.linalg.eigh)
    with wl.functional.fused_moments(True):
        rows = gpu_probe.probe_library_fold(torch.device("cpu"), width=8, reps=1)
    assert (EVDRule.batch_key, torch.linalg.eigh) == before
    (_, per_layer_calls, _), (_, batched_calls, _) = rows
    assert batched_calls < per_layer_calls


def test_host_overhead_planned_ablation_tiny(tmp_path):
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--ablate", "grad", "--planned", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows][:2] == ["plain", "full"] and len(rows) == 7
    assert rows[-1][0] == "all four parts off"


def test_planned_ablation_switches_off_what_it_names():
    """``--ablate --planned``'s stand-ins do what their rows say: no statistics gathered or added, the absorbed
    offset left as it is, the weight's gradient left untransformed; the rest of the step as the full one."""
    import copy
    import types

    import torch
    import torch.nn.functional as F

    import whitenlayers as wl

    sys.path.insert(0, str(BENCH))
    try:
        import host_overhead as ho
    finally:
        sys.path.remove(str(BENCH))
    torch.manual_seed(0)
    base = wl.convert_model(wl.models.cifar_resnet(8, num_classes=10), "grad", block_size=3)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    with wl.functional.fused_moments(True):
        for _ in range(4):  # past a fold: Q is not the identity, the accumulators hold a block's first batch
            F.cross_entropy(base(x), y).backward()
        base.zero_grad()

        def stepped(parts):
            model = copy.deepcopy(base)
            if "added" in parts:
                for hook in model._forward_hooks.values():
                    if isinstance(hook, wl.coordinator.FoldCoordinator):
                        hook.__dict__["flush_stats"] = types.MethodType(ho._drop_handed, hook)
            else:
                for _, layer in wl.whitening_layers(model):
                    layer.__dict__["_step_plan"] = types.MethodType(ho._plan_without(parts), layer)
            before = {name: layer._acc_aug.clone() for name, layer in wl.whitening_layers(model)}
            offsets = {name: layer.absorbed_offset.clone() for name, layer in wl.whitening_layers(model)}
            F.cross_entropy(model(x), y).backward()
            layers = dict(wl.whitening_layers(model))
            return (all(torch.equal(before[n], layers[n]._acc_aug) for n in before),
                    all(torch.equal(offsets[n], layers[n].absorbed_offset) for n in offsets),
                    {n: layer.weight.grad.clone() for n, layer in layers.items()})

        full = stepped(frozenset())
        assert not full[0] and not full[1]  # the full step adds its batch and updates the offsets
        assert stepped(frozenset({"statistics"}))[0]
        assert stepped(frozenset({"added"}))[0]
        assert stepped(frozenset({"offset"}))[1] and not stepped(frozenset({"offset"}))[0]
        untransformed = stepped(frozenset({"transform"}))[2]
        assert any(not torch.equal(full[2][n], untransformed[n]) for n in full[2])
        layer = next(layer for _, layer in wl.whitening_layers(base))  # untransformed = transformed Q^-1, per layer
        name = next(n for n, _ in wl.whitening_layers(base))
        q = layer.grad_transform.double()
        g = untransformed[name].double()
        expected = torch.einsum("oi...,ij->oj...", g, q)
        torch.testing.assert_close(full[2][name].double(), expected, rtol=1e-4, atol=1e-6)
