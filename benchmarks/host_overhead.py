"""Host time a whitening layer adds to a training step: the CPU proxy of a GPU step's dispatch cost.

On a GPU a converted ResNet-50's bf16 step at batch 128 is close to CPU-bound (benchmarks/RESULTS.md, "GPU
checks and step table"): every microsecond of Python and every launch a whitening layer adds per step adds to the
step. This script measures that host time on the CPU, where kernels can be made negligible: the ResNet-50
layout at width 2, batch 2, 32x32, channels_last, bf16 autocast, the statistics on CUDA's path
(``functional.fused_moments``), one thread. Variants are interleaved step by step; the figure is

    (median step of the variant - median step of the plain model) / whitening layers,

in microseconds, over whole blocks (folds included) and over the steps that do not fold. Kernel time is not
zero at this size, so read it as an upper bound of the host time, to compare commits on one machine.

    python benchmarks/host_overhead.py --clock cpu     # a minute; process CPU time, steadier on a shared machine
    python benchmarks/host_overhead.py --clock cpu --ablate grad    # where one method's host time goes
    python benchmarks/host_overhead.py --clock cpu --folds     # host time of one whole-model fold
    python benchmarks/host_overhead.py --tiny     # CI

``--folds`` times ``fold_layers`` itself: each method's model with ``block_size=2`` (a fold every other
step), methods interleaved step by step, the time of each fold of all 52 layers (process CPU time with
``--clock cpu``) after a warm-up; median ms per fold and us per layer. A fold on a CPU pays nothing for its reads
to the host; on a GPU each one also waits for the queue (``hot_path.py`` counts them).

``--ddp`` (under ``torchrun``, gloo) steps each variant wrapped in ``DistributedDataParallel`` on every rank: the
default, "deferred" (``wl.defer_grad_transform``), and without DDP's buffer sync at every forward
(``forward_sync_buffers=False``, ``broadcast_buffers=False`` where DDP has no such argument; DDP's default re-sends
every buffer, each whitening layer's matrices included, at every forward), interleaved step by step (the order
rotated each round), each rank on its own batch; rank 0 prints each rank's median step (``--clock cpu``: the
process's CPU time, gloo's threads included)::

    torchrun --nproc_per_node 2 benchmarks/host_overhead.py --clock cpu --ddp

``--imports`` times ``import whitenlayers`` against ``import torch`` in fresh interpreters of this Python, alternated
(median of ``--rounds``; ``--clock cpu``: the child's CPU time), and checks that the import loads no ``torch._dynamo``
(the package reaches dynamo at a layer's first build, never at import)::

    python benchmarks/host_overhead.py --imports --clock cpu

``--against REV`` compares this checkout's step with commit ``REV``'s in one process, which a machine whose speed
drifts over minutes needs for a difference of a few microseconds: ``REV``'s package, exported by ``git archive``
into a temporary folder, is imported under another name; each method's model of either version and the plain one
are stepped interleaved, in an order rotated at each step (``--blocks`` x 100 steps each)::

    python benchmarks/host_overhead.py --clock cpu --against cf9377c

``--ablate METHOD`` attributes that method's default step to its parts, switched off one at a time in the same
converted model (the statistics not gathered; the absorbed offset's update; the weight-gradient transform, its
autograd node not made; the C++ apply of the autograd Functions, ``Function.apply`` instead), stepped interleaved
with the full step and the plain one. Such a step is not a configuration anyone trains; it only says what that
part costs. Row "all parts off": the layers' forwards around their convolutions and the coordinator's hooks.
"""
# ruff: noqa: B007, E501  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import copy
import inspect
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import _common
import torch
from _common import add_common_args, command_line, loadavg, machine_description, md_table, setup, write_json
from _resnet50 import resnet50
from torch import nn

import whitenlayers as wl
import whitenlayers.autograd as autograd_mod
import whitenlayers.coordinator as fold_mod  # the coordinator's fold_layers: the one a model's forward calls
import whitenlayers.layers.direct as direct_mod
import whitenlayers.layers.step as step_mod

#: The variants: method and its settings.
VARIANTS = {
    "grad": ("grad", {}),
    "recursive": ("recursive", {}),
    "direct": ("direct", {}),
    "grad:every5,block50": ("grad", {"stats_every": 5, "block_size": 50}),
    "recursive:every5,block50": ("recursive", {"stats_every": 5, "block_size": 50}),
    # the weight-gradient transform in a hook on each weight (wl.defer_grad_transform), defaults otherwise
    "grad:deferred": ("grad", {"defer": True}),
    "recursive:deferred": ("recursive", {"defer": True}),
}


