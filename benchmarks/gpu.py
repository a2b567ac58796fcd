"""GPU checks in one short script: run it whenever a GPU is at hand (under 5 minutes).

On CUDA:

1. the central equivalence property in float64 on the GPU (a ``GradWhitenConv2d`` with weights ``W T``
   trained by SGD with momentum equals ``ZeroPad2d -> DirectWhiten -> Conv2d`` with weights ``W``);
2. a bf16-autocast smoke test (a converted ResNet trains finitely; statistics and transforms stay fp32);
3. no host synchronisation on the per-batch path (``torch.cuda.set_sync_debug_mode("error")`` around
   training steps that do not end a block);
4. training-step time and peak-memory ratios vs the plain model, interleaved: ResNet-50 (the torchvision
   layout, ``_resnet50.py``; 224x224, batch 128 (``--batch``), channels_last, bf16 autocast) and CIFAR
   ResNet-110 (batch 128, fp32); grad, recursive, direct with defaults, grad and recursive with the
   GPU-recommended settings (``stats_every=5, block_size=50``), recursive with statistics on every forward from
   a quarter of its samples (``stats_fraction=0.25, block_size=50``), the bare statistics pass (the floor of
   gathering statistics on every step), Muon and SOAP (pytorch-optimizer, when installed). The timed rounds
   start after ``--warmup`` untimed ones (52: past every variant's first block, whose statistics are summed about
   a shift in float32, a transient of the first 10 or 50 steps); with ``--rounds`` a multiple of 50 each
   variant's mean step holds its folds in proportion (one per block), the median step is one without a fold;
5. one fold of each model (all its whitening layers), EVD and recursive;
6. CUDA kernels launched per training step (``torch.profiler``), plain vs each method on CIFAR ResNet-20,
   averaged over one whole block (its fold included) and over the steps that do not fold: the GPU form of
   ``hot_path.py``'s op count.

It prints a Markdown table with the device name, torch and CUDA versions, for benchmarks/RESULTS.md.
Without CUDA it runs the same checks on the CPU in a ``--tiny`` configuration (CI: the script cannot
rot); check 3 is CUDA-only.

    python benchmarks/gpu.py            # on a CUDA machine
    python benchmarks/gpu.py --skip compile,kernels --rounds 50    # the step table alone
    python benchmarks/gpu.py --tiny     # CPU, seconds

The suite runs it as ``python benchmarks/bench.py gpu`` (``-- OPTIONS`` for the options above).
"""
# ruff: noqa: B023, E501, E731  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from _common import add_common_args, kwargs_for, md_table, setup, write_json
from _resnet50 import resnet50
from torch import nn

import whitenlayers as wl
from whitenlayers.fold import fold_layers


