"""Bit-identity check for refactors (issue 23): train a converted CIFAR ResNet-20 with each method for a few SGD
steps and save the state dicts; compare two such files tensor by tensor (``torch.equal``).

    python benchmarks/state_identity.py save before.pt        # at the old commit
    python benchmarks/state_identity.py save after.pt         # at the new one
    python benchmarks/state_identity.py compare before.pt after.pt

Deterministic algorithms, one thread, fixed seeds: bit-identity holds within one machine and code path.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import whitenlayers as wl


def save(path: str) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    states = {}
    for method in ("grad", "recursive", "direct"):
        torch.manual_seed(0)
        model = wl.convert_model(wl.models.cifar_resnet(20, num_classes=10), method=method, block_size=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        g = torch.Generator().manual_seed(1)
        for _ in range(7):
            x = torch.randn(8, 3, 32, 32, generator=g) + 0.5
            y = torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        states[method] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(states, path)
    print("saved", path, {m: len(s) for m, s in states.items()})


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    for m in a:
        differing = [k for k in set(a[m]) & set(b[m]) if not torch.equal(a[m][k], b[m][k])]
        same_keys = set(a[m]) == set(b[m])
        print(f"{m}: {len(a[m])} / {len(b[m])} tensors, keys {'equal' if same_keys else 'differ'}, "
              f"{len(differing)} differing")
        bad += len(differing) + (not same_keys)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"] and len(sys.argv) == 3:
        save(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
