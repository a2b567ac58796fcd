"""What each training batch computes: its sums into a block's accumulator (the layers' hot path, eagerly and in
compiled graphs), the centring offset ``sum_k W_k mu`` and the weight-gradient transform ``dW <- dW Q_s``, dense and
grouped. The block's side (summaries, the recursive averages) is :mod:`~whitenlayers.functional.moments`'s. Part of
:mod:`whitenlayers.functional`."""
from __future__ import annotations

import collections
import contextlib
import math
from typing import Dict, Iterator, Optional, Tuple, Union

import einops
import torch
from torch import Tensor

from .moments import block_outer

__all__ = ["accumulate_moments", "accumulate_moments_split", "moments_accumulator", "ones_for_moments",
           "fused_moments", "fused_moments_on", "low_precision_products_on", "batch_moments", "batch_sums",
           "stats_samples", "weight_mean_product", "transform_weight_grad", "grouped_batch_moments"]


def _rows_layout(x: Tensor) -> bool:
    """Whether the 4-D ``x`` lies as ``(P, M)`` rows, features last (channels_last, not also contiguous)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _as_rows(x: Tensor) -> Optional[Tensor]:
    """``x`` as a ``(P, M)`` view (features last) when that needs no copy."""
    if x.dim() == 2:
        return x
    if x.dim() == 4 and _rows_layout(x):
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    return None


# CPU statistics: inputs of at least this many values take the unshifted product
# (see batch_moments), accepted when it loses at most log2(_UNSHIFTED_MAX_LOSS) bits.
_CPU_UNSHIFTED_MIN_ELEMENTS = 1 << 16
_UNSHIFTED_MAX_LOSS = 8.0


#: Sub-sampled statistics (``stats_fraction < 1``) keep at least this many rows (samples x positions) per
#: feature in every batch: the fraction thins out batches with rows to spare (a conv's many positions), never
#: the few rows of a linear layer or a small batch.
STATS_MIN_ROWS_PER_FEATURE = 16


def stats_samples(batch: int, positions: int, features: int, fraction: float) -> int:
    """How many leading samples of a batch the statistics use with ``stats_fraction=fraction``.

    ``ceil(fraction * batch)``, raised to the samples needed for
    ``STATS_MIN_ROWS_PER_FEATURE * features`` rows of ``positions`` each, at most ``batch``.

    Args:
        batch: samples in the batch, >= 1.
        positions: spatial positions per sample (1 for a linear layer), >= 1.
        features: the layer's ``M`` (per group), >= 1.
        fraction: the config field ``stats_fraction``, in ``(0, 1]``.

    Example:
        >>> stats_samples(128, 32 * 32, 16, 0.25)   # a 16-channel conv at 32x32: a quarter of the batch
        32
        >>> stats_samples(128, 8 * 8, 64, 0.25)     # 64 channels at 8x8: still a quarter
        32
        >>> stats_samples(128, 1, 512, 0.25)        # a 512-wide linear layer: every sample
        128
    """
    keep = max(math.ceil(fraction * batch), math.ceil(STATS_MIN_ROWS_PER_FEATURE * features / max(positions, 1)))
    return max(1, min(batch, keep))


def _unshifted_moments(x: Tensor, shift: Tensor, groups: int = 1) -> Optional[Tuple[Tensor, Tensor]]:
    """Shifted sums from the *unshifted* product ``sum x x^T``, or ``None`` when that would be inaccurate.

    ``s2 = sum x x^T - k s^T - s k^T + n k k^T`` (``s = sum x``, ``k`` the shift),
    corrected in float64. Rounding in ``sum x x^T`` scales with ``sum x_m^2``
    instead of ``sum (x_m - k_m)^2``: the result is accepted only when every
    feature has ``sum x_m^2 <= _UNSHIFTED_MAX_LOSS * sum (x_m - k_m)^2``, i.e.
    the rounding error is at most that factor above the shifted product's (an
    error relative to ``sqrt(s2_ii s2_jj)``, off-diagonal entries included).
    Checking costs one host synchronisation, free on the CPU. ``groups > 1``: per group, ``s2`` its diagonal
    blocks ``(G, k, k)``.
    """
    m = x.shape[1]
    b = x.reshape(x.shape[0], groups, m // groups, -1)  # (B, G, k, P): a view for contiguous NC... inputs
    n = b.shape[0] * b.shape[3]
    g = torch.matmul(b, b.transpose(-1, -2)).sum(0).to(torch.float64)
    s = b.sum(3).to(torch.float64).sum(0).reshape(m)  # float64 across samples (a float64-accumulating sum is slower)
    k = shift.to(x.dtype).to(torch.float64)
    ks = block_outer(k, s, groups)
    s2 = g - ks - ks.transpose(-1, -2) + n * block_outer(k, k, groups)
    ok = torch.diagonal(g, dim1=-2, dim2=-1) <= _UNSHIFTED_MAX_LOSS * torch.diagonal(s2, dim1=-2, dim2=-1)
    if not bool(ok.all()) and bool(torch.isfinite(s2).all()):
        return None
    return (s - n * k).to(x.dtype), (s2 if groups != 1 else s2[0]).to(x.dtype)


def batch_sums(x: Tensor, shift: Optional[Tensor] = None, groups: int = 1) -> Tuple[Tensor, Tensor]:
    """A batch's sums about ``shift``: ``s1 = sum (x - shift)`` ``(M,)`` and ``s2 = sum (x - shift)(x - shift)^T``.

    The layers' hot path (one call per training forward that gathers statistics): a subtraction (none when
    ``shift`` is ``None``: sums about 0), one product and two reductions, in ``x``'s dtype, no check and no host
    synchronisation. ``x`` is ``(B, M)`` or ``(B, M, *spatial)`` (features on dim 1); ``shift`` is shaped to
    broadcast against it (``(1, M, 1, ...)``). ``groups > 1``: the diagonal blocks ``(G, k, k)`` of ``s2`` only.

    About 0 the product's rounding scales with ``sum x_m^2`` instead of ``sum (x_m - mean_m)^2``: a layer sums
    unshifted only when its statistics allow it (:func:`unshifted_accurate`).

    Args:
        x: the batch, ``(B, M)`` or ``(B, M, *spatial)``.
        shift: shaped to broadcast against ``x``, or ``None`` (default: sums about 0).
        groups: ``G`` >= 1 dividing ``M`` (default 1).
    """
    xs = x if shift is None else x - shift
    m = x.shape[1]
    rows = _as_rows(xs)
    if groups == 1:
        if rows is not None:  # (P, M): 2-D input or channels_last
            return rows.sum(0), rows.t() @ rows
        b = xs.flatten(2)  # (B, M, H*W): a view for contiguous NC... inputs; also valid for an empty batch
        return b.sum((0, 2)), torch.bmm(b, b.transpose(1, 2)).sum(0)
    if rows is not None:
        r = einops.rearrange(rows, "p (g k) -> g p k", g=groups)
        return rows.sum(0), torch.matmul(r.mT, r)
    b = einops.rearrange(xs, "b (g k) ... -> b g k (...)", g=groups)  # a view of an NC... batch; also for B = 0
    return b.sum((0, 3)).reshape(m), torch.matmul(b, b.mT).sum(0)


_ONES: "collections.OrderedDict[tuple, Tensor]" = collections.OrderedDict()
#: Ones tensors kept (one per batch shape, dtype and device; shared by the layers of a model).
_ONES_KEPT = 16


def _ones(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, traced: bool) -> Tensor:
    """A tensor of ones, made once per shape (in the graph when dynamo traces the caller, ``traced``: no state to
    guard on)."""
    if traced:
        return torch.ones(shape, dtype=dtype, device=device)
    key = (shape, dtype, device)
    ones = _ONES.get(key)
    if ones is None:
        if torch.is_inference_mode_enabled():  # never keep an inference tensor
            return torch.ones(shape, dtype=dtype, device=device)
        ones = _ONES[key] = torch.ones(shape, dtype=dtype, device=device)
        while len(_ONES) > _ONES_KEPT:
            _ONES.popitem(last=False)
    return ones


def ones_for_moments(x: Tensor) -> Tuple[int, ...]:
    """The shape of the ones :func:`accumulate_moments` uses with ``x``: a column ``(P, 1)`` for a ``(P, M)`` view
    of ``x`` (2-D or channels_last; the column sums as the product ``x^T 1``), else a row ``(1, B, P)`` appended to
    ``(M, B, P)``."""
    return _ones_shape(x, _as_rows(x))


def _ones_shape(x: Tensor, rows: Optional[Tensor]) -> Tuple[int, ...]:
    """:func:`ones_for_moments` given ``rows = _as_rows(x)`` (computed once on the hot path)."""
    return (rows.shape[0], 1) if rows is not None else (1, x.shape[0], math.prod(x.shape[2:]))


#: Where the layers take their fewest-kernel paths (:func:`accumulate_moments`' concatenation and one product;
#: ``DirectWhiten`` as a 1x1 convolution each way): every device but the CPU, unless :func:`fused_moments` says
#: otherwise.
_fused_on_cpu = False


def fused_moments_on(device: torch.device) -> bool:
    """Whether ``device`` takes the fewest-kernel paths (:func:`fused_moments`): not the CPU, by default."""
    return device.type != "cpu" or _fused_on_cpu


@contextlib.contextmanager
def fused_moments(on_cpu: bool = True) -> Iterator[None]:
    """Within the block, the CPU takes the fewest-kernel paths as CUDA does (or not): the two-op path of
    :func:`accumulate_moments`, ``DirectWhiten``'s 1x1 convolutions, and at a fold one batched ``eigh`` for
    EVD layers of any width (``EVDRule.batch_key``). What ``benchmarks/hot_path.py`` counts as the GPU's
    operations, and what the tests check on a CPU."""
    global _fused_on_cpu
    before, _fused_on_cpu = _fused_on_cpu, on_cpu
    try:
        yield
    finally:
        _fused_on_cpu = before


#: Low-precision dtypes whose products :func:`accumulate_moments` can take as they are, with float32 output.
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: Product -> device type -> whether that product takes ``out_dtype`` there (:func:`_probe_out_dtype`).
_LOWP_PRODUCTS: Dict[str, Dict[str, bool]] = {"addmm": {}, "bmm": {}, "baddbmm": {}}


def _probe_out_dtype(device: torch.device, product: str = "addmm") -> bool:
    """Whether this torch multiplies bf16 operands into a float32 result on ``device`` with ``product``, tried once
    per device type on tiny tensors (CUDA; the CPU has no such kernel): ``"addmm"``, ``torch.addmm(...,
    out_dtype=torch.float32, out=acc)`` runs (torch 2.11 at least); ``"bmm"``, ``torch.bmm(bf16, bf16,
    out_dtype=torch.float32)`` gives the float32 products (torch 2.8 and later); ``"baddbmm"``, ``torch.baddbmm(acc,
    bf16, bf16, out_dtype=torch.float32, out=acc)`` adds them into a strided float32 ``acc``."""
    known, key = _LOWP_PRODUCTS[product], device.type
    if key not in known:
        ok = False
        if device.type == "cuda":
            a = (torch.arange(24, device=device).view(2, 4, 3) % 5 - 2).to(torch.bfloat16)
            try:
                want = a.mT.float() @ a.float()
                if product == "addmm":
                    acc = torch.zeros(3, 3, device=device)
                    torch.addmm(acc, a[0].t(), a[0], out_dtype=torch.float32, out=acc)
                    ok = True
                elif product == "bmm":
                    ok = bool(torch.equal(torch.bmm(a.mT, a, out_dtype=torch.float32), want))
                else:
                    acc = torch.ones(2, 3, 8, device=device)[:, :, :3]
                    torch.baddbmm(acc, a.mT, a, out_dtype=torch.float32, out=acc)
                    ok = bool(torch.equal(acc, want + 1))
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        known[key] = ok
    return known[key]


def low_precision_products_known(device: torch.device) -> bool:
    """:func:`low_precision_products_on` without trying the product: ``False`` where it was not tried yet. What a
    traced graph reads (nothing may run there; the layers try the product where they are built or moved)."""
    if device.type == "cpu":
        return _fused_on_cpu
    return device.type == "cuda" and _LOWP_PRODUCTS["addmm"].get(device.type, False)


def low_precision_products_on(device: torch.device) -> bool:
    """Whether :func:`accumulate_moments` multiplies bf16 / fp16 batches as they are (tensor cores, float32
    accumulation and output) on ``device``, instead of converting them to float32 first: CUDA with a torch whose
    ``addmm`` takes ``out_dtype`` (2.8 and later). On the CPU only within :func:`fused_moments`, which takes the
    CUDA paths: the batch then stays bf16 up to the product, converted there (the CPU has no such product)."""
    if device.type == "cpu":
        return _fused_on_cpu
    return device.type == "cuda" and _probe_out_dtype(device)


def _product_add(out: Tensor, left: Tensor, right: Tensor) -> None:
    """``out += left @ right`` in ``out``'s dtype, one kernel: bf16 / fp16 operands with float32 accumulation and
    output where the device has that product (:func:`low_precision_products_on`), else operands already in
    ``out``'s dtype. ``out`` may be a strided view (a block of the accumulator). On the CPU within
    :func:`fused_moments` (CUDA's path, emulated) low-precision operands are converted here, where CUDA's product
    takes them as they are."""
    if left.dtype == out.dtype:
        out.addmm_(left, right)
    elif torch.compiler.is_compiling():
        # Traced: dynamo refuses an out= tensor that is not contiguous (a block of the accumulator), and inductor
        # lowers mm's out_dtype (torch 2.13; addmm's fails there): the product, then an add that inductor fuses.
        out.add_(_product(left, right, out.dtype))
    elif _probe_out_dtype(left.device):
        torch.addmm(out, left, right, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(left.to(out.dtype), right.to(out.dtype))


def _product(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    """``left @ right`` as a new ``dtype`` tensor: low-precision operands multiplied into ``dtype`` where the device
    does that (CUDA), else converted first (the CPU, emulating it exactly: products of bf16 numbers are exact in
    float32)."""
    if left.dtype == dtype:
        return left @ right
    if _probe_out_dtype(left.device):
        return torch.mm(left, right, out_dtype=dtype)
    return left.to(dtype) @ right.to(dtype)


def accumulate_moments_split(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """:func:`accumulate_moments` of a bf16 / fp16 batch about a float32 ``shift`` on tensor cores, for a traced graph.

    The differences ``d = x - shift`` in float32 (as :func:`accumulate_moments` computes them for a float32 shift)
    are each split into two bf16 numbers (for fp16 batches too: bf16 has float32's range), ``hi = d`` rounded and
    ``lo = d - hi`` rounded, which leaves ``d - hi - lo`` within ``2^-18 |d|``;
    ``acc[:M, :M] += hi^T hi + hi^T lo + (hi^T lo)^T`` (two low-precision products into float32: the products of
    bf16 numbers are exact there) and ``acc[:M, M] += sum d`` (a float32 reduction). Against float64 sums of the
    same numbers: relative error ~5e-6 for the covariance, ~1e-7 for the mean (ResNet-20's activations),
    where the float32 product of ``d`` gives ~7e-7; that product runs on CUDA's SIMT cores, 5x the tensor-core
    path's time for ResNet-50's layers on an H100. (``x - shift`` rounded to bf16 once is biased: ~1e-3.)

    A compiled layer takes this path: its graph sums every batch about a shift (no per-layer flag to guard on),
    and inductor fuses the subtraction, the split and the reduction into one pass over ``x`` (no float32 copy of
    the batch). A batch without a ``(P, M)`` view (a contiguous ``(B, M, *spatial)`` one) goes to
    :func:`accumulate_moments` in float32.

    Args:
        acc: the ``(M + 1, M + 1)`` float32 accumulator (:func:`moments_accumulator`).
        x: the batch, bf16 / fp16, ``(P, M)`` or channels_last ``(B, M, H, W)``.
        shift: float32, broadcasting against ``x`` (``(1, M)`` or ``(1, M, 1, 1)``).
    """
    d = x - shift  # float32 (promoted): one kernel, the batch converted on the way
    rows = _as_rows(d)
    if rows is None:
        accumulate_moments(acc, x.to(acc.dtype), shift)
        return
    m = rows.shape[1]
    hi = rows.to(torch.bfloat16)
    lo = (rows - hi).to(torch.bfloat16)
    s2 = acc[:m, :m]
    _product_add(s2, hi.t(), hi)
    cross = _product(hi.t(), lo, acc.dtype)
    s2.add_(cross).add_(cross.t())
    acc[:m, m].add_(rows.sum(0, dtype=acc.dtype))


#: Row length of :func:`moments_accumulator`'s storage: a multiple of this many elements (32 bytes in float32).
_ACC_ROW_ALIGN = 8


def moments_accumulator(num_features: int, dtype: torch.dtype = torch.float32,
                        device: Optional[Union[str, torch.device]] = None) -> Tensor:
    """A zeroed ``(M + 1, M + 1)`` accumulator for :func:`accumulate_moments`, whose rows start at multiples of
    8 elements (a view of ``(M + 1, M')`` storage, ``M'`` rounded up): the ``(M, M)`` block the statistics'
    product writes then has aligned rows, which cuBLAS's fastest tensor-core kernels need (a product into an
    ``(M + 1) x (M + 1)`` contiguous matrix took 2-3x as long on an H100; ``benchmarks/RESULTS.md``). Any
    ``(M + 1, M + 1)`` tensor works with :func:`accumulate_moments`; this one is the fast one.

    Args:
        num_features: ``M`` >= 1.
        dtype: the accumulator's dtype (float32, or float64 for float64 inputs).
        device: where it lives.

    Example:
        >>> acc = moments_accumulator(3)
        >>> acc.shape, acc.stride()
        (torch.Size([4, 4]), (8, 1))
    """
    m1 = num_features + 1
    return torch.zeros(m1, -(-m1 // _ACC_ROW_ALIGN) * _ACC_ROW_ALIGN, dtype=dtype, device=device)[:, :m1]


def _as_moments_accumulator(acc: Tensor, dtype: torch.dtype) -> Tensor:
    """``acc`` itself where it has :func:`moments_accumulator`'s aligned rows and ``dtype``, else a copy that has
    them (after a cast, or a move that copied the strided view contiguous)."""
    if acc.dtype == dtype and acc.stride(1) == 1 and acc.stride(0) % _ACC_ROW_ALIGN == 0:
        return acc
    return moments_accumulator(acc.shape[0] - 1, dtype, acc.device).copy_(acc)


def accumulate_moments(acc: Tensor, x: Tensor, shift: Optional[Tensor],
                       blocks: Optional[Tuple[Tensor, Tensor]] = None, traced: Optional[bool] = None) -> None:
    """Add a batch's sums about ``shift`` to an augmented accumulator ``acc`` ``(M + 1, M + 1)``.

    ``acc[:M, :M] += sum (x - k)(x - k)^T`` and ``acc[:M, M] += sum (x - k)``; nothing reads ``acc[M, :]`` (the
    fewest-kernel path's one product of a batch without a ``(P, M)`` view adds its sums and row count there).
    ``x`` is ``(B, M)`` or ``(B, M, *spatial)``; ``shift`` broadcasts against it. Within a
    block the sums accumulate in ``acc``'s dtype (float32 for float32 / bf16 / fp16 inputs): each batch's product
    is already rounded in that dtype, and adding a block of them costs a few more units in the last place, far
    below the sampling noise of the statistics.

    The layers' hot path on a GPU (and on the CPU within :func:`fused_moments`), two kernels and no copy of the
    batch for rows ``(P, M)`` (2-D or channels_last input): the product ``x^T x`` into ``acc[:M, :M]`` and the
    column sums as the product ``x^T 1`` into ``acc[:M, M]``, both accumulating in place (a subtraction first
    when ``shift`` is not ``None``). Fastest with :func:`moments_accumulator`'s aligned rows. (The batch with a
    column of ones appended, one ``(M + 1) x (M + 1)`` product, was 2.3x the time on an H100: the concatenation
    copies the batch, and rows of ``M + 1`` elements keep cuBLAS off its fastest kernels.) A contiguous
    ``(B, M, *spatial)`` batch has no such view: it is copied once, with a row of ones, as ``(M + 1, B * P)``,
    and multiplied by itself.

    A bf16 / fp16 batch summed about 0 (``shift`` ``None``) goes into the products as it is where the device
    multiplies low-precision operands into float32 (:func:`low_precision_products_on`: CUDA): the products of
    bf16 numbers are exact in float32 and accumulate in float32, so this is the float32 product of the same
    numbers, on tensor cores, without a float32 copy of the batch. A shifted batch reaches the accumulators' dtype
    in the subtraction itself (``x - shift`` is not a bf16 number; one pass over the batch, no copy first).

    ``blocks``: ``acc[:M, :M]`` and ``acc[:M, M:]``, sliced once by the caller; ``traced``: whether dynamo traces the
    caller (``None``: asked here).
    """
    if traced is None:
        traced = torch.compiler.is_compiling()
    low = x.dtype in LOW_PRECISION
    fused = x.device.type != "cpu" or _fused_on_cpu  # (fused_moments_on, inline: one call per layer and step)
    if shift is not None and low and shift.dtype == acc.dtype:
        xs = x - shift  # promoted to the accumulators' dtype by the subtraction (exactly: one pass, no copy first)
    else:
        if x.dtype != acc.dtype and not (shift is None and low and acc.dtype == torch.float32 and fused
                                         and low_precision_products_on(x.device)):
            x = x.to(acc.dtype)
        xs = x if shift is None else x - shift
    m = xs.shape[1]
    rows: Optional[Tensor] = None  # (P, M) without a copy: a 2-D batch, or a channels_last one (_as_rows, inline)
    if xs.dim() == 2:
        rows = xs
    elif xs.dim() == 4 and xs.is_contiguous(memory_format=torch.channels_last) and not xs.is_contiguous():
        rows = xs.permute(0, 2, 3, 1).reshape(-1, m)
    if not fused:
        # A CPU is not launch-bound: the product and the sums of batch_sums, added into the accumulator's blocks
        # (the ones row and the count corner are left as they are).
        if rows is not None:
            s1, s2 = rows.sum(0), rows.t() @ rows
        elif traced and xs.is_contiguous():
            # Traced: the rows (M, B P) made in the subtraction's pass, one product (inductor generates a batched
            # product summed over the batch as a reduction per width)
            rows = xs.transpose(0, 1).reshape(m, -1)
            s1, s2 = rows.sum(1), rows @ rows.t()
        else:
            b = xs.flatten(2)  # (B, M, H*W): a view for contiguous NC... inputs; also valid for an empty batch
            s1, s2 = b.sum((0, 2)), torch.bmm(b, b.transpose(1, 2)).sum(0)
        acc[:m, :m].add_(s2)
        acc[:m, m].add_(s1)
        return
    if rows is not None:  # (P, M): two products into the accumulator's blocks, no copy of the batch
        _moment_products(*((acc[:m, :m], acc[:m, m:]) if blocks is None else blocks), rows, traced)
        return
    b = xs.flatten(2).transpose(0, 1)  # (M, B, P), a view
    a = torch.cat([b, _ones(_ones_shape(xs, rows), xs.dtype, xs.device, traced)], 0).flatten(1)  # (M+1, B P): a copy
    _product_add(acc, a, a.t())


def _moment_products(s2: Tensor, s1: Tensor, rows: Tensor, traced: bool) -> None:
    """``s2 += rows^T rows`` and ``s1 += rows^T 1`` (``rows`` ``(P, M)``; ``s1`` a column), two products into the
    accumulator's blocks (:func:`_product_add`): bf16 / fp16 rows as they are where the device multiplies them into
    float32 (CUDA), else converted once (the CPU's emulation of CUDA's path, whose products of converted bf16
    numbers are the same exact float32 products). ``traced``: dynamo traces the caller."""
    if rows.dtype != s2.dtype and not traced and not _probe_out_dtype(rows.device):
        rows = rows.to(s2.dtype)
    rows_t = rows.t()
    _product_add(s2, rows_t, rows)
    _product_add(s1, rows_t, _ones((rows.shape[0], 1), rows.dtype, rows.device, traced))



def batch_moments(x: Tensor, shift: Tensor, groups: int = 1) -> Tuple[Tensor, Tensor]:
    """Shifted first and second moments of one batch, summed over samples and positions.

    ``x`` is ``(B, M)`` or ``(B, M, *spatial)`` (features on dim 1). Returns
    ``s1 = sum (x - shift)`` ``(M,)`` and ``s2 = sum (x - shift)(x - shift)^T``
    ``(M, M)`` in ``x``'s dtype. Subtracting a ``shift`` close to the mean
    before the product keeps the covariance accurate when ``|mean| >> std``
    (the naive ``sum x x^T - n mu mu^T`` cancels catastrophically there).

    The ``(B, M, H*W)`` layout is used as is (a batched product, no permuted
    copy of the activation); a channels-last input is read as ``(B*H*W, M)``.

    On the CPU a large ``(B, M, *spatial)`` input first tries the unshifted
    product (``_unshifted_moments``): no shifted copy of the activation
    (on a CPU that copy, a fresh activation-sized allocation, costs as much as
    the product itself), and the shift applied to the ``M x M`` result; it is
    accepted when the cancellation costs at most 3 bits (``mean^2 <= 7 var``
    per feature, which post-ReLU activations satisfy), otherwise the shifted
    product below is computed. Measured in ``benchmarks/RESULTS.md``.

    ``groups > 1``: the block-diagonal second moments ``(G, k, k)`` only
    (as :func:`grouped_batch_moments`), never the ``M x M`` product.

    Args:
        x: the batch, ``(B, M)`` or ``(B, M, *spatial)``.
        shift: ``(M,)``, close to the features' mean (e.g. the running mean in force).
        groups: ``G`` >= 1 dividing ``M`` (default 1).
    """
    m = x.shape[1]
    if (x.device.type == "cpu" and x.dim() > 2 and x.numel() >= _CPU_UNSHIFTED_MIN_ELEMENTS
            and _as_rows(x) is None and not (torch.is_grad_enabled() and x.requires_grad)):
        res = _unshifted_moments(x, shift, groups)
        if res is not None:
            return res
    return batch_sums(x, shift.to(x.dtype).view((1, m) + (1,) * (x.dim() - 2)), groups)


def grouped_batch_moments(x: Tensor, shift: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """:func:`batch_moments` of a grouped layer: ``s1`` ``(M,)`` and the diagonal blocks of ``s2``, ``(G, k, k)``.

    Costs ``M k`` multiply-adds per sample and position (``1/G`` of the
    ungrouped product): a batched product over the ``B x G`` ``(k, H*W)``
    slices (for depthwise, ``k = 1``, one dot product per sample and channel),
    unshifted on the CPU when that loses at most 3 bits (as
    :func:`batch_moments`; measured on a ``(64, 192, 32, 32)`` depthwise input,
    one thread: 4.6 ms, against 31 ms with the shifted copy, 90 ms for
    ``torch.var_mean`` and 84 ms for the depthwise convolution's forward).

    Args:
        x: the batch, ``(B, M)`` or ``(B, M, *spatial)``.
        shift: ``(M,)``, close to the features' mean.
        groups: ``G`` > 1 dividing ``M``.
    """
    return batch_moments(x, shift, groups)


def weight_mean_product(weight: Tensor, mean: Tensor) -> Tensor:
    """``sum_k W_k mean`` per output feature: kernel taps and input features summed.

    ``weight`` is ``(S, M)`` or ``(S, M, *kernel)``, ``mean`` ``(M,)``. It is the
    centring offset of a layer that centres on ``mean``, and, applied to a change
    of the mean, the bias compensation of eq. ``vtb_corr`` (ERRATA 8).

    A grouped convolution's weight ``(S, M/G, *kernel)`` (fewer input features
    than ``mean`` has) is read group by group: the ``S/G`` outputs of group
    ``g`` see its ``M/G`` features of ``mean``.

    Args:
        weight: the layer's weight ``(S, M)`` or ``(S, M, *kernel)`` (grouped: ``(S, M/G, *kernel)``).
        mean: a mean (or a change of the mean) of the ``M`` input features, ``(M,)``.

    Returns:
        ``(S,)`` in the promoted dtype of the two.
    """
    w = weight if weight.dim() == 2 else weight.reshape(weight.shape[0], weight.shape[1], -1).sum(-1)
    if w.shape[1] != mean.shape[0]:  # grouped convolution
        s, k = w.shape
        per_group = einops.rearrange(w, "(g s) k -> g s k", g=mean.shape[0] // k)
        means = einops.rearrange(mean.to(w.dtype), "(g k) -> g k 1", k=k)
        return einops.rearrange(per_group @ means, "g s 1 -> (g s)")
    return w @ mean.to(w.dtype)


# --------------------------------------------------------------------------
# Gradient transform
# --------------------------------------------------------------------------
#: On a CPU a kernel's weight gradient is transformed by one batched product up to this many input features, by
#: one transposed product above (2-core Xeon, 3x3 kernels, min of 3 rounds: batched/transposed 0.63x at 16, 0.57x
#: at 32, 0.85x at 64, 1.18x at 128, 1.44x at 256 features). On a GPU always the batched product (one kernel).
_CPU_BMM_MAX_FEATURES = 64


def transform_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """Right-multiply a weight gradient by ``Q`` on the input-feature axis (dim 1).

    ``grad`` is ``(S, M)`` (linear) or ``(S, M, *kernel)`` (convolution, one
    ``S x M`` matrix per kernel tap): ``out[s, j, k] = sum_i grad[s, i, k] Q[i, j]``.
    A grouped ``Q`` ``(G, k, k)`` goes with a grouped convolution's gradient
    ``(S, k, *kernel)``: the ``S/G`` output channels of group ``g`` are
    right-multiplied by ``Q_g`` (``_grouped_weight_grad``).

    Args:
        grad: the weight gradient, ``(S, M)`` or ``(S, M, *kernel)`` (grouped: ``(S, k, *kernel)``).
        q: the gradient transform ``Q_s``, ``(M, M)``, or its diagonal blocks ``(G, k, k)``.

    Returns:
        The transformed gradient, ``grad``'s shape and dtype.
    """
    if q.dim() == 3:
        return _grouped_weight_grad(grad, q)
    if q.dtype != grad.dtype:
        q = q.to(grad.dtype)
    if grad.dim() == 2:
        return grad @ q
    m = grad.shape[1]
    if torch.compiler.is_compiling():
        # A graph reads no layout (torch.export's strict mode refuses is_contiguous): the products of a contiguous
        # gradient, on a contiguous copy where the gradient is strided.
        return _dense_weight_grad(grad.contiguous(), q)
    # The common cases first, each a few Python-level calls: this runs in every layer's backward on every step.
    if grad.is_contiguous():
        out = _dense_weight_grad(grad, q)
        # (a 1x1 kernel's channels_last strides differ on the size-1 dims; DDP's buckets take a gradient as it is
        # only in its parameter's strides)
        return out if out.stride() == grad.stride() else out.as_strided(grad.shape, grad.stride())
    if grad.movedim(1, -1).is_contiguous():
        # A channels_last gradient (a model moved to channels_last) is an (S * taps, M) matrix as it lies: one
        # product, the result laid out as the gradient is.
        rows = grad.as_strided((grad.numel() // m, m), (m, 1))
        return torch.mm(rows, q).as_strided(grad.shape, grad.stride())
    return torch.empty_like(grad).copy_(_dense_weight_grad(grad.contiguous(), q))  # any other layout, kept


def _dense_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """:func:`transform_weight_grad` of a contiguous ``(S, M, *kernel)`` gradient, contiguous: a 1x1 kernel's one
    ``(S x M) @ (M x M)`` product; else one batched product ``Q^T @ grad[s]`` per output feature ``s`` (``Q^T``
    broadcast, not copied), or on a CPU for more than :data:`_CPU_BMM_MAX_FEATURES` input features one ``(M x M) @
    (M x S*K)`` product on the input-feature axis moved first (a copy of the small gradient: three ops, but faster
    there than the batched product for wide layers)."""
    s, m = grad.shape[0], grad.shape[1]
    if grad.numel() == s * m:
        return (grad.view(s, m) @ q).view(grad.shape)
    if grad.device.type != "cpu" or m <= _CPU_BMM_MAX_FEATURES:
        return torch.bmm(q.t().expand(s, m, m), grad.view(s, m, -1)).view(grad.shape)
    out = q.t() @ grad.transpose(0, 1).reshape(m, -1)
    return out.view((m, s) + tuple(grad.shape[2:])).transpose(0, 1).contiguous()


def _grouped_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """:func:`transform_weight_grad` for a grouped weight ``(S, k, *kernel)`` and blocks ``q`` ``(G, k, k)``."""
    g, k = q.shape[0], q.shape[-1]
    s = grad.shape[0]
    q = q.to(grad.dtype)
    if k == 1:  # depthwise: a scale per group, in the gradient's own layout
        scale = einops.repeat(q.reshape(g), "g -> (g s)", s=s // g)
        return grad * scale.view((s,) + (1,) * (grad.dim() - 1))
    taps = einops.rearrange(grad, "(g s) k ... -> g s k (...)", g=g)  # each group's outputs' rows, per tap
    out = einops.rearrange(q.mT, "g i k -> g 1 i k") @ taps
    return torch.empty_like(grad).copy_(out.reshape(grad.shape))
