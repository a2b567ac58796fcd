"""Design probes for the GPU hot path (issue 30): what the device's torch offers and what each lever costs.

Run on a CUDA machine (seconds to a minute); it prints one Markdown section per probe:

1. **Statistics on tensor cores**: whether ``torch.mm`` / ``torch.addmm`` take ``out_dtype=torch.float32`` for
   bf16 operands on this torch, their error against a float64 reference, and the time of one layer's statistics
   for ResNet-50's layer shapes at batch 128: the batch with a column of ones in one product (float32 SIMT,
   TF32, bf16 operands with float32 output: the library's path before), the library's
   (``functional.accumulate_moments`` into ``moments_accumulator``: ``x^T x`` and ``x^T 1``, no copy), each of
   its two products alone, the column sums as a reduction instead, the batch padded to 8 features, a
   shifted batch (converted to float32: eager layers), and a compiled layer's split of a shifted batch
   (``functional.accumulate_moments_split``: two bf16 numbers per float32 difference, two tensor-core products),
   eagerly and under inductor.
2. **The EVD fold**: ``torch.linalg.eigh`` of ResNet-50's 52 covariances (batched by width, as ``fold.py`` does)
   on CUDA in float32 and float64, on the host in float64 and float32 (all host threads), and a coupled
   Newton-Schulz inverse square root (10 and 20 iterations, float32 / TF32) for comparison.
3. **Overlap**: plain ResNet-50 training steps (bf16, batch 128, channels_last) alone, and while a worker
   thread runs the fold's ``eigh`` (a) on the host in float64, (b) on CUDA on a side stream: the step time
   and how long the fold took meanwhile. It says whether a fold off the critical path slows training.

    python benchmarks/gpu_probe.py            # on a CUDA machine
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Callable, Dict, List, Tuple

from _common import md_table, setup

import torch
from torch import nn

import whitenlayers as wl
from _resnet50 import resnet50


def layer_shapes(batch: int) -> List[Tuple[int, int]]:
    """(rows P, features M) of each whitening layer's statistics in a converted ResNet-50 at ``batch``."""
    model = wl.convert_model(resnet50(64), "grad")
    shapes: List[Tuple[int, int]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: shapes.append((a[0].shape[0] * a[0].shape[2] * a[0].shape[3],
                                                                        a[0].shape[1])))
             for _, m in wl.whitening_layers(model)]
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    return [(p * batch, m) for p, m in shapes]


