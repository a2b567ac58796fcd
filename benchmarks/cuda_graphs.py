"""CUDA graphs (``torch.compile(mode="reduce-overhead")``) on a converted model: does it train like eager, and how
often does it record a graph?

A captured CUDA graph reads its static inputs (parameters, buffers) at the addresses it was recorded with; CUDA
graph trees record again when one moves. A fold writes every buffer in place (``stats/block.py``,
``_set_fold_buffer``), a compiled layer's forward buffers too (the graph copies what its backward needs,
``whitenlayers::snapshot``): one recording per graph over any number of blocks. This
script trains a converted CIFAR ResNet-8 (fp32, TF32 off) compiled with ``reduce-overhead`` beside its eager twin
on the same batches, over several blocks, and prints per method:

* the largest relative gap between the compiled and the eager model's losses and state (float32: they differ by
  the order of float32 sums; the eager and compiled convolutions are different kernels),
* dynamo's unique graphs, and the CUDA graph trees' recordings (``counters["inductor"]``, where this torch
  counts them),
* how many distinct addresses each whitening buffer held across the folds (1: written in place).

    python benchmarks/cuda_graphs.py            # on a CUDA machine (a minute or two: three compilations)
    python benchmarks/cuda_graphs.py --tiny     # CPU, the eager backend: the path is covered, not the graphs
"""
from __future__ import annotations

import argparse
import copy
from collections import defaultdict
from typing import Dict, List, Set

import torch
import torch.nn.functional as F
from _common import add_common_args, command_line, loadavg, md_table, setup, write_json

import whitenlayers as wl


def _run(method: str, device: torch.device, steps: int, block_size: int, tiny: bool) -> List[object]:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = wl.convert_model(wl.models.cifar_resnet(8, num_classes=10, width=8), method, block_size=block_size)
    eager.to(device).train()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    kw = {"backend": "eager"} if tiny else {"mode": "reduce-overhead"}
    compiled = torch.compile(model, **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, model)]
    gen = torch.Generator().manual_seed(1)
    addresses: Dict[str, Set[int]] = defaultdict(set)
    gaps = []
    for _ in range(steps):
        x = (torch.randn(16, 3, 16, 16, generator=gen) + 0.5).to(device)
        y = torch.randint(0, 10, (16,), generator=gen).to(device)
        losses = []
        for run, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())  # a cudagraph output is overwritten by the next replay
        gaps.append(float((losses[1] - losses[0]).abs() / losses[0].abs().clamp_min(1e-12)))
        for name, t in model.named_buffers():
            if any(name.endswith(b) for b in ("running_mean", "grad_transform", "whitening_matrix", "running_cov",
                                              "bias_correction")):
                addresses[name].add(t.data_ptr())
    state_gap = 0.0
    for (k, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
        if a.is_floating_point() and a.numel():
            state_gap = max(state_gap, float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)))
    blocks = min(int(layer.num_blocks) for _, layer in wl.whitening_layers(model))
    recorded = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k.lower()}
    most = max(len(v) for v in addresses.values())
    return [method, blocks, max(gaps), state_gap, counters["stats"]["unique_graphs"],
            ", ".join(f"{k} {v}" for k, v in sorted(recorded.items())) or "-", most]


def main(argv=None) -> Dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--methods", default="grad,recursive,direct")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    setup(args.threads, args.seed)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    steps = 4 if args.tiny else args.steps
    rows = [_run(m, device, steps, 1 if args.tiny else 3, not cuda) for m in args.methods.split(",")]
    headers = ["method", "folds", "largest loss gap (relative)", "largest state gap (relative)", "dynamo graphs",
               "CUDA graph counters", "addresses per buffer (most)"]
    name = torch.cuda.get_device_name() if cuda else "CPU (eager backend)"
    text = (f"Command: `{command_line()}`; {name}; torch {torch.__version__}; load {loadavg()}\n\n"
            + md_table(headers, rows, nd=6))
    print(text)
    out = {"rows": rows, "markdown": text}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
