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

Exactness: every dequantizing path gives ``(W.float() * scale)`` rounded to
the destination's dtype, bit for bit (NaN included).

Host (CPU) path, the one the load streams through (:func:`box_sink`: the
reader thread that read and checked a piece of the file dequantizes it while
it is in cache, straight out of the mapping). torch's own FP8 to float
conversion is a scalar loop on CPU (about 12 ns an element here); instead
the e4m3 bits are moved into float32's place with integer ops (sign to bit
31, the 4 exponent + 3 mantissa bits to bits 20..26: ``x * 2^-120``
exactly, e4m3's subnormals landing on float32's), then one float32 multiply
by ``scale * 2^120`` (a power of two: exact; the one rounding, as the plain
``float() * scale``) and the destination's vectorized conversion. Each
thread runs these kernels serially (:func:`_serial`), a band at a time: the
load's reader threads are the parallelism, and torch's intra-op team in
every one of them would oversubscribe the cores (measured: 30x slower on a
loaded 2-core host).

Device (CUDA) path (:func:`dequantize_native`): the load copies the FP8
bytes to the device (half those of bf16) and dequantizes there with torch's
own ``float()``, multiply and cast: the reference's ops themselves.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

from . import _knobs

__all__ = ["FP8_MAX", "FP8_DTYPE", "SCRATCH_ELEMS", "band_rows", "box_sink", "dequantize_into", "dequantize_native",
           "host_threads", "block_amax", "scales_from_amax", "quantize_into"]

#: The largest finite ``float8_e4m3fn``: a block's scale is its amax / FP8_MAX (DeepSeek's quantizer).
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: e4m3 bits shifted into float32's place are 2^-120 of their value (exponent bias 7 vs 127).
_BIAS = 2.0**120
#: A scale from this up would overflow once the bias is folded in (2^8 * 2^120 = 2^128): the bias goes first.
_FOLD_LIMIT = 2.0**8
#: After ``int32(code) << 20``: keep the sign (bit 31) and the code's 7 low bits (bits 20..26).
_MASK = torch.tensor(-2013265920 - 1048576, dtype=torch.int32)  # 0x87F00000 as int32
#: torch runs an op of at most this many elements on the calling thread whatever its thread count (ATen's GRAIN_SIZE).
_GRAIN = 32768
#: Elements of the per-thread int32 scratch a host dequantize works in (2 MiB: a 128-row band of a
#: 4096-wide weight a step). Fewer, larger steps beat L2-sized ones: each step is a dozen Python
#: calls taking the GIL between kernels (measured on a loaded 2-core host, 0.25 GB load: 0.49 s
#: at 2^19, 0.81 s at 2^17, 0.59 s at 2^20).
SCRATCH_ELEMS = 1 << 19


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