def cuda_ms(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def probe_out_dtype(dev) -> List[List[object]]:
    rows = []
    a = torch.randn(4096, 257, device=dev).bfloat16()
    ref = a.double().t() @ a.double()
    for name, fn in (("mm(out_dtype=f32)", lambda: torch.mm(a.t(), a, out_dtype=torch.float32)),
                     ("addmm(out_dtype=f32)", lambda: torch.addmm(torch.zeros(257, 257, device=dev), a.t(), a,
                                                                  out_dtype=torch.float32))):
        try:
            out = fn()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            rows.append([name, str(out.dtype), f"{err:.2e}"])
        except Exception as exc:  # noqa: BLE001 - a probe: report what failed
            rows.append([name, "FAILED", repr(exc)[:120]])
    acc = torch.zeros(257, 257, device=dev)
    try:
        torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
        err = ((acc.double() - 2 * ref).norm() / (2 * ref).norm()).item()
        rows.append(["addmm(acc, out=acc, out_dtype=f32) twice", "float32", f"{err:.2e}"])
    except Exception as exc:  # noqa: BLE001
        rows.append(["addmm(acc, out=acc, out_dtype=f32)", "FAILED", repr(exc)[:120]])
    return rows


def probe_stats(dev, shapes) -> List[List[object]]:
    rows = []
    ones_cache: Dict[Tuple[int, torch.dtype], torch.Tensor] = {}
    seen = set()
    keys = ("f32", "tf32", "cat", "lib", "gram", "colmm", "colsum", "padded", "shifted", "split")
    total = dict.fromkeys(keys, 0.0)
    for p, m in shapes:
        x = (torch.randn(p, m, device=dev).relu() + 0.1).bfloat16()
        acc = torch.zeros(m + 1, m + 1, device=dev)  # contiguous: rows of M + 1 elements
        lib_acc = wl.functional.moments_accumulator(m, device=dev)  # the layers' accumulator: aligned rows
        s2, s1 = lib_acc[:m, :m], lib_acc[:m, m:]

        def ones(dt):
            key = (p, dt)
            if key not in ones_cache:
                ones_cache[key] = torch.ones(p, 1, device=dev, dtype=dt)
            return ones_cache[key]

        def f32():
            a = torch.cat([x.float(), ones(torch.float32)], 1)
            acc.addmm_(a.t(), a)

        def cat():  # the library before: the batch with a column of ones, one (M + 1) x (M + 1) product
            a = torch.cat([x, ones(torch.bfloat16)], 1)
            torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)

        def lib():  # the library's path (functional.accumulate_moments)
            wl.functional.accumulate_moments(lib_acc, x, None)

        shift = x[:1024].float().mean(0, keepdim=True)

        def lib_shifted():  # a layer that sums about a shift (its block's mean^2 > 7 var): converted to float32 first
            wl.functional.accumulate_moments(lib_acc, x, shift)

        shift4 = shift.view(1, m)

        def split():  # a compiled layer's path for a shifted bf16 batch, run eagerly (its kernels unfused)
            wl.functional.accumulate_moments_split(lib_acc, x, shift4)

        def gram():  # the library's first product alone: x^T x into the aligned (M, M) block
            torch.addmm(s2, x.t(), x, out_dtype=torch.float32, out=s2)

        def colmm():  # its second: the column sums as x^T 1 (a product with N = 1)
            torch.addmm(s1, x.t(), ones(torch.bfloat16), out_dtype=torch.float32, out=s1)

        def colsum():  # the alternative: a column reduction and an add (two kernels)
            s1.add_(x.sum(0, dtype=torch.float32).unsqueeze(1))

        mp = (m + 1 + 7) // 8 * 8
        acc_p = torch.zeros(mp, mp, device=dev)
        tail = torch.zeros(p, mp - m, device=dev, dtype=torch.bfloat16)
        tail[:, 0] = 1  # a feature of ones, then zero features up to a multiple of 8

        def padded():  # zero features appended up to a multiple of 8: an (M' x M') product, a few % more work
            a = torch.cat([x, tail], 1)
            torch.addmm(acc_p, a.t(), a, out_dtype=torch.float32, out=acc_p)

        got = {"f32": cuda_ms(f32, 5)}
        torch.backends.cuda.matmul.allow_tf32 = True
        got["tf32"] = cuda_ms(f32, 5)
        torch.backends.cuda.matmul.allow_tf32 = False
        for key, fn in (("cat", cat), ("lib", lib), ("gram", gram), ("colmm", colmm), ("colsum", colsum),
                        ("padded", padded), ("shifted", lib_shifted), ("split", split)):
            try:
                got[key] = cuda_ms(fn, 5)
            except Exception as exc:  # noqa: BLE001
                got[key] = float("nan")
                print(f"stats probe {key} (P={p}, M={m}) failed: {exc!r}"[:400], flush=True)
        for key in keys:
            total[key] += got[key]
        if (p, m) not in seen:
            seen.add((p, m))
            rows.append([p, m] + [got[k] for k in keys])
    rows.append(["all 52 layers", ""] + [total[k] for k in keys])
    # the library's sums against float64 sums of the same bf16 numbers (the widest layer)
    p, m = shapes[-1]
    x = (torch.randn(p, m, device=dev).relu() + 0.1).bfloat16()
    lib_acc = wl.functional.moments_accumulator(m, device=dev)
    wl.functional.accumulate_moments(lib_acc, x, None)
    ref = x.double()
    err2 = float((lib_acc[:m, :m].double() - ref.t() @ ref).norm() / (ref.t() @ ref).norm())
    err1 = float((lib_acc[:m, m].double() - ref.sum(0)).norm() / ref.sum(0).norm())
    rows.append([f"library vs float64, M={m}: rel. error of s2 / s1", "", f"{err2:.2e} / {err1:.2e}"]
                + [""] * (len(keys) - 1))
    return rows


