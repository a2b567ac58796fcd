"""The benchmark suite runs: its entry point (``benchmarks/bench.py``) and every scenario in its tiny configuration
(seconds each), so the scenarios cannot rot; each writes its tables under the command, machine, commit, torch and
load that made them.

No timing is asserted (timings are the scenarios' output, not a property of the code).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Every test here runs a benchmark in a subprocess (2 s to minutes each): CI's slow step runs them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    import bench
finally:
    sys.path.remove(str(BENCH))

#: What the issue asks the suite to cover, by scenario name.
SCENARIOS = ["step", "ops", "host", "fold", "compile", "async", "gpu"]


def _run(args, tmp_path, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_the_suite_is_small():
    """One harness, one entry point, a few scenarios: at most 13 scripts and 3,200 lines (12 and 3,000 until
    ``fold_exit.py``, issue 74's measurement of an exit with a fold in flight: fresh processes, not a scenario's
    interleaved steps, so a script of its own; 3,150 until ``host_overhead.py --against``, a commit's step against
    this checkout's in one process, which a few microseconds' difference needs on a machine whose speed drifts)."""
    scripts = [p for p in BENCH.iterdir() if p.suffix in (".py", ".sh")]
    assert len(scripts) <= 13, sorted(p.name for p in scripts)
    assert sum(len(p.read_text().splitlines()) for p in scripts) <= 3200
    assert list(bench.SCENARIOS) == SCENARIOS
    assert all((BENCH / s.script).exists() for s in bench.SCENARIOS.values())


def test_entry_point_help_lists_every_scenario(tmp_path):
    out = _run([str(BENCH / "bench.py"), "--help"], tmp_path).stdout
    for name, scenario in bench.SCENARIOS.items():
        assert re.search(rf"^  {name}\s+{re.escape(scenario.title)}", out, flags=re.M), name
    assert _run([str(BENCH / "bench.py"), "list"], tmp_path).stdout.split() == SCENARIOS


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_tiny(name, tmp_path):
    out = tmp_path / "out.md"
    proc = _run([str(BENCH / "bench.py"), name, "--tiny", "--out", str(out)], tmp_path)
    text = out.read_text()
    assert text.startswith(f"## {bench.SCENARIOS[name].title} (tiny")
    for row in ("command", "machine", "GPU", "commit", "torch", "load average", "date", "wall time"):
        assert re.search(rf"^\| {row} \| .+ \|$", text, flags=re.M), row
    assert f"| command | `python benchmarks/bench.py {name} --tiny` |" in text
    assert text.count("| --- |") >= 2  # the provenance and at least one table of results
    assert proc.stdout.strip() == text.strip()  # each table once: the scenario's own prints are not echoed
    # quiet: no torch.profiler start/stop lines (kineto), no c10 warnings (its allocator's under the profiler)
    assert not re.search(r"USDT|STAGE:|profiler_start|CPUAllocator|^\[W\d{4}", proc.stderr, flags=re.M), proc.stderr


@pytest.mark.parametrize("name", ["fold", "compile"])
def test_scenario_takes_layer_kwargs(name, tmp_path):
    """The fold and compile scenarios pass ``--layer-kwargs`` to their converted layers (one method's here)."""
    out = tmp_path / "out.md"
    _run([str(BENCH / "bench.py"), name, "--tiny", "--out", str(out), "--", "--layer-kwargs", "grad:gains=damped"],
         tmp_path)
    assert "-- --layer-kwargs grad:gains=damped` |" in out.read_text()


def test_layer_kwargs_reach_every_converted_variant(monkeypatch):
    """``--layer-kwargs`` (e.g. ``gains=damped``) goes into every converted variant of the step scenario."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common
    import _models

    assert _common.parse_layer_kwargs("gains=damped, block_size=5,eps=1e-4") == \
        {"gains": "damped", "block_size": 5, "eps": 1e-4}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _common.parse_layer_kwargs("damped")
    _common.setup(1, 0, "wall", "block_size=7,recursive:block_size=3")
    try:
        import whitenlayers as wl

        base = _models.build_base(8, 10)
        for method, size in (("grad", 7), ("recursive", 3)):  # a METHOD: prefix wins for that method
            variant = _models.Variant(method, base, _models.random_batches(1, 2, 8, 10))
            assert {layer.block_size for _, layer in wl.whitening_layers(variant.model)} == {size}
    finally:
        _common.setup(1, 0, "wall")


def test_gpu_compiled_resnet50_tiny(tmp_path):
    """gpu.py's compiled table on the step table's ResNet-50 (``--compile-model resnet50``; CUDA graphs on a GPU):
    plain and recursive each compile, the converted model in one graph."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "gpu.py"), "--tiny", "--skip", "resnet50,resnet110,kernels", "--compile-model", "resnet50",
          "--compile-variants", "plain,recursive", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["compiled"]
    assert [r[1] for r in rows] == ["plain", "recursive"] and rows[1][-1] == 1


def test_host_overhead_ablation_tiny(tmp_path):
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--ablate", "recursive", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows][:2] == ["plain", "full"] and len(rows) == 7  # plain, full and the 5 parts
    assert rows[-1][0] == "all parts off"


def test_host_overhead_against_a_commit_tiny(tmp_path):
    """``--against REV`` steps REV's package (exported by git, imported under another name) beside this checkout's."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--against", "HEAD", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows] == ["plain"] + [f"{m}, {v}" for m in ("grad", "recursive", "direct")
                                                for v in ("HEAD", "this checkout")]
    assert rows[0][1] == 1.0 and all(r[1] > 0 for r in rows)


def test_host_overhead_folds_tiny(tmp_path):
    """``--folds`` times whole-model folds of each method: at least one per method, each a positive time."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--folds", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows] == ["grad", "recursive", "direct"]
    assert all(r[1] >= 1 and r[2] > 0 for r in rows)  # folds timed, ms per fold