def dequantize_native(dst: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, row0: int, col0: int,
                      block: Tuple[int, int], scale_row0: int = 0) -> None:
    """:func:`dequantize_into` through torch's own ``q.float() * scale`` and cast, on ``q``'s device: the CUDA path.

    The reference's ops themselves, a few bands at a time (one float32
    temporary of at most the box's size on the device). ``scale`` and
    ``dst`` on ``q``'s device. Slow on CPU (torch's FP8 conversion is a
    scalar loop there), where it is only the fallback of the host path.
    """
    n, m = q.shape
    if not n or not m:
        return
    br, bc = block
    for a, b, nb in _segments(row0, n, br, max(1, n // br)):
        k0 = (row0 + a) // br - scale_row0
        s = _col_scales(scale[k0 : k0 + nb], col0, m, bc).unsqueeze(1)  # (bands, 1, cols)
        prod = q[a:b].float().unflatten(0, (nb, -1)).mul_(s)
        dst[a:b].copy_(prod.flatten(0, 1))


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

    CUDA tensors: :func:`dequantize_native` on the device. CPU: the host
    kernels, serially in the calling thread, a band at a time (memory
    beyond ``dst``: a 2 MiB scratch per thread).

        >>> q = torch.full((2, 2), 2.0).to(FP8_DTYPE); out = torch.empty(2, 2)
        >>> dequantize_into(out, q, torch.tensor([[0.5]]), row0=0, col0=0, block=(128, 128)); out.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    n, m = q.shape
    if not n or not m:
        return
    if q.is_cuda or dst.is_cuda:
        dequantize_native(dst, q, scale, row0=row0, col0=col0, block=block, scale_row0=scale_row0)
        return
    codes = q.view(torch.int8).numpy()
    with _serial() as limit:
        _dequantize_host(dst, codes, scale, row0=row0, col0=col0, block=block, scale_row0=scale_row0,
                         nan=_has_nan(codes), limit=limit)


def box_sink(dst: torch.Tensor, *, width: int, first: int, origin: Tuple[int, int], block: Tuple[int, int],
             scales: Callable[[], Tuple[torch.Tensor, int]]) -> Callable[[int, Any], None]:
    """``put(pos, data)`` for the load's reader threads: FP8 codes of a box of a saved 2-D chunk, dequantized into ``dst`` as they come.

    Args:
        dst: the box's CPU destination, ``(n, m)``.
        width: the saved chunk's row length (elements).
        first: flat index in the chunk of the box's first element; the
            want's bytes run from it to the box's last element (whole rows
            of the chunk when the box spans them), so ``data`` at ``pos`` is
            chunk elements ``first + pos ...``.
        origin: the global (row, column) of the box's first element.
        block: (rows, cols) of a block.
        scales: ``() -> (float32 scale rows, first scale row)``, read before
            any piece arrives.

    ``data`` (any buffer: a read-only mapping of the file) is read where it
    lies and may end or start inside a row: whole rows in one pass, the
    pieces of rows at its ends on their own. Thread-safe: pieces of one box
    go to disjoint elements.
    """
    n, m = dst.shape

    def put(pos: int, data: Any) -> None:
        np = _numpy()
        arr = np.frombuffer(data, dtype=np.int8)
        e0, e1 = first + pos, first + pos + arr.size
        rows, k0 = scales()
        nan = _has_nan(arr)
        # Box rows whose elements all lie in [e0, e1): [i_a, i_b).
        i_a = max(0, -(-(e0 - first) // width))
        i_b = min(n, (e1 - first - m) // width + 1) if e1 - first >= m else 0
        i_b = max(i_a, i_b)
        with _serial() as limit:

            def run(i0: int, i1: int, c0: int, c1: int) -> None:
                start = first + i0 * width + c0 - e0  # the box element (i0, c0) in arr
                q = np.lib.stride_tricks.as_strided(arr[start:], shape=(i1 - i0, c1 - c0), strides=(width, 1), writeable=False)
                _dequantize_host(dst[i0:i1, c0:c1], q, rows, row0=origin[0] + i0, col0=origin[1] + c0, block=block,
                                 scale_row0=k0, nan=nan, limit=limit)

            if i_a < i_b:
                run(i_a, i_b, 0, m)
            for i in {i_a - 1, i_b} - set(range(i_a, i_b)):  # pieces of rows at the ends
                if 0 <= i < n:
                    lo = max(e0, first + i * width)
                    hi = min(e1, first + i * width + m)
                    if lo < hi:
                        c = lo - first - i * width
                        run(i, i + 1, c, c + hi - lo)

    return put


def host_threads() -> int:
    """Reader threads for a load that dequantizes on the host: one per usable core, shared among the ranks of the node.

    The readers dequantize (CPU work, each thread serially), so a block-FP8
    load into CPU tensors uses more of them than a plain copy
    (``SHARDCKPT_LOAD_CPU_IO_THREADS``); ``LOCAL_WORLD_SIZE`` (torchrun's)
    divides the cores among the node's ranks.
    """
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, _knobs.usable_cpus() // local)


def _numpy():
    import numpy  # noqa: PLC0415  (the host path only: `import shardckpt` stays cheap)

    return numpy


def _has_nan(codes: Any) -> bool:
    """Whether an int8 array of e4m3 codes may hold NaN (S.1111.111: +NaN the largest int8, -NaN the largest uint8). Rare: quantizers clamp."""
    return bool(codes.size) and (int(codes.max()) == 0x7F or int(codes.view("uint8").max()) == 0xFF)


_SCRATCH = threading.local()


def _scratch() -> Tuple[torch.Tensor, Any]:
    """This thread's int32 scratch of :data:`SCRATCH_ELEMS` and its NumPy view (freed with the thread)."""
    got = getattr(_SCRATCH, "bits", None)
    if got is None or got[0].numel() != SCRATCH_ELEMS:
        t = torch.empty(SCRATCH_ELEMS, dtype=torch.int32)
        got = _SCRATCH.bits = (t, t.numpy())
    return got


def _dequantize_host(dst: torch.Tensor, q: Any, scale: torch.Tensor, *, row0: int, col0: int, block: Tuple[int, int],
                     scale_row0: int, nan: bool, limit: int) -> None:
    """The host kernels on a box: ``q`` an int8 NumPy view of the codes (any strides), ``dst`` a CPU tensor of its shape.

    ``limit``: the most elements one torch op may take and stay on this thread.
    """
    np = _numpy()
    n, m = q.shape
    if not n or not m:
        return
    br, bc = block
    if not _keeps_denormals():  # flush-to-zero on: the shifted subnormal codes would read as 0; the reference's own ops
        codes = torch.from_numpy(np.array(q, dtype=np.int8)).view(FP8_DTYPE)
        dequantize_native(dst, codes, scale, row0=row0, col0=col0, block=block, scale_row0=scale_row0)
        return
    bits, bits_np = _scratch()
    room = min(SCRATCH_ELEMS, limit)
    first_k = row0 // br - scale_row0
    sk = scale[first_k : (row0 + n - 1) // br - scale_row0 + 1]
    two_step = bool(float(sk.abs().max()) >= _FOLD_LIMIT)  # NaN scales: False (NaN either way)
    # Every column's scale, bias folded in (exact: a power of two), once a call.
    sw = _col_scales(sk if two_step else sk * _BIAS, col0, m, bc)  # (bands, m)
    direct = dst.dtype == torch.float32
    for a, b, k, c, e in _steps(row0, n, m, br, bc, col0, room):
        h, w = b - a, e - c
        t = bits[: h * w].view(h, w)
        np.copyto(bits_np[: h * w].reshape(h, w), q[a:b, c:e], casting="unsafe")  # sign-extends
        t.bitwise_left_shift_(20).bitwise_and_(_MASK)
        f = t.view(torch.float32)  # the codes' values * 2^-120, exactly (subnormals too)
        if two_step:
            f.mul_(_BIAS)  # exact: the values themselves
        nb = -(-(row0 + b) // br) - (row0 + a) // br  # scale rows under the step
        s = sw[k - row0 // br : k - row0 // br + nb, c:e]
        out = dst[a:b, c:e]
        if nb == 1:
            torch.mul(f, s, out=out) if direct else f.mul_(s)
        elif direct:
            torch.mul(f.unflatten(0, (nb, -1)), s.unsqueeze(1), out=out.unflatten(0, (nb, -1)))
        else:
            f.unflatten(0, (nb, -1)).mul_(s.unsqueeze(1))
        if not direct:
            out.copy_(f)
        if nan:
            out.masked_fill_(torch.from_numpy((q[a:b, c:e].view(np.uint8) & 0x7F) == 0x7F), float("nan"))


def _steps(row0: int, n: int, m: int, br: int, bc: int, col0: int, room: int) -> Iterator[Tuple[int, int, int, int, int]]:
    """``(a, b, k, c, e)``: boxes ``[a, b) x [c, e)`` of at most ``room`` elements covering ``n x m``, each inside scale row ``k`` or over whole ones.

    Whole rows where they fit (the destination's rows stay contiguous),
    several whole bands where those fit; else pieces of whole column blocks.

        >>> list(_steps(100, 200, 64, 128, 128, 0, 4096))
        [(0, 28, 0, 0, 64), (28, 92, 1, 0, 64), (92, 156, 1, 0, 64), (156, 200, 2, 0, 64)]
    """
    rows = room // m if m <= room else 0
    if rows >= br:  # whole bands at once
        for a, b, _ in _segments(row0, n, br, rows // br):
            yield a, b, (row0 + a) // br, 0, m
        return
    if rows:  # pieces of bands, whole rows
        for a0, b0, k in band_rows(row0, n, br):
            for a in range(a0, b0, rows):
                yield a, min(b0, a + rows), k, 0, m
        return
    width = room // min(n, br)
    width = width // bc * bc if width >= bc else max(1, width)
    for a0, b0, k in band_rows(row0, n, br):
        for a in range(a0, b0, max(1, room // width)):
            b = min(b0, a + max(1, room // width))
            c = 0
            while c < m:
                e = min(m, c + width - (col0 + c) % bc) if width % bc == 0 else min(m, c + width)
                yield a, b, k, c, e
                c = e


def _keeps_denormals() -> bool:
    """Whether this thread's float arithmetic keeps subnormal inputs (not ``torch.set_flush_denormal(True)``'s DAZ)."""
    np = _numpy()
    return bool(np.float32(1.4e-45) * np.float32(2.0) != 0)


_OMP: Optional[Any] = None
_OMP_LOCK = threading.Lock()


def _omp_threads() -> Any:
    """``(get, set)``: ``omp_get_max_threads``/``omp_set_num_threads`` of the OpenMP runtime already in the process (torch's first), or False."""
    global _OMP
    with _OMP_LOCK:
        if _OMP is None:
            _OMP = False
            try:
                with open("/proc/self/maps") as f:
                    libs = {line.split()[-1] for line in f if ".so" in line}
            except OSError:  # no /proc (macOS): torch's own threads there, ops kept under the grain size
                libs = set()
            mine = os.path.dirname(torch.__file__)
            for path in sorted(libs, key=lambda p: (not p.startswith(mine), p)):
                if not any(k in os.path.basename(path) for k in ("gomp", "iomp", "libomp")):
                    continue
                try:
                    lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
                    get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
                except (OSError, AttributeError):
                    continue
                get.argtypes, get.restype = [], ctypes.c_int
                put.argtypes, put.restype = [ctypes.c_int], None
                _OMP = (get, put)
                break
        return _OMP


@contextmanager
def _serial() -> Iterator[int]:
    """torch ops in this thread run on it alone for the block; yields how many elements one op may take and stay so.

    The load's reader threads are the parallelism: torch's intra-op team
    started from each would oversubscribe the cores. OpenMP's thread count
    is per thread, so it is set to 1 here for the block and restored (no
    other thread sees it); where that cannot be done (no OpenMP runtime
    found, or not torch's), ops stay under torch's grain size, which it
    never splits.
    """
    if torch.get_num_threads() == 1:  # also sets this thread's OpenMP count up, the first time
        yield SCRATCH_ELEMS
        return
    omp = _omp_threads()
    if not omp:
        yield _GRAIN
        return
    get, put = omp
    before = get()
    put(1)
    try:
        yield SCRATCH_ELEMS if torch.get_num_threads() == 1 else _GRAIN
    finally:
        put(before)


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