def _convert_kw(kw: Dict[str, object]) -> Dict[str, object]:
    """A variant's ``convert_model`` arguments (``defer`` is the stepper's)."""
    return {k: v for k, v in kw.items() if k != "defer"}


def _inputs(seed: int):
    """The base model (the ResNet-50 layout at width 2, 10 classes) and one channels_last batch of 2 at 32x32."""
    torch.manual_seed(seed)
    base = resnet50(2, num_classes=10)
    return base, torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last), torch.randint(0, 10, (2,))


def _stepper(model: nn.Module, x: torch.Tensor, y: torch.Tensor, defer: bool = False) -> Callable[[], None]:
    """One training step of ``model`` (channels_last, bf16 autocast, SGD with momentum; ``defer``: the
    weight-gradient transform in a hook on each weight, ``wl.defer_grad_transform``)."""
    model.to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if defer:
        wl.defer_grad_transform(model, opt)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _report(head: str, table: str, rows: list, layers: int, json_path) -> Dict[str, object]:
    text = head + "\n\n" + table
    print(text)
    out = {"rows": rows, "layers": layers, "markdown": text}
    write_json(json_path, out)
    return out


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--blocks", type=int, default=3, help="whole blocks of 50 steps timed per variant")
    p.add_argument("--ablate", choices=sorted(k for k, (_, kw) in VARIANTS.items() if "defer" not in kw),
                   help="attribute one variant's host time to its parts")
    p.add_argument("--folds", action="store_true", help="time whole-model folds instead of steps")
    p.add_argument("--imports", action="store_true", help="time `import whitenlayers` against `import torch`")
    p.add_argument("--rounds", type=int, default=5, help="--imports: fresh interpreters per import, alternated")
    p.add_argument("--against", metavar="REV", help="compare with commit REV's step in this process")
    p.add_argument("--ddp", action="store_true", help="under torchrun: DDP steps (default, deferred, without the "
                                                         "buffer sync at every forward)")
    args = p.parse_args(argv)
    if args.ddp:
        return ddp(args)
    if args.ablate:
        return ablate(args)
    if args.folds:
        return fold_host_time(args)
    if args.imports:
        return import_time(args)
    if args.against:
        return against(args)
    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    steps_per_round = 50  # one block of the longest block size; 5 blocks of the default 10
    rounds = 1 if args.tiny else args.blocks
    base, x, y = _inputs(args.seed)
    models: Dict[str, nn.Module] = {"plain": copy.deepcopy(base)}
    for name, (method, kw) in VARIANTS.items():
        models[name] = wl.convert_model(copy.deepcopy(base), method, **_convert_kw(kw))
    layers = len(wl.whitening_layers(models["grad"]))
    times: Dict[str, List[float]] = {k: [] for k in models}
    steppers = {name: _stepper(model, x, y, VARIANTS.get(name, ("", {}))[1].get("defer", False))
                for name, model in models.items()}
    machine = machine_description()
    names = list(models)
    with wl.functional.fused_moments(True):
        for name in names:  # warm-up: one block of 50 each (the first block, its shifted statistics, is behind)
            for _ in range(5 if args.tiny else steps_per_round):
                steppers[name]()
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for s in range(5 if args.tiny else steps_per_round):
                for name in order:  # interleaved step by step
                    t0 = _common._CLOCK()
                    steppers[name]()
                    times[name].append(_common._CLOCK() - t0)
    plain_med = statistics.median(times["plain"])
    plain_mean = statistics.mean(times["plain"])
    rows = []
    for name, t in times.items():
        rows.append([name, 1e3 * statistics.mean(t), 1e3 * statistics.median(t),
                     0.0 if name == "plain" else 1e6 * (statistics.mean(t) - plain_mean) / layers,
                     0.0 if name == "plain" else 1e6 * (statistics.median(t) - plain_med) / layers])
    table = md_table(["variant", "mean step ms (folds included)", "median step ms (no fold)",
                      "extra us per layer per step (mean)", "extra us per layer per step (median)"], rows, nd=1)
    head = (f"Command: `{command_line()}`; {machine.get('cpu', '')}; torch {torch.__version__}; {layers} whitening "
            f"layers; load before/after {machine['loadavg']} / {loadavg()}")
    return _report(head, table, rows, layers, args.json)


