"""Block FP8 (DeepSeek-V3's layout): dequantize a piece of a weight as it streams in; quantize one as it streams out.

A block-quantized weight ``W`` (``float8_e4m3fn``, 2-D) comes with
``W_scale_inv`` (float32, one value per ``block = (rows, cols)`` block of
``W``, edge blocks smaller: its shape is the ceil division of ``W``'s). Its
value is ``W.float() * scale[i // rows, j // cols]``. Both directions work on
any box of ``W`` (a rank's rows, a range of a streamed block, a piece cut
inside a block) given the scale rows it touches, so neither ever holds a
whole weight: the load (``_load.stream``) and the export
(``converters.to_safetensors(quantize="fp8-block")``) call these on the
pieces they stream.

Exactness: :func:`dequantize_into` gives ``(W.float() * scale)`` rounded to
the destination's dtype, bit for bit (NaN included). torch's own FP8 to
float conversion is a scalar loop on CPU (about 15 ns an element here); the
bits are instead widened to float16 with integer ops (e4m3 is a subset of
float16: the same 3 mantissa bits, a 4-bit exponent inside its 5) and
converted with the vectorized float16 path, the 2^8 exponent-bias difference
folded into the scale (a power of two: the product is rounded once, as the
plain ``float() * scale`` is).
"""

from __future__ import annotations

import threading
from typing import Iterator, Tuple

import torch

__all__ = ["FP8_MAX", "FP8_DTYPE", "SCRATCH_ELEMS", "band_rows", "dequantize_into", "block_amax", "scales_from_amax", "quantize_into"]

#: The largest finite ``float8_e4m3fn``: a block's scale is its amax / FP8_MAX (DeepSeek's quantizer).
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: e4m3 bits shifted into float16's place are 2^-8 of their value (bias 7 vs 15).
_BIAS = 256.0
#: float16 bits kept after the shift: the sign and the low 4 exponent + 3 mantissa bits.
_KEEP = torch.tensor(-16512, dtype=torch.int16)  # 0xBF80 as int16


def band_rows(row0: int, n: int, block_rows: int) -> Iterator[Tuple[int, int, int]]:
    """``(a, b, k)``: local rows ``[a, b)`` of a box whose first row is global ``row0``, in scale row ``k``.

        >>> list(band_rows(100, 200, 128))
        [(0, 28, 0), (28, 156, 1), (156, 200, 2)]
    """
    a = 0
    while a < n:
        k = (row0 + a) // block_rows
        b = min(n, (k + 1) * block_rows - row0)
        yield a, b, k
        a = b


def _col_scales(scale_rows: torch.Tensor, col0: int, m: int, block_cols: int) -> torch.Tensor:
    """The scale of each of the ``m`` columns from global column ``col0``, for each row of ``scale_rows`` (1-D or 2-D), widened."""
    k0, k1 = col0 // block_cols, -(-(col0 + m) // block_cols)
    cols = scale_rows[..., k0:k1].repeat_interleave(block_cols, dim=-1)
    at = col0 - k0 * block_cols
    return cols[..., at : at + m]


def _as_half(q: torch.Tensor, out16: torch.Tensor) -> torch.Tensor:
    """``q`` (e4m3) widened into ``out16`` (float16, same shape): 2^-8 of ``q``'s value, exactly."""
    bits = out16.view(torch.int16)
    bits.copy_(q.view(torch.int8))  # sign-extends: the sign lands in bit 15
    bits.bitwise_left_shift_(7).bitwise_and_(_KEEP)
    # e4m3fn's only NaN is S.1111.111: +NaN is the largest int8, -NaN the
    # largest uint8. Two byte reductions find it (rare: quantizers clamp).
    if int(q.view(torch.int8).max()) == 0x7F or int(q.view(torch.uint8).max()) == 0xFF:
        out16.masked_fill_((q.view(torch.uint8) & 0x7F) == 0x7F, float("nan"))
    return out16


def dequantize_into(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, row0: int, col0: int,
                    block: Tuple[int, int], scale_row0: int = 0) -> None:
    """``dst[i, j] = q[i, j].float() * scale[(row0 + i) // rows - scale_row0, (col0 + j) // cols]`` (rounded to ``dst``'s dtype).

    Args:
        dst: a 2-D floating-point destination (any strides: a live tensor's view).
        q: the ``float8_e4m3fn`` box of the weight, ``dst``'s shape (any strides).
        scale: float32 rows of the scale grid, its first row being global
            scale row ``scale_row0``; every column.
        row0, col0: the box's first global row and column.
        block: (rows, cols) of a block.

    One band of at most ``block[0]`` rows at a time: memory beyond ``dst``
    is two band-sized temporaries.
    """
    n, m = q.shape
    if not n or not m:
        return
    _dequantize(dst, q, scale, row0=row0, col0=col0, block=block, scale_row0=scale_row0)