def probe_split_compiled(dev, shapes) -> List[List[object]]:
    """A compiled layer's statistics of a shifted bf16 batch (``accumulate_moments_split`` under inductor: the
    subtraction, the split and the column sums fused) beside the eager layers' paths, for the first four distinct
    widths (one inductor compilation each)."""
    rows = []
    fn = torch.compile(wl.functional.accumulate_moments_split, dynamic=False)
    done = set()
    for p, m in shapes:
        if m in done or len(done) >= 4:
            continue
        done.add(m)
        x = (torch.randn(p, m, device=dev).relu() + 0.1).bfloat16()
        acc = wl.functional.moments_accumulator(m, device=dev)
        shift = x[:1024].float().mean(0, keepdim=True)
        got = []
        for f in (lambda: wl.functional.accumulate_moments(acc, x, None),
                  lambda: wl.functional.accumulate_moments(acc, x, shift),
                  lambda: wl.functional.accumulate_moments_split(acc, x, shift),
                  lambda: fn(acc, x, shift)):
            try:
                got.append(cuda_ms(f, 5))
            except Exception as exc:  # noqa: BLE001
                got.append(float("nan"))
                print(f"split probe (P={p}, M={m}) failed: {exc!r}"[:600], flush=True)
        rows.append([p, m] + got)
    return rows


def fold_covs(dev, shapes) -> Dict[int, torch.Tensor]:
    by: Dict[int, List[torch.Tensor]] = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for _, m in shapes:
        a = torch.randn(4 * m + 8, m, device=dev, generator=g) * torch.linspace(0.1, 3, m, device=dev)
        by.setdefault(m, []).append(a.t() @ a / a.shape[0])
    return {m: torch.stack(v) for m, v in by.items()}


def newton_schulz(c: torch.Tensor, iters: int) -> torch.Tensor:
    """Coupled Newton-Schulz inverse square root of SPD ``c`` (batched)."""
    m = c.shape[-1]
    norm = c.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)
    y = c / norm
    eye = torch.eye(m, device=c.device, dtype=c.dtype).expand_as(c)
    z = eye.clone()
    for _ in range(iters):
        t = 0.5 * (3 * eye - z @ y)
        y, z = y @ t, t @ z
    return z / norm.sqrt()