def fold_host_time(args) -> Dict[str, object]:
    """``--folds``: the host time of one fold of the whole model, per method (see the module docstring)."""
    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    base, x, y = _inputs(args.seed)
    methods = ("grad", "recursive", "direct")
    models = {m: wl.convert_model(copy.deepcopy(base), m, block_size=2) for m in methods}
    layers = len(wl.whitening_layers(models["grad"]))
    steppers = {m: _stepper(model, x, y) for m, model in models.items()}
    times: Dict[str, List[float]] = {m: [] for m in methods}
    current: List[str] = []
    real = fold_mod.fold_layers

    def timed(*a, **kw):
        t0 = _common._CLOCK()
        try:
            return real(*a, **kw)
        finally:
            times[current[0]].append(_common._CLOCK() - t0)

    machine = machine_description()
    fold_mod.fold_layers = timed
    try:
        with wl.functional.fused_moments(True):
            for m in methods:  # warm-up: 10 folds each
                current[:] = [m]
                for _ in range(20):
                    steppers[m]()
            for t in times.values():
                t.clear()
            for _ in range(4 if args.tiny else 40 * args.blocks):
                for m in methods:  # interleaved step by step: a fold every other step
                    current[:] = [m]
                    steppers[m]()
    finally:
        fold_mod.fold_layers = real
    rows = [[m, len(t), 1e3 * statistics.median(t), 1e6 * statistics.median(t) / layers] for m, t in times.items()]
    table = md_table(["method", "folds timed", "median ms per fold", "us per layer"], rows, nd=2)
    head = (f"Command: `{command_line()}`; {machine.get('cpu', '')}; torch {torch.__version__}; {layers} whitening "
            f"layers; load before/after {machine['loadavg']} / {loadavg()}")
    return _report(head, table, rows, layers, args.json)


#: ``--imports``' statements, each in a fresh interpreter: the package's asserts that dynamo stayed unloaded.
IMPORTS = {"torch": "import torch",
           "whitenlayers": "import sys, whitenlayers; assert 'torch._dynamo' not in sys.modules, 'dynamo imported'"}


def import_time(args) -> Dict[str, object]:
    """``--imports``: see the module docstring."""
    times: Dict[str, List[float]] = {name: [] for name in IMPORTS}
    for _ in range(1 if args.tiny else args.rounds):
        for name, statement in IMPORTS.items():
            before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            subprocess.run([sys.executable, "-c", statement], check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            times[name].append(cpu if args.clock == "cpu" else time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [[name, medians[name], medians[name] / medians["torch"]] for name in IMPORTS]
    table = md_table(["import", f"median s ({args.clock} time)", "vs import torch"], rows, nd=2)
    head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
            f"{len(times['torch'])} fresh interpreters each, alternated; no torch._dynamo after the package's "
            f"import; load {loadavg()}")
    return _report(head, table, rows, 0, args.json)


def against(args) -> Dict[str, object]:
    """``--against REV``: this checkout's step against commit ``REV``'s, in one process (the module docstring)."""
    import importlib
    import io
    import pathlib
    import tarfile
    import tempfile

    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    root = pathlib.Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", args.against, "whitenlayers"], cwd=root, check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix="whitenlayers-against-") as tmp:  # (removed after the run)
        folder = pathlib.Path(tmp)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        (folder / "whitenlayers").rename(folder / "whitenlayers_against")
        sys.path.insert(0, str(folder))
        other = importlib.import_module("whitenlayers_against")
        base, x, y = _inputs(args.seed)
        models = {"plain": copy.deepcopy(base)}
        for method in ("grad", "recursive", "direct"):
            models[f"{method}, {args.against}"] = other.convert_model(copy.deepcopy(base), method)
            models[f"{method}, this checkout"] = wl.convert_model(copy.deepcopy(base), method)
        layers = len(wl.whitening_layers(models["grad, this checkout"]))
        steppers = {name: _stepper(model, x, y) for name, model in models.items()}
        with other.functional.fused_moments(True):
            steps = 5 if args.tiny else 100 * args.blocks
            times = _interleaved(steppers, list(models), steps, 2 if args.tiny else 50, rotate=True)
        plain = statistics.median(times["plain"])
        rows = [[name, statistics.median(t) / plain, 1e6 * (statistics.median(t) - plain) / layers]
                for name, t in times.items()]
        table = md_table(["variant", "median step / plain", "extra us per layer (median)"], rows, nd=3)
        head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
                f"{layers} whitening layers, {len(times['plain'])} steps each, interleaved in rotated order; load "
                f"{loadavg()}")
        return _report(head, table, rows, layers, args.json)


