"""What the grad / recursive layers share besides their forward (:mod:`~whitenlayers.layers.step`): construction,
the centring absorbed by a following BatchNorm, the bias compensation at a fold, the round trip to the plain layer.
Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import functional as F_w
from .._rebuild import layer_like, share_parameters
from ._checks import BATCH_NORMS, check_input
from .base import WhiteningLayer
from .step import CentringRef, _GradStep

__all__ = ["_GradWhitenMixin"]


class _GradWhitenMixin(_GradStep, WhiteningLayer):
    """Shared by the grad/recursive conv and linear layers: construction, centring, bias compensation."""

    bias_correction: Tensor

    _FORWARD_BUFFERS = ("running_mean", "grad_transform", "bias_correction")
    _ZEROED_ON_RESET = ("bias_correction", "absorbed_offset")
    #: The input check's arguments (``check_input``): the feature axis, the ranks taken, the expected shape in words.
    _INPUT: Tuple[int, tuple, str] = (-1, tuple(range(1, 9)), "an input of shape (*, in_features)")

    def _features_of(self, x: Tensor, weight: Tensor) -> Tensor:
        """An input the forward's fast check does not take: checked (``check_input``, an error that names the layer),
        and returned as the statistics see it, features on dim 1: a linear layer's ``(*, M)`` as ``(N, M)`` rows, an
        unbatched convolution input with a batch of one, a patch layer's unfolded patches."""
        dim, ranks, what = self._INPUT
        check_input(self, x, weight, dim=dim, ndims=ranks, what=what)
        if not self._SPATIAL:  # a linear layer
            bn = self._absorbing_bn() if x.dim() != 2 else None
            if bn is not None and (bn.training or (bn.running_mean is None and bn.running_var is None)):
                raise ValueError(
                    f"{self._describe()}: with its centring absorbed by a BatchNorm the layer needs an input of shape "
                    f"(B, in_features), but got input of shape {tuple(x.shape)}")
            return x.reshape(-1, self.num_features)
        return x if x.dim() == self._BATCHED_RANK else x.unsqueeze(0)

    def _weight_matrix(self, weight: Tensor) -> Tensor:
        """The weight as the layer's features see it: ``(S, C k^2)`` for patch features, else unchanged."""
        return weight.flatten(1) if self.features == "patches" else weight

    def _fold_weight_of(self, weight: Optional[Tensor]) -> Optional[Tensor]:
        # The forward's weight (under a sharded wrapper, FSDP, the full weight exists only then): its taps summed,
        # float64, all the fold's compensation needs.
        w = self._weight_matrix((self.weight if weight is None else weight).detach())
        if w.dim() == 2:
            return w.to(torch.float64)
        return w.sum(tuple(range(2, w.dim())), dtype=torch.float64)  # one reduction, float64

    # ------------------------------------------------ centring absorbed by a BatchNorm
    @property
    def centring(self) -> str:
        """``"input"`` (the layer centres its input) or ``"absorbed"`` (by :attr:`centring_batchnorm`)."""
        return "input" if self._centring_ref is None else "absorbed"

    @property
    def centring_batchnorm(self) -> Optional[nn.Module]:
        """The module that absorbs this layer's centring (see :meth:`absorb_centring`), or ``None``.

        With ``parent`` given to :meth:`absorb_centring`, whatever module is in that place now.
        """
        ref = self._centring_ref
        if ref is None:
            return None
        parent, what = ref
        return what if parent is None else parent._modules.get(what)

    def _absorbing_bn(self) -> Optional[nn.Module]:
        bn = self.centring_batchnorm
        return bn if isinstance(bn, BATCH_NORMS) else None

    @torch.no_grad()
    def absorb_centring(self, batchnorm: Optional[nn.Module], parent: Optional[nn.Module] = None) -> None:
        """Let ``batchnorm``, which alone consumes this layer's output, absorb the centring; ``None`` undoes it.

        docs/conventions.md, "Centring absorbed by a following BatchNorm". The layer computes
        ``z = conv(x, W) + b`` (no centring offset ``s = c - sum_k W_k mu``)
        whenever ``batchnorm`` normalises with batch statistics (training
        mode, or no running statistics): the BatchNorm subtracts the batch
        mean, which removes ``s`` exactly, and its input gradient sums to zero
        per channel, so ``s``'s weight-gradient term ``-(sum dz) mu^T`` is zero.
        Training (weights, whitening state, BatchNorm output) is the centred
        layer's up to rounding, without the pass over the output that adds
        ``s`` and the backward reduction for it.

        Running statistics stay exact: the BatchNorm's ``running_mean`` now
        averages ``conv(x, W) + b``, i.e. the centred layer's running mean
        minus ``d``, the running average of ``s`` with the BatchNorm's own
        momentum (or cumulative average), which the layer keeps in the buffer
        ``absorbed_offset`` (one ``S``-vector update per training forward).
        Whenever the BatchNorm uses its running statistics (eval mode, or a
        BatchNorm frozen in eval mode while the layer trains) the layer adds
        ``s - d`` (with the centred layer's weight gradient), so the
        BatchNorm's output is the centred layer's. :func:`to_plain_model` moves
        ``s - d`` into the BatchNorm's ``running_mean`` instead of a bias, so
        the exported layer keeps the original's keys (a bias-free conv stays
        bias-free).

        Only call this when ``batchnorm`` is the *only* consumer of the
        layer's output, called once per call of the layer (the BatchNorm's
        ``num_features`` must equal the layer's output features; a linear
        layer needs ``(B, in_features)`` inputs). ``parent``: the module that
        holds ``batchnorm`` as a child (what :func:`convert_model` passes);
        the layer then looks the BatchNorm up there at every forward, so
        replacing it later (``nn.SyncBatchNorm.convert_sync_batchnorm``) keeps
        the pairing. If what sits there is no longer a BatchNorm, or without
        ``parent`` the BatchNorm is replaced, the layer adds ``s - d`` always:
        exact for a replacement that keeps the running statistics and uses
        them (a frozen BatchNorm), wrong for one that normalises with batch
        statistics (keep ``parent`` for that). Switching on starts with
        ``d = 0``; switching off adds ``d`` to the BatchNorm's
        ``running_mean`` (or, with no BatchNorm there, subtracts it from the
        bias or ``bias_correction``): both leave the model's function
        unchanged. The references are plain attributes (not submodules): not
        in this layer's ``state_dict``; ``copy.deepcopy`` / pickling of a whole
        model keep the pairing (of the layer alone: with a copy of ``parent``).

        Args:
            batchnorm: the BatchNorm (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``) that alone consumes
                the layer's output, with ``num_features`` equal to its output features; ``None`` switches the
                absorption off (the layer centres its input again).
            parent: the module holding ``batchnorm`` as a child (default ``None``: keep a reference to
                ``batchnorm`` itself). Pass it whenever the BatchNorm may be replaced later.
        """
        name = None
        if batchnorm is not None:
            if not isinstance(batchnorm, BATCH_NORMS):
                raise TypeError(
                    f"{self._describe()}: absorb_centring expects a BatchNorm module, but got "
                    f"{type(batchnorm).__name__}"
                )
            out_features = self.weight.shape[0]
            if batchnorm.num_features != out_features:
                raise ValueError(
                    f"{self._describe()}: absorb_centring needs a BatchNorm over the layer's {out_features} output "
                    f"features, but got num_features={batchnorm.num_features}"
                )
            if parent is not None:
                names = [n for n, m in parent._modules.items() if m is batchnorm]
                if len(names) != 1:
                    raise ValueError(
                        f"{self._describe()}: absorb_centring: parent must hold the BatchNorm as exactly one child, "
                        f"but it holds it {len(names)} times"
                    )
                name = names[0]
        if self._centring_ref is not None:
            d = self._buffers.pop("absorbed_offset")
            old = self._absorbing_bn()
            mean = old._buffers.get("running_mean") if old is not None else None
            if mean is not None:
                mean.add_(d.to(mean.dtype))
            else:  # nothing to hand d to: keep the function through the bias compensation
                self._write_buffers({"bias_correction": self.bias_correction - d.to(self.bias_correction.dtype)})
            self._centring_ref = None
        if batchnorm is not None:
            self.register_buffer(
                "absorbed_offset",
                torch.zeros(self.weight.shape[0], device=self.weight.device, dtype=self.running_mean.dtype),
            )
            # (a plain attribute: neither the BatchNorm nor the parent is a submodule of the layer)
            self._centring_ref = CentringRef(None, batchnorm) if parent is None else CentringRef(parent, name)
            self._fold_compensation_into_offset()

    def _hooks_after_absorbing(self) -> str:
        """The forward hooks of a layer whose centring is absorbed, by name (``""``: none). They were registered
        after the absorption (``convert_model`` absorbs no layer with forward hooks), and see the layer's output
        without the offset the BatchNorm absorbs."""
        if self._centring_ref is None or not self._forward_hooks:
            return ""
        return ", ".join(repr(getattr(h, "__qualname__", type(h).__name__)) for h in self._forward_hooks.values())

    def _centre_for_hooks(self) -> None:
        """Forward hooks registered after the absorption: the layer centres its input again (``absorb_centring(None)``,
        which keeps its function), as :func:`~whitenlayers.convert_model` leaves a layer with forward hooks; a
        warning names them. Called by the forward and the export before they use the absorbed offset."""
        warnings.warn(
            f"{self._describe()}: forward hook(s) {self._hooks_after_absorbing()} registered after its centring was "
            "absorbed by a BatchNorm would see its output without the centring offset (and the export would move "
            "the offset into the BatchNorm's running mean without the hook's effect): the layer centres its input "
            "again, as convert_model leaves a layer with forward hooks. Register the hooks before convert_model to "
            "silence this", stacklevel=3)
        self.absorb_centring(None)

    def _skipped_offset(self, weight: Tensor) -> Tensor:
        """``s = c - sum_k W_k mu``: the offset the absorbed layer leaves out (its bias stays in the output)."""
        return self._offset(weight, self._buffers_in_force())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "absorbed_offset"
        if self._centring_ref is not None and key not in state_dict:
            # A checkpoint of the centred layer: its BatchNorm's running mean is the centred one, i.e. d = 0.
            state_dict = {**state_dict, key: torch.zeros_like(self._buffers["absorbed_offset"])}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self._centring_ref is not None:  # a checkpoint that kept c apart (a centred layer)
            self._fold_compensation_into_offset()

    @classmethod
    def _from_plain(cls, layer: nn.Module, plain: type, method: str, **kwargs: Any) -> Any:
        """``from_conv`` / ``from_linear`` (``method``): a layer of this class with ``layer``'s settings and Parameter
        objects, for an ``nn.<plain>``."""
        if not isinstance(layer, plain):
            raise TypeError(f"{cls.__name__}.{method} expects an nn.{plain.__name__}, but got {type(layer).__name__}")
        new = layer_like(layer, cls, bias=layer.bias is not None, **kwargs)
        share_parameters(layer, new)
        new.train(layer.training)
        return new

    def _to_plain(self, plain: type) -> Any:
        """``to_conv`` / ``to_linear``: the plain ``plain`` layer with identical outputs; new Parameters."""
        out = layer_like(self, plain, bias=True)
        with torch.no_grad():
            out.weight.copy_(self.weight)
            out.bias.copy_(self._layer_bias(self.weight))
        out.weight.requires_grad_(self.weight.requires_grad)
        out.train(self.training)
        return out

    @torch.no_grad()
    def _mean_change_writes(self, delta: Tensor) -> Dict[str, Tensor]:
        # ERRATA 8 (docs/PAPER.md): c(i) = c(i-) + sum W (mu(i) - mu(i-1)) keeps z unchanged; an absorbed layer keeps
        # c inside d (c - d is what its function uses): d(i) = d(i-) - sum W (mu(i) - mu(i-1)).
        block = self._block
        w, block.fold_weight = block.fold_weight, None  # the weight of the forward that ended the block
        if w is None:
            w = self.weight.detach()
            w = w.full_tensor() if hasattr(w, "full_tensor") else w  # a DTensor (FSDP2) outside the forward
            w = self._weight_matrix(w).to(torch.float64)
        comp = F_w.weight_mean_product(w, delta)  # float64
        absorbed = self._buffers.get("absorbed_offset")
        if absorbed is not None:
            return {"absorbed_offset": absorbed - comp}  # computed in float64, rounded once into d's dtype
        c = self.bias_correction
        return {"bias_correction": c + comp.to(c.dtype)}

    @torch.no_grad()
    def _fold_compensation_into_offset(self) -> None:
        """An absorbed layer keeps its bias compensation inside ``absorbed_offset``: ``d <- d - c``, ``c <- 0``.

        The layer's output, its BatchNorm's and the export use ``c - d`` only, so this changes nothing they
        compute; with ``c = 0`` the per-step update of ``d`` is one product-accumulate
        (:meth:`_track_absorbed_offset`) instead of two operations.
        """
        d = self._buffers.get("absorbed_offset")
        c = self.bias_correction
        if d is not None and not c.is_meta and c.any():
            self._write_buffers({"absorbed_offset": d - c.to(d.dtype), "bias_correction": torch.zeros_like(c)})

    def extra_repr(self) -> str:
        features = f"features={self.features!r}" if self.features != "channels" else ""
        centring = "centring=absorbed" if self._centring_ref is not None else ""
        return ", ".join(part for part in (super().extra_repr(), self._whitening_repr(), features, centring) if part)