def probe_fold(dev, shapes) -> List[List[object]]:
    covs = fold_covs(dev, shapes)
    host64 = {m: c.double().cpu() for m, c in covs.items()}
    host32 = {m: c.cpu() for m, c in covs.items()}
    rows = []

    def run(fn, data):
        def go():
            for c in data.values():
                fn(c)
        return go

    rows.append(["CUDA eigh float32, batched by width", wall_ms(run(torch.linalg.eigh, covs))])
    c64 = {m: c.double() for m, c in covs.items()}
    rows.append(["CUDA eigh float64, batched by width", wall_ms(run(torch.linalg.eigh, c64))])
    # A fold after the first sees a covariance close to the last one: rotated into the last eigenbasis it is
    # nearly diagonal. Does cuSOLVER's eigh get faster on it (two products and one more back)?
    prev = {}
    for m, c in c64.items():
        noise = torch.randn_like(c) * 0.05 * c.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).unsqueeze(-1)
        prev[m] = torch.linalg.eigh(c + (noise + noise.transpose(-1, -2)) / 2)[1]

    def rotated():
        for m, c in c64.items():
            q = prev[m]
            lam, v = torch.linalg.eigh(q.transpose(-1, -2) @ c @ q)
            q @ v

    rows.append(["CUDA eigh float64 of Q_prev^T C Q_prev (near-diagonal), rotated back", wall_ms(rotated)])
    # Jacobi methods converge in few sweeps on a nearly diagonal matrix: cuSOLVER's gesvdj (an SPD matrix's SVD is
    # its EVD), on the rotated covariance, float64 and float32
    for dt in (torch.float64, torch.float32):
        rot = {m: (prev[m].transpose(-1, -2) @ c @ prev[m]).to(dt) for m, c in c64.items()}

        def jacobi(rot=rot):
            for m, a in rot.items():
                u, sv, _ = torch.linalg.svd(a, full_matrices=False, driver="gesvdj")
                prev[m].to(dt) @ u

        try:
            rows.append([f"CUDA svd gesvdj {str(dt)[6:]} of Q_prev^T C Q_prev (Jacobi), rotated back",
                         wall_ms(jacobi)])
        except Exception as exc:  # noqa: BLE001
            rows.append([f"CUDA svd gesvdj {str(dt)[6:]}", f"n/a: {exc!r}"[:120]])
    if os.environ.get("PROBE_FOLD_SHORT"):  # the host and MAGMA rows are known (RESULTS.md): skipped when short
        return rows
    try:  # MAGMA's eigh (hybrid host / GPU), where this torch was built with it
        torch.backends.cuda.preferred_linalg_library("magma")
        rows.append(["CUDA eigh float64, batched by width, MAGMA", wall_ms(run(torch.linalg.eigh, c64))])
    except Exception as exc:  # noqa: BLE001
        rows.append(["CUDA eigh float64, batched by width, MAGMA", f"n/a: {exc!r}"[:120]])
    finally:
        torch.backends.cuda.preferred_linalg_library("default")
    rows.append([f"host eigh float64 ({torch.get_num_threads()} threads), batched by width",
                 wall_ms(run(torch.linalg.eigh, host64))])
    rows.append([f"host eigh float32 ({torch.get_num_threads()} threads), batched by width",
                 wall_ms(run(torch.linalg.eigh, host32))])
    for iters in (10, 20):
        rows.append([f"CUDA Newton-Schulz inverse sqrt, {iters} iterations, float32",
                     wall_ms(run(lambda c, it=iters: newton_schulz(c, it), covs))])
    torch.backends.cuda.matmul.allow_tf32 = True
    rows.append(["CUDA Newton-Schulz inverse sqrt, 20 iterations, TF32",
                 wall_ms(run(lambda c: newton_schulz(c, 20), covs))])
    torch.backends.cuda.matmul.allow_tf32 = False
    # accuracy of Newton-Schulz (20 its, f32) against the exact inverse square root, the widest width
    m = max(covs)
    c = covs[m][:1]
    lam, vec = torch.linalg.eigh(c.double())
    exact = (vec * lam.clamp(min=1e-12).rsqrt().unsqueeze(-2)) @ vec.transpose(-1, -2)
    ns = newton_schulz(c, 20).double()
    rows.append([f"Newton-Schulz 20 its vs exact C^-1/2, M={m}: relative Frobenius error",
                 ((ns - exact).norm() / exact.norm()).item()])
    return rows


def probe_library_fold(dev, width: int = 64, reps: int = 3) -> List[List[object]]:
    """The library's whole-model fold of a converted ResNet-50 (grad, statistics of one bf16 forward), with one
    batched ``eigh`` per width (the GPU's path since e47ff80) and with one ``eigh`` per layer wider than
    ``EVDRule.BATCH_MAX_M`` (the CPU's choice, the GPU's before), alternated; wall clock, synchronised."""
    from whitenlayers.fold import fold_layers
    from whitenlayers.rules import EVDRule

    torch.manual_seed(0)
    model = wl.convert_model(resnet50(width), "grad", block_size=10**9).to(dev)
    model = model.to(memory_format=torch.channels_last).train()
    layers = [layer for _, layer in wl.whitening_layers(model)]
    x = torch.randn(16, 3, 64, 64, device=dev).to(memory_format=torch.channels_last)
    batched_key = EVDRule.batch_key

    def per_layer_key(self, num_features, state_dtype, device, groups=1):
        if num_features // groups > self.BATCH_MAX_M:
            return None
        return batched_key(self, num_features, state_dtype, device, groups)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    calls: List[int] = []
    real_eigh = torch.linalg.eigh

    def counted_eigh(*args, **kwargs):
        calls.append(1)
        return real_eigh(*args, **kwargs)

    def one(per_layer: bool) -> Tuple[float, int]:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            model(x)  # the block's statistics
        sync()
        calls.clear()
        if per_layer:
            EVDRule.batch_key = per_layer_key  # type: ignore[method-assign]
        torch.linalg.eigh = counted_eigh
        try:
            t0 = time.perf_counter()
            fold_layers(layers)
            sync()
            return 1e3 * (time.perf_counter() - t0), len(calls)
        finally:
            EVDRule.batch_key = batched_key  # type: ignore[method-assign]
            torch.linalg.eigh = real_eigh

    one(False)  # warm-up: the first block's fold, and each path once
    one(True)
    times: Dict[bool, List[float]] = {False: [], True: []}
    counts: Dict[bool, int] = {}
    for _ in range(reps):
        for per_layer in (True, False):
            ms, n = one(per_layer)
            times[per_layer].append(ms)
            counts[per_layer] = n
    return [[f"one eigh per layer wider than {EVDRule.BATCH_MAX_M} (before e47ff80)", counts[True],
             statistics.median(times[True])],
            ["one batched eigh per width (now)", counts[False], statistics.median(times[False])]]