def _interleaved(steppers: Dict[str, Callable[[], None]], names: List[str], steps: int, warmup: int,
                 rotate: bool = False) -> Dict[str, List[float]]:
    """Each of ``names``' steps timed ``steps`` times, interleaved step by step after ``warmup`` untimed rounds
    (``rotate``: the order rotated by one at each round), with the statistics on CUDA's path."""
    times: Dict[str, List[float]] = {k: [] for k in names}
    with wl.functional.fused_moments(True):
        for _ in range(warmup):
            for name in names:
                steppers[name]()
        for s in range(steps):
            for name in (names[s % len(names):] + names[: s % len(names)]) if rotate else names:
                t0 = _common._CLOCK()
                steppers[name]()
                times[name].append(_common._CLOCK() - t0)
    return times


def _without(layer, part: str) -> None:
    """Switch ``part`` off in ``layer``'s forward (instance attributes, set once: no class attribute changes)."""
    if part == "statistics":
        layer.__dict__["_add_batch"] = lambda x: None
    elif part == "offset":
        layer.__dict__["_track_absorbed_offset"] = lambda w, bn, reads, plain=False: None


#: ``--ablate``'s rows: the parts of the default step switched off, in turn.
PARTS = {
    "statistics (the batch's sums into the block)": ("statistics",),
    "absorbed offset update": ("offset",),
    "weight-gradient transform (its autograd node)": ("transform",),
    "the C++ apply of the autograd Functions (`Function.apply` instead)": ("apply",),
    "all parts off": ("statistics", "offset", "transform"),
}


def _swapped(step: Callable[[], None], swaps: Dict[tuple, object]) -> Callable[[], None]:
    """``step`` with module attributes ``{(module, name): value}`` replaced while it runs (the models are stepped
    interleaved: each step sets its own)."""
    def run() -> None:
        saved = {key: getattr(*key) for key in swaps}
        for (mod, name), value in swaps.items():
            setattr(mod, name, value)
        try:
            step()
        finally:
            for (mod, name), value in saved.items():
                setattr(mod, name, value)
    return run


#: The C++ applies of the library's autograd Functions, where they are called: (module, name) -> the Function.
C_APPLIES = {(autograd_mod, "direct_whiten_apply"): autograd_mod._DirectWhiten,
             (autograd_mod, "grad_transformed_apply"): autograd_mod._WeightGradTransform,
             (autograd_mod, "pointwise_whiten_apply"): autograd_mod._PointwiseWhiten,
             (autograd_mod, "transformed_weight_apply"): autograd_mod._TransformedWeight,
             (step_mod, "grad_transformed_apply"): autograd_mod._WeightGradTransform,
             (direct_mod, "transformed_weight_apply"): autograd_mod._TransformedWeight}


def _part_swaps(parts) -> Dict[tuple, object]:
    """The module attributes that switch ``parts`` off for one step: the transform's Function not applied (the
    weight as it is), or every Function through ``Function.apply`` (which binds its arguments with ``inspect`` at
    every call) instead of the C++ apply the library calls (``whitenlayers._torch_compat.function_apply``)."""
    swaps: Dict[tuple, object] = {}
    if "apply" in parts:
        swaps.update({key: function.apply for key, function in C_APPLIES.items()})
    if "transform" in parts:
        swaps[step_mod, "grad_transformed_apply"] = lambda w, q: w
    return swaps


def switched_off(model: nn.Module, parts) -> nn.Module:
    """A converted ``model`` with ``parts`` of its layers' forwards switched off (the values of :data:`PARTS`; the
    module-level parts are :func:`_part_swaps`')."""
    for _, layer in wl.whitening_layers(model):
        for part in parts:
            _without(layer, part)
    return model


