"""Where a converted ResNet-50's step goes when the GPU waits for the host (issue 30).

On an H100 the plain bf16 ResNet-50 step (batch 128) launches its kernels in ~25 ms of host time against ~33 ms of
GPU time; a converted model adds per-layer host work, and its step can become host-bound. Two parts, one run:

1. **Host time per call** of the operations a whitening layer issues on a step that does not fold, on CUDA with
   small operands (kernels of a few microseconds: the host is the limit), microseconds per call; and of the
   statistics' calls at ResNet-50's real shapes, each call timed alone (does a call's host cost grow with its
   size?).
2. **The step with parts switched off**, ResNet-50 (224 px, batch 128, bf16 autocast, channels_last), variants
   interleaved: plain; recursive as it is; its statistics' column sums as a reduction instead of the product
   ``x^T 1``; its statistics off; its statistics and weight-gradient transform off (what is left is the layer's
   bookkeeping). For each, the median step and host time (until the step's last launch returned) and, from
   ``torch.profiler`` over steps that do not fold, the GPU's busy time per step (the sum of kernel times) and the
   host calls that wait for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy``
   without ``Async``, ``cudaMalloc``, ``cudaFree``) per step, and the host time spent inside the statistics'
   calls (``functional.accumulate_moments``) and inside the weight-gradient transform's backward
   (``functional.transform_weight_grad``) per step: in isolation a statistics call is tens of microseconds; if
   the step's calls add up to much more, the host waits inside them (a full launch queue, a synchronisation).

Switching a part off changes what is computed: these variants exist to attribute time, not to train.

    python benchmarks/gpu_host.py            # on a CUDA machine (~1 minute)
    python benchmarks/gpu_host.py --tiny     # CPU, seconds: the script cannot rot (no meaningful figures)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import copy
import statistics
import time
from typing import Callable, Dict, Iterator, List

from _common import md_table, setup, write_json

import torch
from torch import nn

import whitenlayers as wl
import whitenlayers.autograd as wl_autograd
import whitenlayers.layers._base as layers_base
from _resnet50 import resnet50

F_m = wl.functional.moments

#: The parts the variants switch off (read by the wrappers below at every call).
OFF = {"stats": False, "transform": False, "colsum": False}
#: Host seconds spent inside the statistics' calls and the gradient transform's backward, since the last reset.
SPENT = {"stats": 0.0, "backward": 0.0}
_REAL_ACC = wl.functional.accumulate_moments
_REAL_PRODUCT = F_m._product_add
_REAL_TRANSFORM = layers_base.grad_transformed
_REAL_GRAD = wl_autograd.transform_weight_grad


def _accumulate(acc, x, shift):
    if not OFF["stats"]:
        t0 = time.perf_counter()
        _REAL_ACC(acc, x, shift)
        SPENT["stats"] += time.perf_counter() - t0


def _grad(grad, q):
    t0 = time.perf_counter()
    out = _REAL_GRAD(grad, q)
    SPENT["backward"] += time.perf_counter() - t0
    return out


def _product(out, left, right):
    if OFF["colsum"] and right.dim() == 2 and right.shape[1] == 1:  # the column sums: a reduction and an add
        out.add_(left.sum(1, dtype=out.dtype).unsqueeze(1))
        return
    _REAL_PRODUCT(out, left, right)


def _transform(weight, q):
    return weight if OFF["transform"] else _REAL_TRANSFORM(weight, q)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    wl.functional.accumulate_moments = _accumulate
    F_m._product_add = _product
    layers_base.grad_transformed = _transform
    wl_autograd.transform_weight_grad = _grad
    try:
        yield
    finally:
        wl.functional.accumulate_moments = _REAL_ACC
        F_m._product_add = _REAL_PRODUCT
        layers_base.grad_transformed = _REAL_TRANSFORM
        wl_autograd.transform_weight_grad = _REAL_GRAD


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_per_call(device, tiny: bool) -> List[List[object]]:
    """Microseconds of host time per call, small operands (the device keeps up)."""
    p, m = (64, 16) if tiny else (512, 256)
    lowp = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(p, m, device=device).to(lowp)
    xf = x.float()
    xt = x.t()
    ones = torch.ones(p, 1, device=device, dtype=lowp)
    acc = wl.functional.moments_accumulator(m, device=device)
    s2, s1 = acc[:m, :m], acc[:m, m:]
    c = torch.zeros(m, m, device=device)
    g = torch.randn(64, m * 9 if not tiny else m, device=device)
    q = torch.randn(g.shape[1], g.shape[1], device=device) if tiny else torch.randn(m, m, device=device)
    g3 = g.view(64 * (g.shape[1] // q.shape[0]), q.shape[0])
    v = torch.randn(m, device=device)
    mat = torch.randn(64, m, device=device)
    ops: Dict[str, Callable[[], object]] = {
        "elementwise add_ (reference)": lambda: v.add_(1.0),
        "addmm, bf16 in, out_dtype=float32, into the (M, M) block (x^T x)": lambda: torch.addmm(
            s2, xt, x, out_dtype=torch.float32, out=s2),
        "addmm, bf16 in, out_dtype=float32, contiguous out": lambda: torch.addmm(
            c, xt, x, out_dtype=torch.float32, out=c),
        "mm, bf16 in, out_dtype=float32 (new tensor)": lambda: torch.mm(xt, x, out_dtype=torch.float32),
        "addmm, bf16 in, out_dtype=float32, N = 1 (x^T 1)": lambda: torch.addmm(
            s1, xt, ones, out_dtype=torch.float32, out=s1),
        "sum(0, dtype=float32) + add_ (column sums, two kernels)": lambda: s1.add_(
            x.sum(0, dtype=torch.float32).unsqueeze(1)),
        "addmm_ float32 (x^T x)": lambda: c.addmm_(xf.t(), xf),
        "cat with a ones column": lambda: torch.cat([x, ones], 1),
        "mm float32 (weight-gradient transform, (O*9, M) @ (M, M))": lambda: torch.mm(g3, q),
        "addmv_ (absorbed offset)": lambda: v.addmv_(mat.t(), mat[:, 0]),
        "accumulate_moments (library, bf16 rows)": lambda: wl.functional.accumulate_moments(acc, x, None),
    }
    if device.type != "cuda":  # no low-precision product with out_dtype on the CPU
        ops = {k: fn for k, fn in ops.items() if "out_dtype" not in k}
    n = 20 if tiny else 2000
    rows = []
    for name, fn in ops.items():
        try:
            for _ in range(20):
                fn()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            sync(device)
            t2 = time.perf_counter()
            rows.append([name, 1e6 * (t1 - t0) / n, 1e6 * (t2 - t0) / n])
        except Exception as exc:  # noqa: BLE001 - keep the others
            rows.append([name, f"n/a: {exc!r}"[:100], ""])
    return rows


def host_at_real_shapes(device, tiny: bool) -> List[List[object]]:
    """Host microseconds of one statistics call at ResNet-50's real shapes (batch 128), each call timed alone
    (median of 40, no synchronisation between them: the launch queue never fills), beside the GPU time per call:
    whether the host cost of a call depends on its size (a cuBLAS heuristic, a workspace), which small operands
    cannot show."""
    shapes = [(401408, 64), (401408, 256), (100352, 128), (25088, 1024), (6272, 2048)]
    if tiny:
        shapes = [(256, 8), (64, 32)]
    lowp = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for p, m in shapes:
        x = (torch.randn(p, m, device=device).relu() + 0.1).to(lowp)
        ones = torch.ones(p, 1, device=device, dtype=lowp)
        acc = wl.functional.moments_accumulator(m, device=device)
        s2, s1 = acc[:m, :m], acc[:m, m:]
        calls = {"accumulate_moments": lambda: wl.functional.accumulate_moments(acc, x, None),
                 "x^T x (addmm into the block)": lambda: F_m._product_add(s2, x.t(), x),
                 "x^T 1 (addmm, N = 1)": lambda: F_m._product_add(s1, x.t(), ones)}
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            sync(device)
            host = []
            t_all = time.perf_counter()
            for _ in range(40):
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
            sync(device)
            wall = (time.perf_counter() - t_all) / 40
            rows.append([p, m, name, 1e6 * statistics.median(host), 1e6 * max(host), 1e3 * wall])
    return rows


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMalloc", "cudaFree",
         "cudaEventSynchronize")


def step_parts(device, tiny: bool, rounds: int, trace: str = "") -> List[List[object]]:
    cuda = device.type == "cuda"
    hw, batch, width = (32, 2, 4) if tiny else (224, 128, 64)
    base = resnet50(width)
    variants: Dict[str, nn.Module] = {"plain": copy.deepcopy(base)}
    settings = {"recursive": {}, "recursive, column sums by reduction": {"colsum": True},
                "recursive, statistics off": {"stats": True},
                "recursive, statistics and gradient transform off": {"stats": True, "transform": True}}
    for name in settings:
        variants[name] = wl.convert_model(copy.deepcopy(base), method="recursive")
    opts = {}
    for k, mdl in variants.items():
        mdl.to(device)
        if cuda:
            mdl.to(memory_format=torch.channels_last)
        mdl.train()
        opts[k] = torch.optim.SGD(mdl.parameters(), lr=0.01, momentum=0.9)

    def batch_():
        x = torch.randn(batch, 3, hw, hw, device=device)
        if cuda:
            x = x.to(memory_format=torch.channels_last)
        return x, torch.randint(0, 1000, (batch,), device=device)

    def step(k):
        OFF.update(stats=False, transform=False, colsum=False)
        OFF.update(settings.get(k, {}))
        x, y = batch_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = nn.functional.cross_entropy(variants[k](x), y)
        opts[k].zero_grad(set_to_none=True)
        loss.backward()
        opts[k].step()

    times: Dict[str, List[float]] = {k: [] for k in variants}
    host: Dict[str, List[float]] = {k: [] for k in variants}
    inside: Dict[str, List[List[float]]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds + 2):
        for k in names[r % len(names):] + names[: r % len(names)]:
            sync(device)
            SPENT.update(stats=0.0, backward=0.0)
            t0 = time.perf_counter()
            step(k)
            t1 = time.perf_counter()
            sync(device)
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
                host[k].append(t1 - t0)
                inside[k].append([SPENT["stats"], SPENT["backward"]])
    busy: Dict[str, float] = {}
    waits: Dict[str, float] = {}
    if cuda:
        from torch.profiler import ProfilerActivity, profile
        for k in names:
            layers = [mdl for _, mdl in wl.whitening_layers(variants[k])]
            n = 0
            kernel_us = 0.0
            wait_calls = 0
            for _ in range(6):
                if layers and layers[0].batches_in_block == layers[0].config.block_size - 1:
                    step(k)  # this step folds: not profiled
                    continue
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step(k)
                    sync(device)
                n += 1
                if trace and k in ("plain", "recursive"):  # the last profiled step: a timeline to open in Perfetto
                    prof.export_chrome_trace(os.path.join(trace, f"trace_{k}.json"))
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        kernel_us += e.device_time
                    elif any(e.name.startswith(w) and not e.name.startswith("cudaMemcpyAsync") for w in WAITS):
                        wait_calls += 1
            busy[k] = kernel_us / 1e3 / max(n, 1)
            waits[k] = wait_calls / max(n, 1)
    plain = statistics.median(times["plain"])
    rows = []
    for k in names:
        med = statistics.median(times[k])
        rows.append([k, 1e3 * med, med / plain, 1e3 * statistics.median(host[k]), busy.get(k, float("nan")),
                     waits.get(k, float("nan")), 1e3 * statistics.median(v[0] for v in inside[k]),
                     1e3 * statistics.median(v[1] for v in inside[k])])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU, seconds: no meaningful figures")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the tables here")
    p.add_argument("--trace", default="", help="a folder: write a chrome trace of one step that does not fold, "
                                               "plain and recursive (CUDA only)")
    args = p.parse_args()
    setup(args.threads, 0)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "CPU (tiny: no meaningful figures)"
    print(f"device: {name}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    if not cuda:  # the CPU takes CUDA's statistics path (every path the GPU runs, covered)
        wl.functional.fused_moments(True).__enter__()
    with patched():
        calls = md_table(["op", "host us per call", "wall us per call (device included)"],
                         host_per_call(device, not cuda), nd=1)
        print(f"\n### host time per call\n\n{calls}", flush=True)
        real = md_table(["rows P", "features M", "call", "host us (median)", "host us (max)",
                         "wall ms per call (device included)"], host_at_real_shapes(device, not cuda), nd=1)
        print(f"\n### host time per statistics call at ResNet-50's shapes\n\n{real}", flush=True)
        parts = md_table(["variant", "median step ms", "vs plain", "median host ms", "GPU busy ms per step",
                          "waiting host calls per step", "host ms in the statistics' calls",
                          "host ms in the gradient transform's backward"], step_parts(device, not cuda, 1 if not cuda else args.rounds, args.trace),
                         nd=2)
        print(f"\n### ResNet-50 step with parts switched off (recursive, defaults)\n\n{parts}", flush=True)
    write_json(args.json, {"device": name, "torch": torch.__version__,
                           "markdown": f"{calls}\n\n{real}\n\n{parts}"})


if __name__ == "__main__":
    main()
