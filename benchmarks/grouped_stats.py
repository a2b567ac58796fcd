"""Statistics grouped across layers (issue 48, a lead for the host-bound step): what the per-step statistics of a
converted model cost as each layer's own operations, against one set of operations per group of layers whose
inputs have the same shape.

The ResNet-50 layout (width 2, batch 2, 32 px, channels_last, bf16 autocast: ``host_overhead.py``'s CPU proxy)
runs one forward to collect its 52 whitening layers' inputs. Then, outside the model, interleaved:

* **per layer**, the library's hot path: ``functional.accumulate_moments`` into each layer's accumulator (a float32
  copy of the bf16 batch, the subtraction of the shift, two products into the accumulator), within
  ``functional.fused_moments`` (CUDA's path);
* **grouped by shape**: what a converted model's fold coordinator now runs at the end of each forward
  (``functional.accumulate_moments_grouped``): for each group of layers whose inputs share a shape, the inputs
  stacked (one copy), the shifts subtracted, two batched products in place into stacked accumulators (``x^T x``
  and ``x^T 1``).

Only the statistics' operations are timed (this process's CPU time, one thread): not the layer's Python around
them, not the hand-over in a real forward (``host_overhead.py`` times whole steps). It says how many microseconds
a layer's statistics operations are, and how many of them the grouped path takes back.

    python benchmarks/grouped_stats.py
    python benchmarks/grouped_stats.py --tiny     # CI
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from typing import Dict, List, Tuple

import torch
from _common import add_common_args, command_line, loadavg, md_table, setup, write_json
from _resnet50 import resnet50

import whitenlayers as wl
from whitenlayers.functional.moments import accumulate_moments, moments_accumulator
from whitenlayers.functional.stacked import accumulate_moments_grouped, stacked_moments_accumulator


def _inputs(width: int, size: int) -> List[torch.Tensor]:
    """The whitening layers' inputs of one forward of the converted ResNet-50 layout (channels_last, bf16)."""
    model = wl.convert_model(resnet50(width, num_classes=10), "grad").to(memory_format=torch.channels_last)
    inputs: List[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach()))
             for _, layer in wl.whitening_layers(model)]
    x = torch.randn(2, 3, size, size).contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    return inputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50, help="steps per round (default 50)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rounds, args.steps = 2, 2
    setup(1, args.seed, "cpu")
    inputs = _inputs(2, 32)
    shifts = [torch.randn(x.shape[1]).view(1, -1, 1, 1) for x in inputs]
    accs = [moments_accumulator(x.shape[1], torch.float32, x.device) for x in inputs]
    groups: Dict[Tuple[int, ...], List[int]] = collections.defaultdict(list)
    for i, x in enumerate(inputs):
        groups[tuple(x.shape)].append(i)
    g_acc = {s: stacked_moments_accumulator(len(ix), s[1]) for s, ix in groups.items()}

    def per_layer() -> None:
        for x, acc, shift in zip(inputs, accs, shifts):
            accumulate_moments(acc, x, shift)

    def grouped() -> None:
        for s, ix in groups.items():
            accumulate_moments_grouped(g_acc[s], [inputs[i] for i in ix], [shifts[i] for i in ix])

    # the two compute the same sums (float32 products in another order): one step each from zero, compared
    with wl.functional.fused_moments(True):
        per_layer()
        grouped()
    gap = 0.0
    for s, ix in groups.items():
        for j, i in enumerate(ix):
            m = s[1]
            scale = float(accs[i][:m, :m].abs().max()) + 1e-30
            gap = max(gap, float((accs[i][:m, : m + 1] - g_acc[s][j, :m, : m + 1]).abs().max()) / scale)
    if gap > 1e-4:
        raise SystemExit(f"grouped_stats.py: the grouped sums differ from the per-layer ones by {gap:.2e} (relative)")
    variants = {"per layer": per_layer, "grouped by shape": grouped}
    times: Dict[str, List[float]] = {k: [] for k in variants}
    loads = [loadavg()]
    with wl.functional.fused_moments(True):
        for f in variants.values():
            f()
        for _ in range(args.rounds):
            for name, f in variants.items():
                t0 = time.process_time()
                for _ in range(args.steps):
                    f()
                times[name].append((time.process_time() - t0) / args.steps)
    loads.append(loadavg())
    n = len(inputs)
    rows = [[name, 1e3 * min(ts), 1e6 * min(ts) / n] for name, ts in times.items()]
    markdown = "\n".join([
        f"ResNet-50 layout, width 2, batch 2, 32 px, channels_last, bf16: {n} whitening layers, {len(groups)} "
        f"distinct input shapes; the statistics' operations only, best of {args.rounds} rounds of {args.steps} "
        "steps, process CPU time, one thread",
        "",
        md_table(["statistics", "ms per step", "us per layer"], rows, nd=2),
        "",
        f"the two sums after one step from zero: largest gap {gap:.1e} relative to the largest entry (float32)",
        "",
        f"load average: {' -> '.join(loads)}",
        "",
        command_line(),
    ])
    print(markdown)
    write_json(args.json, {"rows": rows, "groups": len(groups), "layers": n, "markdown": markdown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
