"""The layers' checks of what they are given and of where they run, each with the message that names the layer and
what to do. Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .._torch_compat import compiling

#: The BatchNorm classes whose running mean a layer's centring can follow (``absorb_centring``); subclasses too.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d,
               nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
#: Convolutions, and transposed ones (subclasses too: the lazy ones).
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

FUNC_WHAT_TO_DO = (
    "Call the model in eval mode (model.eval(): the transform in force, nothing updated), or in training mode "
    "inside `with wl.frozen(model):` (the layers whiten and transform the weight gradient without updating their "
    "state); a BatchNorm in training mode then needs no running statistics, "
    "torch.func.replace_all_batch_norm_modules_(model), as for any model under torch.func."
)


def onnx_exporting() -> bool:
    """``torch.onnx.is_in_onnx_export()``, asked only while tracing (its exporters trace: the TorchScript one with
    ``torch.jit``, the dynamo one through ``torch.export``): on the per-batch path it costs more than the check."""
    return (torch.jit.is_tracing() or compiling()) and torch.onnx.is_in_onnx_export()


def check_not_tracing_function(layer: Any, what: str) -> None:
    """``torch.jit.trace`` with autograd on would record the layer's autograd Function (``what``): refused (the
    TorchScript-based ONNX exporter, which also traces with autograd on, inlines the Function: allowed)."""
    if not compiling() and torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export():
        raise RuntimeError(
            f"{layer._describe()}: torch.jit.trace with autograd enabled records the layer's autograd Function "
            f"({what}) as a Python op, whose graph differs between the trace and its check (\"Graphs differed "
            "across invocations!\"). Trace in eval mode under torch.no_grad(): `with torch.no_grad(): "
            "traced = torch.jit.trace(model.eval(), example_inputs)`, or trace the plain model, "
            "wl.to_plain_model(copy.deepcopy(model)).eval()"
        )


def check_input(layer: Any, x: Any, weight: Optional[Tensor], *, dim: int, ndims: tuple, what: str) -> None:
    """``TypeError`` / ``ValueError`` naming ``layer`` for an input it cannot take: not a tensor (an FX proxy: the
    way out), not floating point (quantized: the way out), another dtype than ``weight``'s outside autocast, a rank
    outside ``ndims``, or another number of features on dim ``dim`` than the layer's."""
    if not isinstance(x, Tensor):
        if isinstance(x, torch.fx.Proxy):
            raise TypeError(
                f"{layer._describe()}: torch.fx symbolic tracing (FX graph mode quantization such as prepare_qat_fx "
                "or prepare_fx, torch.fx passes) cannot trace a whitening layer: its forward gathers statistics and "
                "folds them in Python. Quantize or transform the plain model after training, "
                "wl.to_plain_model(copy.deepcopy(model)); to trace the converted model as it is, keep its layers as "
                "leaves (a torch.fx.Tracer whose is_leaf_module is True for wl.WhiteningLayer and "
                "wl.DirectWhitenWrapper)"
            )
        raise TypeError(f"{layer._describe()}: expected a Tensor input, but got {type(x).__name__}")
    if not x.is_floating_point():
        if x.is_quantized:
            raise TypeError(
                f"{layer._describe()}: expected a floating-point input, but got a quantized one (dtype={x.dtype}): "
                "a whitening layer has no quantized form, and eager quantization's convert leaves it in float. "
                "Quantize the plain model after training, wl.to_plain_model(copy.deepcopy(model)), or dequantize "
                "before the layer (torch.ao.quantization.DeQuantStub) and quantize after it (QuantStub)"
            )
        raise TypeError(f"{layer._describe()}: expected a floating-point input, but got dtype={x.dtype}")
    if isinstance(weight, Tensor) and x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer._describe()}: expected an input of dtype {weight.dtype} (the dtype of the layer's weight), "
            f"but got dtype={x.dtype}"
        )
    if x.dim() not in ndims:
        raise ValueError(f"{layer._describe()}: expected {what}, but got input of shape {tuple(x.shape)}")
    expected = getattr(layer, "in_channels", layer.num_features)  # a patch layer has C k^2 features of C channels
    if x.shape[dim] != expected:
        unit = "channels" if getattr(layer, "features", "channels") == "patches" else "features"
        raise ValueError(
            f"{layer._describe()}: expected {expected} input {unit} on dim {dim % x.dim()}, but got {x.shape[dim]} "
            f"(input shape {tuple(x.shape)})"
        )
