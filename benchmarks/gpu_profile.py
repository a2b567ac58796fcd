"""Where a converted ResNet-50's GPU step goes (torch.profiler): top CUDA kernels and CPU ops, one method.

    python benchmarks/gpu_profile.py --method recursive      # on a CUDA machine
    python benchmarks/gpu_profile.py --method grad --fold    # one whole-model fold instead of training steps
"""
from __future__ import annotations

import argparse
import copy
import time

from _common import setup

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import whitenlayers as wl
from _resnet50 import resnet50


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--method", default="recursive")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--stats-every", type=int, default=1)
    p.add_argument("--block-size", type=int, default=10)
    p.add_argument("--fold", action="store_true", help="profile one fold of all the layers instead of steps")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    setup(8, 0)
    dev = torch.device("cuda")
    base = resnet50(64)
    converted = wl.convert_model(copy.deepcopy(base), method=args.method, stats_every=args.stats_every,
                                 block_size=args.block_size)
    if args.fold:
        from whitenlayers.fold import fold_layers
        layers = [m.to(dev) for _, m in wl.whitening_layers(converted.to(dev))]
        for _ in range(2):  # the second fold is profiled (the first block is the special one)
            for m in layers:
                m.accumulate(torch.randn(4 * m.num_features + 8, m.num_features, device=dev).relu())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fold_layers(layers)
                torch.cuda.synchronize()
        print(f"\n=== one fold of {len(layers)} layers ({args.method}): {1e3 * (time.perf_counter() - t0):.1f} ms "
              "under the profiler ===")
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        return
    variants = {"plain": copy.deepcopy(base), args.method: converted}
    x = torch.randn(args.batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=dev)
    for name, model in variants.items():
        model.to(dev).to(memory_format=torch.channels_last).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        print(f"\n=== {name}: {1e3 * wall:.1f} ms/step under the profiler ===")
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
