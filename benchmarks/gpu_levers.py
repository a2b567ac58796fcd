"""Levers for the GPU step (benchmarks/RESULTS.md, "GPU: first run"): ResNet-50 training-step time against the
plain model, interleaved, for settings a user can choose today, with TF32 off (PyTorch's default) and on.

    python benchmarks/gpu_levers.py            # on a CUDA machine (about a minute)

Variants: grad and recursive with the defaults; with ``stats_every=5``; grad with ``block_size=50`` (a fold
every 50 steps instead of 10). TF32 on lets the statistics' float32 products use tensor cores (it changes
their rounding: 10-bit mantissas), so it is measured, not made a default.
"""
from __future__ import annotations

import argparse
import copy
import statistics

from _common import md_table, setup
from gpu import timed_steps

import torch

import whitenlayers as wl
from _resnet50 import resnet50

VARIANTS = {
    "grad": ("grad", {}),
    "recursive": ("recursive", {}),
    "grad:every5": ("grad", {"stats_every": 5}),
    "recursive:every5": ("recursive", {"stats_every": 5}),
    "grad:block50": ("grad", {"block_size": 50}),
    "recursive:every5:block50": ("recursive", {"stats_every": 5, "block_size": 50}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50, help="timed steps per variant (50: whole blocks of 50)")
    p.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run of the script")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    setup(8, 0)
    dev = torch.device(args.device)
    base = resnet50(64)
    models = {"plain": copy.deepcopy(base)}
    for name, (method, kw) in VARIANTS.items():
        models[name] = wl.convert_model(copy.deepcopy(base), method=method, **kw)
    for m in models.values():
        m.to(dev).to(memory_format=torch.channels_last).train()

    def batch():
        x = torch.randn(args.batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        return x, torch.randint(0, 1000, (args.batch,), device=dev)

    rows = []
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        # whole blocks of 50 steps for every variant (the default): each pays its folds in proportion
        times = timed_steps(models, batch, dev, args.rounds, torch.bfloat16 if dev.type == "cuda" else None)
        base_mean = statistics.mean(times["plain"])
        for k, v in times.items():
            rows.append([f"TF32 {'on' if tf32 else 'off'}", k, 1e3 * statistics.mean(v),
                         statistics.mean(v) / base_mean])
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU (smoke run: no meaningful figures)"
    print(f"Device: {name}; torch {torch.__version__}; ResNet-50, 224px, batch {args.batch}, bf16 autocast, "
          f"channels_last; mean over {args.rounds} steps after 2 warm-up rounds")
    print(md_table(["matmul", "variant", "mean step ms", "step vs plain"], rows, nd=3))


if __name__ == "__main__":
    main()