#: Elements of the host scratch (float16 + float32: 6 bytes each) that
#: dequantizing reuses, one per thread (the load's reader threads dequantize
#: in parallel): fresh buffers per piece cost more in page faults than the
#: arithmetic (measured: 48 MB a piece, 200 ms).
SCRATCH_ELEMS = 1 << 20
_SCRATCH = threading.local()


def _scratch(n: int, m: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    if device.type != "cpu" or n * m > SCRATCH_ELEMS:
        return (torch.empty((n, m), dtype=torch.float16, device=device), torch.empty((n, m), dtype=torch.float32, device=device))
    if not hasattr(_SCRATCH, "half"):  # 6 MiB, freed with the thread
        _SCRATCH.half = torch.empty(SCRATCH_ELEMS, dtype=torch.float16)
        _SCRATCH.wide = torch.empty(SCRATCH_ELEMS, dtype=torch.float32)
    return _SCRATCH.half[: n * m].view(n, m), _SCRATCH.wide[: n * m].view(n, m)


def _segments(row0: int, n: int, block_rows: int, group: int) -> Iterator[Tuple[int, int, int]]:
    """``(a, b, bands)``: local rows ``[a, b)`` over ``bands`` scale rows: a partial first band, up to ``group`` whole bands at a time, a partial last one.

        >>> list(_segments(100, 400, 128, 2))
        [(0, 28, 1), (28, 284, 2), (284, 400, 1)]
    """
    a = min(n, (-row0) % block_rows)
    if a:
        yield 0, a, 1
    while n - a >= block_rows:
        k = min(group, (n - a) // block_rows)
        yield a, a + k * block_rows, k
        a += k * block_rows
    if a < n:
        yield a, n, 1


def _dequantize(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, row0: int, col0: int,
                block: Tuple[int, int], scale_row0: int) -> None:
    n, m = q.shape
    br, bc = block
    group = max(1, SCRATCH_ELEMS // (br * m))
    # A float32 destination with unit column stride takes the product itself (one copy less).
    direct = dst.dtype == torch.float32 and dst.device == q.device and dst.stride(-1) == 1
    for a, b, nb in _segments(row0, n, br, group):
        k0 = (row0 + a) // br - scale_row0
        # Columns in chunks that keep the scratch small enough to stay in
        # cache between the kernels (whole column blocks, but the ends).
        width = m if (b - a) * m <= SCRATCH_ELEMS else max(bc, SCRATCH_ELEMS // (b - a) // bc * bc)
        c = 0
        while c < m:
            e = min(m, c + width - (col0 + c) % bc if width < m else m)
            half, out = _scratch(b - a, e - c, q.device)
            if direct:
                out = dst[a:b, c:e]
            s = _col_scales(scale[k0 : k0 + nb], col0 + c, e - c, bc)  # (bands, cols)
            # Widen (exact), then one float32 multiply (the one rounding), then
            # the destination's dtype: plain kernels beat a mixed-dtype multiply.
            out.copy_(_as_half(q[a:b, c:e], half))
            if float(s.abs().max()) >= 2.0**120:  # the folded scale would overflow float32: the bias first (exact)
                out.mul_(_BIAS)
            else:
                s = s * _BIAS
            if nb == 1:
                out.mul_(s)
            else:
                out.view(nb, br, e - c).mul_(s.unsqueeze(1))
            if not direct:
                dst[a:b, c:e].copy_(out)
            c = e


def block_amax(amax: torch.Tensor, x: torch.Tensor, *, row0: int, col0: int, block: Tuple[int, int]) -> None:
    """Fold the box ``x`` (rows from global ``row0``, columns from ``col0``) into ``amax``, the grid of per-block max |x|.

    Boxes may arrive in any order and split blocks anywhere; NaN propagates
    (a block holding NaN has a NaN scale, which the caller refuses).
    """
    n, m = x.shape
    if not n or not m:
        return
    cols = (torch.arange(col0, col0 + m) // block[1])
    for a, b, k in band_rows(row0, n, block[0]):
        colmax = x[a:b].abs().amax(dim=0).float()
        amax[k].scatter_reduce_(0, cols, colmax, reduce="amax")


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Each block's scale: amax / :data:`FP8_MAX` (DeepSeek's); 1 for an all-zero block (its codes are all 0)."""
    s = amax / FP8_MAX
    return torch.where(amax > 0, s, torch.ones_like(s))


def quantize_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, *, row0: int, col0: int,
                  block: Tuple[int, int]) -> None:
    """``out = (x / scale-of-its-block).clamp(±FP8_MAX)`` as ``float8_e4m3fn`` (round to nearest), band by band.

    ``scale``: the whole scale grid (:func:`scales_from_amax`); ``x`` a box
    from global ``(row0, col0)``, any float dtype; ``out`` the same shape.
    """
    n, m = x.shape
    for a, b, k in band_rows(row0, n, block[0]):
        s = _col_scales(scale[k], col0, m, block[1])
        out[a:b].copy_(torch.div(x[a:b].float(), s).clamp_(-FP8_MAX, FP8_MAX))