def probe_overlap(dev, shapes, steps: int) -> List[List[object]]:
    model = resnet50(64).to(dev).to(memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(128, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (128,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def steps_ms(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / n

    for _ in range(5):
        step()
    covs = fold_covs(dev, shapes)
    host64 = {m: c.double().cpu() for m, c in covs.items()}
    rows = [["plain steps alone", steps_ms(steps), float("nan")]]
    side = torch.cuda.Stream()

    def host_fold(out):
        t0 = time.perf_counter()
        for c in host64.values():
            torch.linalg.eigh(c)
        out.append(1e3 * (time.perf_counter() - t0))

    def cuda_fold(out):
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            for c in covs.values():
                torch.linalg.eigh(c)
            side.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))

    for name, fn in (("host float64 eigh in a thread", host_fold), ("CUDA float32 eigh, side stream, thread", cuda_fold)):
        done: List[float] = []
        th = threading.Thread(target=fn, args=(done,))
        torch.cuda.synchronize()
        th.start()
        t = steps_ms(steps)
        th.join()
        rows.append([f"plain steps while a fold runs: {name}", t, done[0] if done else float("nan")])
    rows.append(["plain steps alone (again)", steps_ms(steps), float("nan")])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=12, help="host threads (eigh on the host)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated probes to run: out_dtype, stats, split, fold, libfold, overlap")
    args = p.parse_args()
    setup(args.threads, 0)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_probe.py needs CUDA")
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
          f"host threads {torch.get_num_threads()}")
    shapes = layer_shapes(128)
    print(f"bf16 products into float32 (addmm with out_dtype): {wl.functional.low_precision_products_on(dev)}")
    sections = [
        ("out_dtype", lambda: md_table(["op", "dtype", "rel. error vs float64"], probe_out_dtype(dev))),
        ("stats", lambda: md_table(["rows P", "features M", "f32 SIMT ms", "TF32 ms",
                                    "bf16 with ones column ms (before)", "library ms", "x^T x ms", "x^T 1 ms",
                                    "column sum + add ms", "padded to 8 ms", "library, shifted ms",
                                    "split (eager, unfused) ms"],
                                   probe_stats(dev, shapes), nd=3)),
        ("split", lambda: md_table(["rows P", "features M", "unshifted bf16 (eager) ms", "shifted, float32 (eager) ms",
                                    "split (eager, unfused) ms", "split (inductor) ms"],
                                   probe_split_compiled(dev, shapes), nd=3)),
        ("fold", lambda: md_table(["ResNet-50 fold (52 covariances)", "ms"], probe_fold(dev, shapes), nd=3)),
        ("libfold", lambda: md_table(["library fold of a converted ResNet-50 (grad, 52 layers)", "eigh calls",
                                      "ms (median)"], probe_library_fold(dev), nd=2)),
        ("overlap", lambda: md_table(["ResNet-50 bf16 batch 128", "step ms", "fold ms meanwhile"],
                                     probe_overlap(dev, shapes, args.steps), nd=2)),
    ]
    only = {s for s in args.only.split(",") if s}
    for name, fn in sections:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            text = fn()
        except Exception as exc:  # noqa: BLE001 - keep the other probes
            text = f"FAILED: {exc!r}"
        print(f"\n### probe: {name} ({time.perf_counter() - t0:.1f} s)\n\n{text}", flush=True)


if __name__ == "__main__":
    main()