def test_host_overhead_imports_tiny(tmp_path):
    """``--imports`` times both imports in fresh interpreters (the package's asserts that dynamo stayed unloaded)."""
    out = tmp_path / "out.json"
    _run([str(BENCH / "host_overhead.py"), "--tiny", "--imports", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows] == ["torch", "whitenlayers"] and rows[0][2] == 1.0 and rows[1][1] > 0


def test_host_overhead_ddp_tiny(tmp_path):
    """``--ddp`` under torchrun (two gloo ranks): every variant timed on both ranks, each against the plain model
    with the same buffer sync."""
    out = tmp_path / "out.json"
    _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", str(BENCH / "host_overhead.py"), "--tiny", "--ddp",
          "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows][:3] == ["plain", "grad", "grad, deferred"]
    assert len(rows) == 7 and all(r[1] > 0 and r[2] > 0 for r in rows)  # both ranks' medians
    assert rows[0][3] == 1.0 and rows[4][3] == 1.0  # each plain model against itself


def test_ablation_switches_off_what_it_names():
    """``--ablate``'s stand-ins do what their rows say: no statistics gathered or added, the absorbed offset left as it
    is, the weight's gradient left untransformed; the rest of the step as the full one."""
    import copy

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
            model = ho.switched_off(copy.deepcopy(base), parts)
            before = {name: layer._block.acc.clone() for name, layer in wl.whitening_layers(model)}
            offsets = {name: layer.absorbed_offset.clone() for name, layer in wl.whitening_layers(model)}
            ho._swapped(lambda: F.cross_entropy(model(x), y).backward(), ho._part_swaps(parts))()
            layers = dict(wl.whitening_layers(model))
            return (all(torch.equal(before[n], layers[n]._block.acc) for n in before),
                    all(torch.equal(offsets[n], layers[n].absorbed_offset) for n in offsets),
                    {n: layer.weight.grad.clone() for n, layer in layers.items()})

        full = stepped(frozenset())
        assert not full[0] and not full[1]  # the full step adds its batch and updates the offsets
        assert stepped(frozenset({"statistics"}))[0]
        assert stepped(frozenset({"offset"}))[1] and not stepped(frozenset({"offset"}))[0]
        # the C++ apply and Function.apply run the same Function's forward and backward: the same kernels, one process
        assert all(torch.equal(full[2][n], g) for n, g in stepped(frozenset({"apply"}))[2].items())
        untransformed = stepped(frozenset({"transform"}))[2]
        assert any(not torch.equal(full[2][n], untransformed[n]) for n in full[2])
        layer = next(layer for _, layer in wl.whitening_layers(base))  # untransformed = transformed Q^-1, per layer
        name = next(n for n, _ in wl.whitening_layers(base))
        q = layer.grad_transform.double()
        g = untransformed[name].double()
        expected = torch.einsum("oi...,ij->oj...", g, q)
        torch.testing.assert_close(full[2][name].double(), expected, rtol=1e-4, atol=1e-6)


def test_recursive_drift_runs_tiny(tmp_path):
    """``benchmarks/recursive_drift.py`` (float32 recursive layers against float64 twins, cited by docs/PAPER.md and
    docs/robustness.md; run on its own, not a scenario of ``bench.py``): its four tables, in seconds."""
    out = _run([str(BENCH / "recursive_drift.py"), "--tiny", "--threads", "1"], tmp_path).stdout
    assert len(re.findall(r"^\| --- \|", out, flags=re.M)) == 4 and "| coherence | 6 | 3 |" in out


def test_fold_exit_tiny(tmp_path):
    """``fold_exit.py --tiny``: both variants' processes run and exit cleanly, the table under its command."""
    proc = _run([str(BENCH / "fold_exit.py"), "--tiny", "--json", str(tmp_path / "out.json")], tmp_path)
    assert proc.stdout.startswith("## An exit with a fold in flight (tiny")
    assert "`python benchmarks/fold_exit.py --tiny --json" in proc.stdout
    assert re.search(r"^\| async \| [0-9.]+ \|", proc.stdout, flags=re.M), proc.stdout
    result = json.loads((tmp_path / "out.json").read_text())
    assert len(result["runs"]["sync"]) == len(result["runs"]["async"]) == 1