def sync(device: torch.device) -> None:
    """Wait for this thread's stream, as a training loop's ``loss.item()`` does: a ``fold_async`` fold on its own
    stream goes on over the next steps, as it does in training (a device-wide synchronisation would wait
    for it at every step)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def check_equivalence(device: torch.device) -> float:
    """Max |difference| of outputs after 5 SGD steps, grad layer vs pad -> DirectWhiten -> conv, float64."""
    torch.manual_seed(0)
    dt = torch.float64
    c_in, c_out = 6, 5
    x0 = (torch.randn(64, c_in, 8, 8, dtype=dt) * torch.linspace(0.5, 3, c_in, dtype=dt).view(1, -1, 1, 1) + 1).to(device)
    direct = wl.DirectWhiten(c_in, block_size=1, device=device, dtype=dt)
    direct(x0)  # one fold: T != I
    direct.eval()
    w = torch.randn(c_out, c_in, 3, 3, dtype=dt, device=device) * 0.1
    ref = nn.Sequential(nn.ZeroPad2d(1), direct, nn.Conv2d(c_in, c_out, 3, bias=False, device=device, dtype=dt))
    ref[2].weight.data.copy_(w)
    grad = wl.GradWhitenConv2d(c_in, c_out, 3, padding=1, bias=False, block_size=1, device=device, dtype=dt,
                               gains=direct.gains)
    with torch.no_grad():  # the same statistics, frozen: mu, T and Q_s = T^T T (bias_correction stays 0)
        grad.running_mean.copy_(direct.running_mean)
        grad.whitening_matrix.copy_(direct.whitening_matrix)
        grad.grad_transform.copy_(direct.whitening_matrix.t() @ direct.whitening_matrix)
        grad.weight.copy_(torch.einsum("oikl,ij->ojkl", w, direct.whitening_matrix))
    grad.freeze()
    opt_a = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(grad.parameters(), lr=0.05, momentum=0.9)
    worst = 0.0
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = (torch.randn(16, c_in, 8, 8, generator=g, dtype=dt) + 1).to(device)
        ya, yb = ref(x), grad(x)
        worst = max(worst, (ya - yb).abs().max().item())
        for y, opt in ((ya, opt_a), (yb, opt_b)):
            opt.zero_grad()
            y.square().mean().backward()
            opt.step()
    return worst


def _train_autocast(model: nn.Module, device: torch.device, dtype: torch.dtype, steps: int = 4) -> None:
    """A few SGD steps on random 16x16 batches under autocast to ``dtype``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        x = torch.randn(16, 3, 16, 16, device=device)
        y = torch.randint(0, 10, (16,), device=device)
        with torch.autocast(device.type, dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def check_autocast(device: torch.device, tiny: bool) -> Dict[str, object]:
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8 if tiny else 20, width=8 if tiny else 16), block_size=2).to(device)
    _train_autocast(model, device, dtype)
    layers = [m for _, m in wl.whitening_layers(model)]
    fp32 = all(m.whitening_matrix.dtype == torch.float32 and m.running_cov.dtype == torch.float32 for m in layers)
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return {"fp32_state": fp32, "finite": finite, "blocks": int(layers[0].num_blocks)}


def check_patch_stem(device: torch.device) -> str:
    """A converted ResNet with a patch-whitened stem (features="patches") trains finitely under bf16 autocast."""
    torch.manual_seed(0)
    model = wl.convert_model(wl.models.cifar_resnet(8, width=8), block_size=2, include_stem=True,
                             stem_patches=True).to(device)
    _train_autocast(model, device, torch.bfloat16)
    stem = model.conv1
    ok = bool(torch.isfinite(stem.whitening_matrix).all()) and int(stem.num_blocks) == 2
    return f"{'ok' if ok else 'FAILED'}: {stem.num_features} patch features, {int(stem.num_blocks)} blocks"


