"""Comparison methods for the runner: K-FAC, FOOF, IterNorm (written here), Shampoo, SOAP, Muon (pytorch-optimizer).

These are baselines to compare the whitening layers against, not part of the
layer API: nothing here is exported from the top-level ``whitenlayers``
namespace. The benchmarks (``benchmarks/_models.py``) import them from here.

Written from their papers (no third-party code), applied to the same layers
as the whitening variants (every convolution inside a residual block):

* **K-FAC** (Martens & Grosse 2015; the convolution factors of Grosse &
  Martens 2016, "KFC"): per layer ``A = E[a a^T]`` over unfolded input patches
  (``M k^2`` square) and ``G = E[g g^T]`` over output-gradient positions
  (``S`` square), exponential averages (decay 0.95) refreshed every
  ``stat_every`` steps; eigendecompositions of both every ``inv_every``
  steps; every step the gradient is replaced by
  ``Q_G [(Q_G^T dW Q_A) / (d_G d_A^T + damping)] Q_A^T`` with damping 1e-3,
  i.e. ``(G ⊗ A + damping I)^{-1} vec(dW)``, then rescaled by the KL clip
  ``min(1, sqrt(1e-3 / (lr^2 sum v . dW)))``.
* **FOOF** (Benzing 2022): only the input factor, the gradient
  right-multiplied by ``(A + damping I)^{-1}`` (damping 1e-3 times
  ``mean(diag A)``).
* **IterNorm** (Huang et al. 2019): activation whitening
  ``y = Sigma^{-1/2} (x - mean)`` before each block conv, ``Sigma^{-1/2}`` from
  ``T = 5`` Newton-Schulz iterations on the trace-normalised batch covariance,
  back-propagated through by autograd, running averages for evaluation.

Library peers (optional extra ``whitenlayers[peers]``, i.e.
``pytorch-optimizer``): :func:`library_optimizer` builds ``Shampoo``,
``SOAP`` or ``Muon`` over a model's parameters (Muon: its orthogonalised
update on every weight with two or more dimensions except the stem and the
classifier; AdamW, as Muon's authors prescribe, on the rest).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["block_convs", "IterNorm", "insert_iternorm", "KroneckerPreconditioner", "LIBRARY_PEERS",
           "library_available", "library_optimizer", "PEERS_EXTRA"]

#: The pip extra that brings the library peers.
PEERS_EXTRA = "pip install 'whitenlayers[peers]'  (pytorch-optimizer)"


def block_convs(model: nn.Module) -> List[nn.Conv2d]:
    """Every Conv2d inside a BasicBlock/Bottleneck (the targets of ``convert_model``)."""
    out: List[nn.Conv2d] = []
    for m in model.modules():
        if type(m).__name__ in ("BasicBlock", "Bottleneck"):
            out.extend(c for c in m.modules() if isinstance(c, nn.Conv2d))
    return out


# --------------------------------------------------------------------------
# IterNorm
# --------------------------------------------------------------------------
class IterNorm(nn.Module):
    """IterNorm (Huang et al. 2019): Newton-Schulz ZCA whitening of the channels, autograd backward."""

    if TYPE_CHECKING:  # pragma: no cover
        running_mean: Tensor  # buffers
        running_wm: Tensor

    def __init__(self, num_features: int, iterations: int = 5, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.c, self.t, self.eps, self.momentum = num_features, iterations, eps, momentum
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_wm", torch.eye(num_features))

    def forward(self, x: Tensor) -> Tensor:
        b, c = x.shape[:2]
        xf = x.flatten(2)  # (B, C, HW)
        if not self.training:
            return (self.running_wm @ (xf - self.running_mean.view(1, c, 1))).view_as(x)
        m = xf.shape[0] * xf.shape[2]
        mean = xf.mean((0, 2))
        xc = xf - mean.view(1, c, 1)
        eye = torch.eye(c, dtype=x.dtype, device=x.device)
        sigma = torch.bmm(xc, xc.transpose(1, 2)).sum(0) / m + self.eps * eye
        tr = torch.diagonal(sigma).sum()
        sn = sigma / tr
        p = eye
        for _ in range(self.t):
            p = 1.5 * p - 0.5 * torch.linalg.matrix_power(p, 3) @ sn
        wm = p / tr.sqrt()
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_wm.lerp_(wm, self.momentum)
        return (wm @ xc).view_as(x)


class _Wrapped(nn.Module):
    def __init__(self, pre: nn.Module, conv: nn.Module):
        super().__init__()
        self.pre, self.conv = pre, conv

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.pre(x))


def insert_iternorm(model: nn.Module) -> nn.Module:
    """An :class:`IterNorm` before every block convolution (in place); returns ``model``."""
    targets = {id(c) for c in block_convs(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                conv = cast(nn.Conv2d, child)  # a block conv
                setattr(parent, name, _Wrapped(IterNorm(conv.in_channels).to(conv.weight.device), child))
    return model


# --------------------------------------------------------------------------
# K-FAC and FOOF
# --------------------------------------------------------------------------
class KroneckerPreconditioner:
    """K-FAC (``use_g=True``) or FOOF (``use_g=False``) on the given convolutions.

    Call :meth:`step` after ``backward()`` and before ``optimizer.step()``: it
    replaces each convolution's weight gradient by its preconditioned one.
    ``lr`` (used by K-FAC's KL clip) may be changed between steps.
    """

    def __init__(self, convs: List[nn.Conv2d], lr: float, use_g: bool, stat_decay: float = 0.95,
                 damping: float = 1e-3, kl_clip: float = 1e-3, stat_every: int = 10, inv_every: int = 100):
        self.convs, self.lr, self.use_g = convs, lr, use_g
        self.decay, self.damping, self.kl_clip = stat_decay, damping, kl_clip
        self.stat_every, self.inv_every = stat_every, inv_every
        self.steps = 0
        self.a: Dict[nn.Module, Tensor] = {}
        self.g: Dict[nn.Module, Tensor] = {}
        self.inv: Dict[nn.Module, Tuple[Tensor, ...]] = {}
        self.handles = []
        for c in convs:
            self.handles.append(c.register_forward_pre_hook(self._save_a))
            if use_g:
                self.handles.append(c.register_full_backward_hook(self._save_g))

    def _stat_step(self) -> bool:
        return self.steps % self.stat_every == 0

    def _ema(self, store: Dict[nn.Module, Tensor], module: nn.Module, new: Tensor) -> None:
        old = store.get(module)
        store[module] = new if old is None else old.mul_(self.decay).add_(new, alpha=1.0 - self.decay)

    def _save_a(self, module: nn.Conv2d, inputs) -> None:
        if not (module.training and torch.is_grad_enabled() and self._stat_step()):
            return
        x = inputs[0].detach()
        padding = cast(Tuple[int, ...], module.padding)  # numeric (a string padding is not supported here)
        a = F.unfold(x, module.kernel_size, module.dilation, padding, module.stride)  # (B, M k^2, L)
        n = a.shape[0] * a.shape[2]
        self._ema(self.a, module, torch.bmm(a, a.transpose(1, 2)).sum(0) / n)

    def _save_g(self, module: nn.Module, grad_input, grad_output) -> None:
        if not self._stat_step():
            return
        g = grad_output[0].detach()
        b = g.shape[0]
        gf = g.flatten(2) * b  # per-example gradients of the mean loss
        n = gf.shape[0] * gf.shape[2]
        self._ema(self.g, module, torch.bmm(gf, gf.transpose(1, 2)).sum(0) / n)

    def update_inverses(self) -> None:
        """Refresh the factors' inverses; a layer whose statistics are not finite (a diverged run) keeps its old
        ones."""
        for c in self.convs:
            a = self.a[c]
            if not bool(torch.isfinite(a).all()) or (self.use_g and not bool(torch.isfinite(self.g[c]).all())):
                continue
            if self.use_g:
                da, qa = torch.linalg.eigh(a)
                dg, qg = torch.linalg.eigh(self.g[c])
                self.inv[c] = (qa, da.clamp(min=0), qg, dg.clamp(min=0))
            else:
                lam = self.damping * torch.diagonal(a).mean()
                eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
                self.inv[c] = (torch.cholesky_inverse(torch.linalg.cholesky(a + lam * eye)),)

    def precondition(self, grad: Tensor, conv: nn.Module) -> Tensor:
        """The preconditioned ``(S, M k^2)`` gradient matrix of ``conv`` (before the KL clip)."""
        mat = grad.reshape(grad.shape[0], -1)
        if self.use_g:
            qa, da, qg, dg = self.inv[conv]
            v = qg.t() @ mat @ qa
            v = v / (dg.unsqueeze(1) * da.unsqueeze(0) + self.damping)
            return qg @ v @ qa.t()
        return mat @ self.inv[conv][0]

    def step(self) -> None:
        """Call after backward, before optimizer.step()."""
        if self.steps % self.inv_every == 0 and (self.a or not self.inv):
            if len(self.a) == len(self.convs) and (not self.use_g or len(self.g) == len(self.convs)):
                self.update_inverses()
        self.steps += 1
        if not self.inv:
            return
        vg_sum = 0.0
        new = {}
        for c in self.convs:
            gw = c.weight.grad
            if gw is None:
                continue
            v = self.precondition(gw, c)
            if self.use_g:
                vg_sum += float((v * gw.reshape(gw.shape[0], -1)).sum()) * self.lr**2
            new[c] = v
        nu = min(1.0, math.sqrt(self.kl_clip / vg_sum)) if (self.use_g and vg_sum > 0) else 1.0
        for c, v in new.items():
            assert c.weight.grad is not None  # new holds the convs with a gradient
            c.weight.grad.copy_(v.view_as(c.weight.grad)).mul_(nu)

    def state_tensors(self) -> List[Tensor]:
        out = list(self.a.values()) + list(self.g.values())
        for t in self.inv.values():
            out.extend(t)
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# --------------------------------------------------------------------------
# Library peers (pytorch-optimizer)
# --------------------------------------------------------------------------
#: Runner method name -> pytorch-optimizer class name and the learning rate its authors default to.
LIBRARY_PEERS: Dict[str, Tuple[str, float]] = {"shampoo": ("Shampoo", 1e-3), "soap": ("SOAP", 3e-3),
                                               "muon": ("Muon", 0.02)}


def library_available() -> bool:
    """Whether ``pytorch-optimizer`` (the ``peers`` extra) is installed."""
    try:
        import pytorch_optimizer  # noqa: F401
    except ImportError:
        return False
    return True


def library_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float = 0.0,
                      momentum: float = 0.9, options: Optional[Mapping[str, Any]] = None) -> torch.optim.Optimizer:
    """``pytorch-optimizer``'s Shampoo, SOAP or Muon over ``model``'s parameters.

    Every parameter group gets ``base_lr`` (the runner scales it by the
    schedule). Muon: the orthogonalised update for the weights with two or
    more dimensions except the stem convolution and the classifier; AdamW
    (learning rate ``lr * 0.015``, Muon's 3e-4 / 0.02 ratio) for the rest.
    """
    try:
        import pytorch_optimizer as po
    except ImportError as exc:
        raise ImportError(f"method {name!r} needs pytorch-optimizer: {PEERS_EXTRA}") from exc
    opts = dict(options or {})
    if name == "shampoo":
        opt = po.Shampoo(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, **opts)
    elif name == "soap":
        opt = po.SOAP(model.parameters(), lr=lr, weight_decay=weight_decay, **opts)
    elif name == "muon":
        stem_head: Set[int] = set()
        for mod in (getattr(model, "conv1", None), getattr(model, "fc", None)):
            if mod is not None:
                stem_head.update(id(p) for p in mod.parameters())
        hidden = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in stem_head]
        rest = [p for p in model.parameters() if not (p.ndim >= 2 and id(p) not in stem_head)]
        groups = [dict(params=hidden, use_muon=True, lr=lr, weight_decay=weight_decay),
                  dict(params=rest, use_muon=False, lr=lr * 0.015, weight_decay=0.0)]
        opt = po.Muon(groups, lr=lr, weight_decay=weight_decay, **opts)
    else:
        raise ValueError(f"unknown library peer {name!r}; choose from {', '.join(LIBRARY_PEERS)}")
    for g in opt.param_groups:
        g["base_lr"] = g["lr"]
    return opt