def ablate(args) -> Dict[str, object]:
    """``--ablate METHOD``: the default step with one part switched off at a time (the module docstring)."""
    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    method, kw = VARIANTS[args.ablate]
    if method == "direct":
        raise SystemExit("--ablate takes a grad or recursive variant (its parts are the grad layers')")
    base, x, y = _inputs(args.seed)
    converted = wl.convert_model(copy.deepcopy(base), method, **kw)
    layers = len(wl.whitening_layers(converted))
    names = ["plain", "full"] + list(PARTS)
    models = {name: copy.deepcopy(base) if name == "plain" else copy.deepcopy(converted) for name in names}
    for name, parts in PARTS.items():
        switched_off(models[name], parts)
    runners = {name: _stepper(model, x, y) for name, model in models.items()}
    runners.update({name: _swapped(runners[name], _part_swaps(parts)) for name, parts in PARTS.items()
                    if _part_swaps(parts)})
    steps = 5 if args.tiny else 50 * args.blocks
    times = _interleaved(runners, names, steps, 2 if args.tiny else 50)
    plain_med, full_med = statistics.median(times["plain"]), statistics.median(times["full"])
    rows = [[name, 1e3 * statistics.median(t), 1e6 * (statistics.median(t) - plain_med) / layers,
             0.0 if name in ("plain", "full") else 1e6 * (full_med - statistics.median(t)) / layers]
            for name, t in times.items()]
    table = md_table(["step (parts switched off)", "median step ms", "extra us per layer", "the part's us per layer"],
                     rows, nd=1)
    head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
            f"{args.ablate}, {layers} whitening layers, {steps} steps each, interleaved; load {loadavg()}")
    return _report(head, table, rows, layers, args.json)


#: DDP without its buffer broadcast at every forward: ``forward_sync_buffers=False`` (the buffers are still synced
#: when DDP wraps the model) where DDP has it, else ``broadcast_buffers=False``.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
#: ``--ddp``'s variants: (name, method, DDP's buffer broadcast at every forward).
DDP_VARIANTS = [("plain", None, True), ("grad", "grad", True), ("grad, deferred", "grad", True),
                ("recursive", "recursive", True),
                ("plain, no forward buffer sync", None, False), ("grad, no forward buffer sync", "grad", False),
                ("recursive, no forward buffer sync", "recursive", False)]


def ddp(args) -> Dict[str, object]:
    """``--ddp``: see the module docstring."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        base, _, _ = _inputs(args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batch
        x = torch.randn(2, 3, 32, 32, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (2,), generator=gen)
        steppers, layers = {}, 0
        for name, method, broadcast in DDP_VARIANTS:
            model = copy.deepcopy(base) if method is None else wl.convert_model(copy.deepcopy(base), method)
            if method is not None:
                layers = len(wl.whitening_layers(model))
            model.to(memory_format=torch.channels_last)
            sync = {} if broadcast else NO_FORWARD_BUFFER_SYNC
            steppers[name] = _stepper(DistributedDataParallel(model, **sync), x, y, defer=name.endswith("deferred"))
        names = [name for name, _, _ in DDP_VARIANTS]
        steps = 5 if args.tiny else 50 * args.blocks
        times = _interleaved(steppers, names, steps, 2 if args.tiny else 50, rotate=True)  # (same order on all ranks)
        medians = {k: statistics.median(t) for k, t in times.items()}
        gathered: List[Dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, medians)
    finally:
        dist.destroy_process_group()
    rows = []
    for name, method, broadcast in DDP_VARIANTS:
        per_rank = [g[name] for g in gathered]
        plain = "plain" if broadcast else "plain, no forward buffer sync"  # against the plain model set alike
        extra = 0.0 if method is None else 1e6 * statistics.mean(g[name] - g[plain] for g in gathered) / layers
        rows.append([name] + [1e3 * t for t in per_rank]
                    + [statistics.mean(g[name] / g[plain] for g in gathered), extra])
    table = md_table(["variant"] + [f"median step ms, rank {r}" for r in range(world)]
                     + ["vs plain, same buffer sync (mean over ranks)", "extra us per layer"], rows, nd=3)
    head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
            f"DDP (gloo), {world} ranks, {layers} whitening layers, {steps} steps each, interleaved; load {loadavg()}")
    if rank != 0:
        return {"rows": rows}
    return _report(head, table, rows, layers, args.json)


if __name__ == "__main__":
    main()
