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

``--ddp`` (under ``torchrun``, gloo) steps each variant wrapped in ``DistributedDataParallel`` on every rank, the
grad / recursive layers planned (the default: under ``torch.distributed`` their weights go through shared nodes in
runs of ``DISTRIBUTED_RUN`` layers, so DDP all-reduces during the backward; row "a node per layer": one each;
"deferred": ``wl.defer_grad_transform``) and not planned (every forward the layers' full path, as
``--ablate``'s row "full path"), and without DDP's buffer sync at every forward (``forward_sync_buffers=False``,
``broadcast_buffers=False`` where DDP has no such argument; DDP's default re-sends every buffer, each whitening
layer's matrices included, at every forward), interleaved step by step (the order rotated each round), each rank on
its own batch; rank 0 prints each rank's median step (``--clock cpu``: the process's CPU time, gloo's threads
included)::

    torchrun --nproc_per_node 2 benchmarks/host_overhead.py --clock cpu --ddp

``--ablate METHOD`` attributes that method's time (defaults) to the parts of a layer's step: the same converted
model stepped with one part switched off at a time (the absorbed offset's update, the weight-gradient transform,
the block's bookkeeping, the statistics), interleaved with the full step and the plain one. A step without a part
is not a configuration anyone trains (nothing is folded without the bookkeeping); it only says what that part
costs. The parts are those of the layers' full path, so those rows run without the steps the coordinator plans
(row "full path (no planned steps)", what each part is measured against); row "full" is the default, planned.

``--ablate METHOD --planned`` attributes the default, planned step instead (what a converted model runs): each part
switched off in the plans the coordinator makes before the forward (the statistics not gathered; gathered and
handed to the coordinator, but not added at the forward's end; the absorbed offset not updated; the weight taken
as it is, so the shared node's backward, the weight-gradient products, never runs), against row "full"; what is
left (row "all four parts off") is the planning before the forward, the layers' planned forwards around their
convolutions, the shared node's forward and the forward's end.

    python benchmarks/host_overhead.py --clock cpu --ablate grad --planned
"""
# ruff: noqa: B007, E501  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import threading
import types
from typing import Callable, Dict, List

import _common
import torch
from _common import add_common_args, command_line, loadavg, machine_description, md_table, setup, write_json
from _resnet50 import resnet50
from torch import nn

import whitenlayers as wl
import whitenlayers.coordinator as fold_mod  # the coordinator's fold_layers: the one a model's forward calls
from whitenlayers.autograd import grad_transformed

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
    p.add_argument("--planned", action="store_true",
                   help="with --ablate: the parts of the planned step (the default path) instead of the full path's")
    p.add_argument("--folds", action="store_true", help="time whole-model folds instead of steps")
    p.add_argument("--ddp", action="store_true", help="under torchrun: DDP steps, planned against not planned")
    args = p.parse_args(argv)
    if args.ddp:
        return ddp(args)
    if args.ablate:
        return ablate_planned(args) if args.planned else ablate(args)
    if args.folds:
        return fold_host_time(args)
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


#: The parts of a grad / recursive layer's step that ``--ablate`` switches off, one at a time: method name and the
#: stand-in that does nothing (or, for the gradient transform, hands the conv its weight as it is).
PARTS = {
    "absorbed offset update": ("_track_absorbed_offset", lambda self, w, bn, state: None),
    "weight-gradient transform": ("_weight_for_forward", lambda self, state: self.weight),
    "block bookkeeping (_end_batch)": ("_end_batch", lambda self: None),
    "statistics (_accumulate)": ("_accumulate", lambda self, x: None),
}


def _essential_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A grad / recursive conv's per-batch work with none of the library's Python around it (no checks, no
    bookkeeping, no fold, no autocast handling): the statistics' two ops, the weight-gradient Function, the
    absorbed offset's ``addmv_`` and the convolution, each layer's own (``--ablate``'s last row); not a layer anyone
    can train with. It was the floor of a layer's own operations; the default step now goes below it (statistics
    added by groups of layers, one weight-gradient node for all of them, planned steps)."""
    if self._centring_ref is None or self._acc_aug is None:
        return type(self).forward(self, x)
    wl.functional.accumulate_moments(self._acc_aug, x.detach(), None)
    w = grad_transformed(self.weight, self.grad_transform)
    rows, taps_last = self._weight_rows(w.detach())
    self._buffers["absorbed_offset"].addmv_(rows, self._mean_per_tap(self.running_mean, rows.dtype, taps_last),
                                            beta=0.9, alpha=-0.1)
    return self._conv_forward(x, w, None)


#: ``--ablate``'s row of :func:`_essential_forward`.
ESSENTIAL = "essential ops only (no library Python around them)"
#: ``--ablate``'s row of the layers' full path, no step planned by the coordinator (what the parts are taken from).
FULL_PATH = "full path (no planned steps)"


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


def _no_plan(self, view, state, sink):
    """``--ablate``'s stand-in for ``_GradWhitenMixin._step_plan``: no plan, every forward takes the full path."""
    return None


def _ablated(args):
    """``--ablate``'s set-up: the base model, its batch, the converted model of the variant and its layer count."""
    setup(1 if args.threads == 2 else args.threads, args.seed, args.clock)
    method, kw = VARIANTS[args.ablate]
    if method == "direct":
        raise SystemExit("--ablate takes a grad or recursive variant (its parts are the grad layers')")
    base, x, y = _inputs(args.seed)
    converted = wl.convert_model(copy.deepcopy(base), method, **kw)
    return base, x, y, converted, len(wl.whitening_layers(converted))


def ablate(args) -> Dict[str, object]:
    base, x, y, converted, layers = _ablated(args)
    # One model per row, its layers' parts replaced once, on the instances: replacing a class's method between
    # steps would make Python drop its attribute caches for every layer at each step (a cost of its own). The parts
    # are switched off in the layers' full path: the steps planned by the coordinator (docs/robustness.md, "Planned
    # steps") bypass those methods, so every row but "full" runs without plans, and a part's time is against the
    # full path without plans.
    names = ["plain", "full", FULL_PATH] + list(PARTS) + [ESSENTIAL]
    models = {name: copy.deepcopy(base) if name == "plain" else copy.deepcopy(converted) for name in names}
    runners = {name: _stepper(model, x, y) for name, model in models.items()}
    with wl.functional.fused_moments(True):
        runners[ESSENTIAL]()  # a first batch: the accumulators exist from here on
    for name, model in models.items():
        for _, layer in (wl.whitening_layers(model) if name not in ("plain", "full") else []):
            layer.__dict__["_step_plan"] = types.MethodType(_no_plan, layer)
            if name in PARTS:
                attr, stand_in = PARTS[name]
                layer.__dict__[attr] = types.MethodType(stand_in, layer)
            elif name == ESSENTIAL:
                layer.__dict__["forward"] = types.MethodType(_essential_forward, layer)
    steps = 5 if args.tiny else 50 * args.blocks
    times = _interleaved(runners, names, steps, 2 if args.tiny else 50)
    plain_med, full_med = statistics.median(times["plain"]), statistics.median(times[FULL_PATH])
    rows = [[name, 1e3 * statistics.median(t), 1e6 * (statistics.median(t) - plain_med) / layers,
             0.0 if name in ("plain", "full", FULL_PATH, ESSENTIAL) else 1e6 * (full_med - statistics.median(t)) / layers]
            for name, t in times.items()]
    table = md_table(["step (parts switched off)", "median step ms", "extra us per layer", "the part's us per layer"],
                     rows, nd=1)
    head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
            f"{args.ablate}, {layers} whitening layers, {steps} steps each, interleaved; load {loadavg()}")
    return _report(head, table, rows, layers, args.json)


def _plan_without(parts: frozenset) -> Callable:
    """An instance-level stand-in for ``_GradWhitenMixin._step_plan`` whose plans leave out ``parts`` (names of
    :data:`PLANNED_PARTS`), for ``--ablate --planned``."""
    def step_plan(self, view, state, sink):
        plan = type(self)._step_plan(self, view, state, sink)
        if plan is None:
            return None
        plan = list(plan)
        if "statistics" in parts:
            plan[2] = 0  # nothing gathered (stats_every's off steps)
        if "offset" in parts and plan[5] == 0:
            plan[5] = 2  # the absorbed offset left as it is (a BatchNorm that keeps no running mean)
        if "transform" in parts and view is not None:
            plan[0] = view._base  # the weight itself: the shared node's view unused, its backward never runs
        return tuple(plan)
    return step_plan


def _drop_handed(self, end: bool = False) -> None:
    """``--ablate --planned``'s stand-in for ``FoldCoordinator.flush_stats``: the batches handed over are dropped, not
    added."""
    scopes = self._scopes
    if scopes:
        entries = scopes.pop(threading.get_ident(), None) if end else scopes.get(threading.get_ident())
        if entries:
            entries.clear()


#: ``--ablate --planned``'s rows: the parts switched off in the planned step.
PLANNED_PARTS = {
    "statistics (gathered, handed over, added)": frozenset({"statistics"}),
    "statistics added at the forward's end": frozenset({"added"}),
    "absorbed offset update": frozenset({"offset"}),
    "weight-gradient transform (the shared node's backward)": frozenset({"transform"}),
    "all four parts off": frozenset({"statistics", "offset", "transform"}),
}


def ablate_planned(args) -> Dict[str, object]:
    base, x, y, converted, layers = _ablated(args)
    names = ["plain", "full"] + list(PLANNED_PARTS)
    models = {name: copy.deepcopy(base) if name == "plain" else copy.deepcopy(converted) for name in names}
    for name, parts in PLANNED_PARTS.items():  # (instance attributes, set once: no class attribute changes)
        model = models[name]
        if "added" in parts:
            for hook in model._forward_hooks.values():
                if isinstance(hook, fold_mod.FoldCoordinator):
                    hook.__dict__["flush_stats"] = types.MethodType(_drop_handed, hook)
            continue
        for _, layer in wl.whitening_layers(model):
            layer.__dict__["_step_plan"] = types.MethodType(_plan_without(parts), layer)
    runners = {name: _stepper(model, x, y) for name, model in models.items()}
    steps = 5 if args.tiny else 50 * args.blocks
    times = _interleaved(runners, names, steps, 2 if args.tiny else 50)
    plain_med, full_med = statistics.median(times["plain"]), statistics.median(times["full"])
    rows = [[name, 1e3 * statistics.median(t), 1e6 * (statistics.median(t) - plain_med) / layers,
             0.0 if name in ("plain", "full") else 1e6 * (full_med - statistics.median(t)) / layers]
            for name, t in times.items()]
    table = md_table(["planned step (parts switched off)", "median step ms", "extra us per layer",
                      "the part's us per layer"], rows, nd=1)
    head = (f"Command: `{command_line()}`; {machine_description().get('cpu', '')}; torch {torch.__version__}; "
            f"{args.ablate}, {layers} whitening layers, {steps} steps each, interleaved; load {loadavg()}")
    return _report(head, table, rows, layers, args.json)


#: DDP without its buffer broadcast at every forward: ``forward_sync_buffers=False`` (the buffers are still synced
#: when DDP wraps the model) where DDP has it, else ``broadcast_buffers=False``.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
#: ``--ddp``'s variants: (name, method, planned, DDP's buffer broadcast at every forward).
DDP_VARIANTS = [("plain", None, False, True), ("grad", "grad", True, True), ("grad, not planned", "grad", False, True),
                ("grad, a node per layer", "grad", True, True), ("grad, deferred", "grad", True, True),
                ("recursive", "recursive", True, True), ("recursive, not planned", "recursive", False, True),
                ("plain, no forward buffer sync", None, False, False),
                ("grad, no forward buffer sync", "grad", True, False),
                ("recursive, no forward buffer sync", "recursive", True, False)]


def _one_node_each(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with ``DISTRIBUTED_RUN = 1`` (a weight-gradient node per layer under ``torch.distributed``)."""
    import whitenlayers.layers._base as layers_base

    def stepped() -> None:
        run, layers_base.DISTRIBUTED_RUN = layers_base.DISTRIBUTED_RUN, 1
        try:
            step()
        finally:
            layers_base.DISTRIBUTED_RUN = run

    return stepped


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
        for name, method, planned, broadcast in DDP_VARIANTS:
            model = copy.deepcopy(base) if method is None else wl.convert_model(copy.deepcopy(base), method)
            for _, layer in ([] if method is None or planned else wl.whitening_layers(model)):
                layer.__dict__["_step_plan"] = types.MethodType(_no_plan, layer)
            if method is not None:
                layers = len(wl.whitening_layers(model))
            model.to(memory_format=torch.channels_last)
            sync = {} if broadcast else NO_FORWARD_BUFFER_SYNC
            steppers[name] = _stepper(DistributedDataParallel(model, **sync), x, y, defer=name.endswith("deferred"))
            if name.endswith("a node per layer"):  # each weight through a node of its own, as before runs
                steppers[name] = _one_node_each(steppers[name])
        names = [name for name, _, _, _ in DDP_VARIANTS]
        steps = 5 if args.tiny else 50 * args.blocks
        times = _interleaved(steppers, names, steps, 2 if args.tiny else 50, rotate=True)  # (same order on all ranks)
        medians = {k: statistics.median(t) for k, t in times.items()}
        gathered: List[Dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, medians)
    finally:
        dist.destroy_process_group()
    rows = []
    for name, method, _, broadcast in DDP_VARIANTS:
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