def check_no_sync(device: torch.device) -> str:
    if device.type != "cuda":
        return "skipped (CUDA only)"
    model = wl.convert_model(wl.models.cifar_resnet(20), block_size=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(32, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (32,), device=device)

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()  # first block: the shift is chosen on the device, but warm up allocators first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):  # batches 2..6 of a block of 10: no fold among them
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "ok: no synchronisation in 5 non-folding steps"


#: The GPU-recommended settings (statistics on one forward in five, blocks of 50).
RECOMMENDED = {"stats_every": 5, "block_size": 50}


class BareStatistics:
    """The floor of gathering statistics: a forward pre-hook on every conv ``convert_model`` would convert that
    adds ``X^T X`` (the input as it comes, bf16 under autocast, one product) and the column sums to float32
    buffers, every step, eager, unfused. No transform, no fold."""

    def __init__(self, model: nn.Module) -> None:
        self.handles = [conv.register_forward_pre_hook(self._hook) for _, conv in _target_convs(model)]

    @staticmethod
    def _hook(module: nn.Module, args) -> None:
        x = args[0].detach()
        rows = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        s2 = getattr(module, "_bare_s2", None)
        if s2 is None:
            module._bare_s2 = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            module._bare_s1 = torch.zeros(x.shape[1], device=x.device)
            s2 = module._bare_s2
        s2.add_((rows.t() @ rows).float())
        module._bare_s1.add_(rows.sum(0).float())


def _target_convs(model: nn.Module):
    """The convs ``convert_model`` would convert by default (those inside residual blocks)."""
    probe = wl.convert_model(copy.deepcopy(model), "grad")
    names = {n for n, _ in wl.whitening_layers(probe)}
    return [(n, m) for n, m in model.named_modules() if n in names]


def optimizer_for(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, or the peer optimizers (pytorch-optimizer 4.x: Muon with AdamW on the rest, SOAP with
    its preconditioner updated every 10 steps), as the runner builds them."""
    if name in ("muon", "soap"):
        from whitenlayers.experiment.peers import library_optimizer
        opts = {"precondition_frequency": 10} if name == "soap" else {}
        return library_optimizer(name, model, lr=0.02 if name == "muon" else 3e-3, options=opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name.endswith(":deferred"):  # the weight-gradient transform in a hook on each weight (wl.defer_grad_transform)
        wl.defer_grad_transform(model, opt)
    return opt


def timed_steps(variants: Dict[str, nn.Module], make_batch: Callable, device, rounds: int, autocast_dtype,
                host: Optional[Dict[str, List[float]]] = None, warmup: int = 2) -> Dict[str, List[float]]:
    """Seconds per step (the device idle at its start, synchronised at its end), variants interleaved, after
    ``warmup`` untimed rounds. ``host``: filled with each step's host time, the time until the step's last launch
    returned (before the final synchronisation): about the step time where the step is host-bound, below it where
    the device is the limit."""
    opts = {k: optimizer_for(k, m) for k, m in variants.items()}
    times: Dict[str, List[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds + warmup):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            x, y = make_batch()
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = nn.functional.cross_entropy(variants[k](x), y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            t_host = time.perf_counter()
            sync(device)
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
                if host is not None:
                    host.setdefault(k, []).append(t_host - t0)
    return times


def peak_memory(model: nn.Module, make_batch: Callable, device, autocast_dtype, name: str = "plain") -> float:
    if device.type != "cuda":
        return float("nan")
    opt = optimizer_for(name, model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    x, y = make_batch()
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated(device))


def fold_time(model: nn.Module, device) -> float:
    layers = [m for _, m in wl.whitening_layers(model)]
    for m in layers:
        m.accumulate(torch.randn(4 * m.num_features + 8, m.num_features, device=device).abs())
    sync(device)
    t0 = time.perf_counter()
    fold_layers(layers)
    sync(device)
    return time.perf_counter() - t0


def kernel_counts(device: torch.device, tiny: bool) -> List[List[object]]:
    """CUDA kernels (memsets and copies included) per training step of CIFAR ResNet-20, batch 128."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    block = 10
    base = wl.models.cifar_resnet(20)
    variants = {"plain": copy.deepcopy(base)}
    for method in ("grad", "recursive", "direct"):
        variants[method] = wl.convert_model(copy.deepcopy(base), method=method, block_size=block)
    variants["grad:every5"] = wl.convert_model(copy.deepcopy(base), method="grad", block_size=block, stats_every=5)
    x = torch.randn(128, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (128,), device=device)
    rows: List[List[object]] = []
    plain = {}
    for k, model in variants.items():
        model.to(device).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        n_layers = len(list(wl.whitening_layers(model)))

        def step():
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(block):  # one whole block: the first fold is behind us
            step()
        torch.cuda.synchronize()
        per_step = []
        for _ in range(block):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            per_step.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
        whole = statistics.mean(per_step)
        quiet = statistics.median(per_step)  # the steps without a fold (9 of 10)
        if k == "plain":
            plain = {"whole": whole, "quiet": quiet}
        extra = (lambda a, b: (a - b) / n_layers if n_layers else float("nan"))
        rows.append([k, n_layers, whole, quiet, extra(whole, plain["whole"]), extra(quiet, plain["quiet"])])
    return rows


#: The columns of :func:`step_table`'s rows. The median step is one without a fold; its host time is the time the
#: host took to launch it (close to the median step: the step is host-bound; well below: the device is the limit).
STEP_COLUMNS = ["model", "variant", "mean step ms", "step vs plain", "peak memory vs plain", "one fold ms",
                "median step ms", "median host ms"]


def step_table(name: str, base: nn.Module, make_batch: Callable, device, rounds: int, autocast_dtype,
               memory_format=None, warmup: int = 2, only: Sequence[str] = ()) -> List[List[object]]:
    """The step table's rows (:data:`STEP_COLUMNS`) for the variants below (``only``: these and plain)."""
    variants = {"plain": copy.deepcopy(base)}
    for method in ("grad", "recursive", "direct"):
        variants[method] = wl.convert_model(copy.deepcopy(base), method=method)
    for method in ("grad", "recursive"):
        variants[f"{method}:every5,block50"] = wl.convert_model(copy.deepcopy(base), method=method, **RECOMMENDED)
    # the weight-gradient transform in a hook on each weight, not in a Python autograd node per layer and
    # forward: defaults otherwise (optimizer_for defers it by the name)
    for method in ("grad", "recursive"):
        variants[f"{method}:deferred"] = wl.convert_model(copy.deepcopy(base), method=method)
    # No fold_async rows: the variants are interleaved step by step, so a worker's fold in flight would run during
    # the other variants' steps (on the H200 that made grad:async look 1.72x and recursive:async slower, against
    # fold_async.py's 2.34x, which times each variant alone for whole blocks: use that one).
    bare = copy.deepcopy(base)
    BareStatistics(bare)
    variants["bare statistics pass (floor)"] = bare
    try:
        import pytorch_optimizer  # noqa: F401
        variants["muon"] = copy.deepcopy(base)
        variants["soap"] = copy.deepcopy(base)
    except ImportError:
        pass
    if only:
        variants = {k: v for k, v in variants.items() if k == "plain" or k in only}
    for m in variants.values():
        m.to(device)
        if memory_format is not None:
            m.to(memory_format=memory_format)
        m.train()
    host: Dict[str, List[float]] = {}
    times = timed_steps(variants, make_batch, device, rounds, autocast_dtype, host, warmup)
    base_mean = statistics.mean(times["plain"])
    mem_plain = peak_memory(variants["plain"], make_batch, device, autocast_dtype)
    rows = []
    for k, v in times.items():
        folds = {}
        if wl.whitening_layers(variants[k]) and not k.startswith("direct"):
            folds[k] = fold_time(variants[k], device)
        mem = peak_memory(variants[k], make_batch, device, autocast_dtype, k)
        rows.append([name, k, 1e3 * statistics.mean(v), statistics.mean(v) / base_mean,
                     mem / mem_plain if mem_plain == mem_plain else float("nan"),
                     1e3 * folds[k] if k in folds else float("nan"),
                     1e3 * statistics.median(v), 1e3 * statistics.median(host[k])])
    return rows


def compiled_table(device: torch.device, tiny: bool, rounds: int,
                   names=("plain", "grad", "recursive", "direct"), modes=None,
                   model_name: str = "resnet20", batch50: int = 128) -> List[List[object]]:
    """``torch.compile`` of plain and converted CIFAR ResNet-20 (default mode; on CUDA also ``reduce-overhead``):
    first-step (compile) time, steady step time vs the compiled plain model, host time per step (until the step is
    queued), dynamo's unique graphs. Tiny mode compiles with the ``eager`` backend (dynamo only: the path is
    covered, the figures mean nothing).
    ``model_name="resnet50"``: the ResNet-50 of the step table instead (224 px, ``batch50``, channels_last, bf16
    autocast on CUDA): whether CUDA graphs (``reduce-overhead``) take back a host-bound converted step."""
    from torch._dynamo.utils import counters

    if modes is None:
        modes = ["default", "reduce-overhead"] if device.type == "cuda" else ["default"]
    backend = "eager" if tiny else "inductor"
    big = model_name == "resnet50"
    cuda = device.type == "cuda"
    if big:
        batch, hw = (2, 32) if tiny else (batch50, 224)
        base = resnet50(4 if tiny else 64)
        classes = 1000
    else:
        batch, hw = (8 if tiny else 128), 32
        base = wl.models.cifar_resnet(8 if tiny else 20)
        classes = 10
    x = torch.randn(batch, 3, hw, hw, device=device)
    if big and cuda:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    autocast = big and cuda
    rows: List[List[object]] = []
    for mode in modes:
        plain_step = plain_mean = float("nan")
        for name in names:
            model = copy.deepcopy(base) if name == "plain" else wl.convert_model(copy.deepcopy(base), method=name,
                                                                                 **kwargs_for(name))
            model.to(device).train()
            if big and cuda:
                model.to(memory_format=torch.channels_last)
            torch._dynamo.reset()
            counters.clear()
            kw = {"backend": backend} if tiny else {"mode": None if mode == "default" else mode}
            compiled = torch.compile(model, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = nn.functional.cross_entropy(compiled(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            first = time.perf_counter() - t0
            for _ in range(12):  # a whole block (10) and more: the first fold between replays
                step()
            times, host = [], []
            for _ in range(max(rounds, 3) * 5):
                sync(device)
                t0 = time.perf_counter()
                step()
                host.append(time.perf_counter() - t0)  # until the host has queued the step (CUDA graphs: replays)
                sync(device)
                times.append(time.perf_counter() - t0)
            med, mean = statistics.median(times), statistics.mean(times)
            if name == "plain":
                plain_step, plain_mean = med, mean
            # the mean takes in the steps that fold and those after a fold (where CUDA graph trees would record
            # again if a buffer had moved); the median is a step that does neither
            rows.append([mode + (" (eager backend)" if tiny else ""), name, first, 1e3 * med, med / plain_step,
                         1e3 * mean, mean / plain_mean, 1e3 * statistics.median(host),
                         counters["stats"]["unique_graphs"]])
            # each row as it is measured: a run cut short by its timeout keeps what it had
            print("compiled row:", " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]),
                  flush=True)
    return rows


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=RECOMMENDED["block_size"] + 2,
                   help="untimed rounds first: past every variant's first block (its statistics are summed about a "
                        "shift, in float32: a transient, not the steady state; 2 measures it)")
    p.add_argument("--batch", type=int, default=128, help="ResNet-50's batch (default 128)")
    p.add_argument("--compile-variants", default="plain,grad,recursive,direct", help="variants of the compiled table")
    p.add_argument("--compile-modes", default="", help="torch.compile modes (default: default,reduce-overhead on CUDA)")
    p.add_argument("--compile-model", default="resnet20", choices=["resnet20", "resnet50"],
                   help="the compiled table's model: CIFAR ResNet-20, or ResNet-50 as in the step table (bf16)")
    p.add_argument("--skip", help="comma-separated sections to skip: resnet50, resnet110, kernels, compile (tiny: "
                                  "resnet110, resnet50's code again, and compile, which a test of its own runs)")
    p.add_argument("--variants", default="", help="the step tables' variants, separated by ';' (their names hold "
                   "commas), e.g. 'grad;grad:every5,block50' (plain always; default: all)")
    args = p.parse_args(argv)
    only = tuple(v for v in args.variants.split(";") if v)
    setup(args.threads, args.seed)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda
    if tiny:  # the CPU takes the statistics' two-op path, as CUDA does: every path the GPU runs, covered
        wl.functional.fused_moments(True).__enter__()
    header = {
        "device": torch.cuda.get_device_name(0) if cuda else "CPU (tiny mode: no meaningful figures)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else "n/a",
    }
    print(f"device: {header['device']}; torch {header['torch']}; CUDA {header['cuda']}")
    diff = check_equivalence(device)
    ac = check_autocast(device, tiny)
    failed = diff > 1e-9 or not (ac["fp32_state"] and ac["finite"])
    checks = [["float64 equivalence (max |diff| after 5 SGD steps; must be < 1e-9)", f"{diff:.2e}"]]
    checks.append(["bf16 autocast: fp32 statistics / finite / blocks", f"{ac['fp32_state']} / {ac['finite']} / {ac['blocks']}"])
    patch = check_patch_stem(device)
    failed = failed or not patch.startswith("ok")
    checks.append(["patch-whitened stem under bf16 autocast", patch])
    checks.append(["no host sync on the per-batch path", check_no_sync(device)])
    rows: List[List[object]] = []
    rounds = 1 if tiny else args.rounds
    warmup = 2 if tiny else args.warmup
    skip = {s for s in (args.skip if args.skip is not None else "resnet110,compile" if tiny else "").split(",") if s}
    if tiny:
        hw, batch, width = 32, 2, 4
    else:
        hw, batch, width = 224, args.batch, 64
    classes = 1000

    def batch50():
        x = torch.randn(batch, 3, hw, hw, device=device)
        if cuda:
            x = x.to(memory_format=torch.channels_last)
        return x, torch.randint(0, classes, (batch,), device=device)

    if "resnet50" not in skip:
        rows += step_table("ResNet-50" + (" (tiny)" if tiny else f", {hw}px, batch {batch}, bf16, channels_last"),
                           resnet50(width), batch50, device, rounds, torch.bfloat16 if cuda else None,
                           torch.channels_last if cuda else None, warmup, only)
        print(md_table(STEP_COLUMNS,
                       rows, nd=3), flush=True)
    b110 = 8 if tiny else 128

    def batch110():
        return torch.randn(b110, 3, 32, 32, device=device), torch.randint(0, 100, (b110,), device=device)

    if "resnet110" not in skip:
        rows += step_table("CIFAR ResNet-" + ("8 (tiny)" if tiny else "110, batch 128, fp32"),
                           wl.models.cifar_resnet(8 if tiny else 110, num_classes=100), batch110, device, rounds, None,
                           warmup=warmup, only=only)
    table = md_table(STEP_COLUMNS, rows, nd=3)
    parts = [f"Device: {header['device']}; torch {header['torch']}; CUDA {header['cuda']}", "",
             md_table(["check", "result"], checks), "", table]
    try:
        kernels = [] if "kernels" in skip else kernel_counts(device, tiny)
    except Exception as exc:  # the profiler is optional: keep the checks and timings above
        print(f"kernel count failed: {exc!r}")
        kernels = []
    if kernels:
        parts += ["", md_table(["CIFAR ResNet-20, batch 128, block 10", "whitening layers", "kernels/step (block mean)",
                                "kernels/step (median: no fold)", "extra per layer (block mean)",
                                "extra per layer (no fold)"], kernels, nd=1)]
    compiled = [] if "compile" in skip else compiled_table(
        device, tiny, rounds, tuple(args.compile_variants.split(",")),
        args.compile_modes.split(",") if args.compile_modes else None, args.compile_model, batch)
    if compiled:
        parts += ["", f"torch.compile of {args.compile_model}", "",
                  md_table(["torch.compile mode", "variant", "first step s", "median step ms", "step vs compiled plain",
                            "mean step ms (folds included)", "mean vs compiled plain", "median host ms",
                            "unique graphs"],
                           compiled, nd=3)]
    text = "\n".join(parts)
    print(text)
    out = {**header, "checks": checks, "rows": rows, "kernels": kernels, "compiled": compiled, "markdown": text}
    write_json(args.json, out)
    if failed:
        raise SystemExit("gpu.py: a correctness check failed (see the table above)")
    return out


if __name__ == "__main__":
    main()
