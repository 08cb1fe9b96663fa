"""Stream a planned load: read only the byte ranges this rank needs, verify them, copy each piece into its tensor.

``stream_into`` turns a :class:`~shardckpt._load.plan.LoadPlan` into byte
ranges (``_readers.Want``: one per saved piece, cut to at most
``SHARDCKPT_LOAD_RANGE_BYTES`` along dim 0), reads them through the one
verified reader (``_readers.read_verified``, or ``_replicas.read_once`` when
several ranks hold the same bytes) into a bounded, reused buffer pool
(pinned for CUDA targets), and ``copy_``-es each verified piece (casting
where the dtypes differ) straight into the live tensor — or into staging
tensors (``stage.py``) with ``atomic=True``. A piece whose saved bytes land
in a CPU tensor as they are (same dtype, contiguous box) is copied there by
the reader thread that read and checked it (``Want.sink``; one pass while
the bytes are in cache, out of a mapping of local files): the calling thread
copies only casts, strided boxes and device targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _fp8, _knobs, _p2p, _replicas
from .._collective import Comm
from .._format import torch_dtype
from .._format.checksum import copy_out
from .._io import byte_view, host_empty
from .._layout import box_view
from .._readers import BufferPool, ReadStats, Want, read_verified
from .._storage import Storage
from ..errors import CheckpointError, LoadFailedError, format_offenders
from .plan import LoadPlan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["StreamHook", "load_settings", "stream_into"]

#: ``load_into(stream=...)``: wraps the stream; called with ``(plan, run)``,
#: ``run`` being :func:`stream_into` bound to the plan, taking its
#: ``sources=``/``read=``/``stats=`` options.
StreamHook = Callable[[LoadPlan, Callable[..., ReadStats]], ReadStats]


def _strides(sizes: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Copy:
    """Deliver-time job: copy elements of a saved chunk (a box of it) into ``dst``."""

    target: int
    dst: torch.Tensor
    src_offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]  # the chunk's, contiguous
    first: int  # flat element index of the first byte read
    dtype: torch.dtype
    isz: int  # its element size


def _no_sink(target: int, dst: torch.Tensor, dtype: torch.dtype, nbytes: int) -> None:
    return None


_Sink = Optional[Tuple[Callable[[int, Optional[memoryview]], None], Optional[memoryview]]]


def _wants(plan: LoadPlan, dests: Sequence[Sequence[torch.Tensor]], range_bytes: int,
           sink: Callable[[int, torch.Tensor, torch.dtype, int], _Sink] = _no_sink, restore: bool = True) -> List[Want]:
    """Byte ranges to read, one per piece cut to at most ``range_bytes`` of its chunk (along dim 0).

    ``sink(target, dst, saved dtype, nbytes)``: the want's ``(Want.sink,
    Want.into)`` (None: delivered through ``place``); ``restore``: each
    want's ``Want.restore`` (False when the destinations are staging).
    """
    out: List[Want] = []
    for ti, t in enumerate(plan.targets):
        chunks = t.chunks
        dtype = torch_dtype(t.meta.dtype)
        isz = dtype.itemsize
        for dst_part, pieces in zip(dests[ti], t.pieces):
            for p in pieces:
                c = chunks[p.chunk]
                strides = _strides(c.sizes)
                if not p.sizes or math.prod(p.sizes) == 0:
                    if not p.sizes and c.nbytes:  # a 0-d tensor
                        out.append(_want(c, 0, c.nbytes, _Copy(ti, dst_part, (), (), (), 0, dtype, isz),
                                         sink(ti, dst_part, dtype, c.nbytes), restore))
                    continue
                row_bytes = strides[0] * isz
                rows = max(1, range_bytes // max(row_bytes, 1))
                for r in range(0, p.sizes[0], rows):
                    n = min(rows, p.sizes[0] - r)
                    src = (p.src_offsets[0] + r,) + tuple(p.src_offsets[1:])
                    sizes = (n,) + tuple(p.sizes[1:])
                    first = sum(o * st for o, st in zip(src, strides))
                    last = sum((o + k - 1) * st for o, k, st in zip(src, sizes, strides))
                    dst = box_view(dst_part, (p.dst_offsets[0] + r,) + tuple(p.dst_offsets[1:]), sizes)
                    out.append(_want(c, first * isz, (last + 1) * isz, _Copy(ti, dst, src, sizes, strides, first, dtype, isz),
                                     sink(ti, dst, dtype, (last + 1 - first) * isz), restore))
    return out


def _want(c, start: int, stop: int, job: "_Copy", sink: _Sink, restore: bool) -> Want:
    if sink is None:
        return Want(c, start, stop, job)
    return Want(c, start, stop, job, sink[0], into=sink[1], restore=restore)


def _byte_sink(dst: torch.Tensor, dtype: torch.dtype, nbytes: int) -> Optional[Tuple[Callable[[int, memoryview], None], memoryview]]:
    """``(put, view)``: ``put(pos, data)`` copies bytes to offset ``pos`` of ``dst``, ``view`` is ``dst``'s own writable bytes.

    When a want's saved bytes land in ``dst`` as they are: a plain
    contiguous CPU tensor of the saved dtype whose ``nbytes`` are exactly the
    want's (the saved box is contiguous in its chunk); else None (casts,
    strided boxes and device targets go through ``place``). The reader may
    read straight into ``view`` (``Want.into``; bf16 and every dtype alike:
    bytes). The copy is :func:`copy_out`'s, which releases the GIL, so
    reader threads copy in parallel (torch's ``copy_`` would start its own
    thread team in each of them), and bypasses the cache
    (``SHARDCKPT_LOAD_STREAM_COPY``): these bytes are not read again during
    the load.
    """
    if (nbytes == 0 or dst.device.type != "cpu" or dst.dtype != dtype or type(dst) not in (torch.Tensor, torch.nn.Parameter)
            or dst.is_conj() or dst.is_neg() or not dst.is_contiguous() or dst.numel() * dst.element_size() != nbytes):
        return None
    mv = byte_view(dst.detach())
    if mv.readonly:  # without NumPy, a copy: not the tensor's memory
        return None

    streaming = _knobs.LOAD_STREAM_COPY

    def put(pos: int, data: memoryview) -> None:
        copy_out(mv[pos : pos + len(data)], data, streaming=streaming)

    return put, mv


def _scale_wants(plan: LoadPlan) -> List[Want]:
    """One byte range per block-FP8 target: the rows of its scale grid that the rows this rank reads fall in.

    A rank's pieces of a weight (its shard's rows, cut anywhere, inside a
    block too) need only the scale rows of the row blocks they touch; the
    grid is narrow (one float per 128 columns), so every column is read.
    """
    out: List[Want] = []
    for ti, t in enumerate(plan.targets):
        if t.scale is None:
            continue
        rows = [(t.chunks[p.chunk].offsets[0] + p.src_offsets[0], p.sizes[0])
                for pieces in t.pieces for p in pieces if p.sizes and all(p.sizes)]
        if not rows:
            continue
        b0 = t.scale.block[0]
        k0, k1 = min(r // b0 for r, _ in rows), max(-(-(r + n) // b0) for r, n in rows)
        row_bytes = t.scale.chunk.sizes[1] * torch.empty((), dtype=torch_dtype(t.scale.dtype)).element_size()
        out.append(Want(t.scale.chunk, k0 * row_bytes, k1 * row_bytes, (ti, k0, k1)))
    return out


def _fp8_sinks(plan: LoadPlan, wants: List[Want], scales: Dict[int, Tuple[torch.Tensor, int]],
               touched: Dict[int, None]) -> List[Want]:
    """``wants`` with a sink for each block-FP8 piece into a plain CPU tensor: dequantized by the reader thread that read it.

    The one pass of the plain copies (``_byte_sink``) for FP8 pieces: the
    reader thread checks a piece and dequantizes it where it lies (out of
    the file's mapping, while in cache), the reader threads in parallel
    (``_fp8.box_sink``). ``scales`` is filled before the first piece is read.
    """
    out: List[Want] = []
    for w in wants:
        job: _Copy = w.tag
        scale = plan.targets[job.target].scale
        dst = job.dst
        if (scale is None or w.sink is not None or len(job.sizes) != 2 or not all(job.sizes) or dst.device.type != "cpu"
                or type(dst) not in (torch.Tensor, torch.nn.Parameter)):
            out.append(w)
            continue
        put = _fp8.box_sink(dst.detach(), width=job.strides[0], first=job.first,
                            origin=(w.chunk.offsets[0] + job.src_offsets[0], w.chunk.offsets[1] + job.src_offsets[1]),
                            block=scale.block, scales=partial(scales.__getitem__, job.target))

        def sink(pos: int, data: Optional[memoryview], put=put, ti: int = job.target) -> None:
            # A want without ``into`` (dequantized here) is always handed its bytes.
            assert data is not None
            touched[ti] = None
            put(pos, data)

        out.append(replace(w, sink=sink))
    return out


def _read_scales(storage: Storage, plan: LoadPlan, read: Callable[..., ReadStats], *, threads: int,
                 pool: BufferPool, stats: ReadStats) -> Dict[int, Tuple[torch.Tensor, int]]:
    """``{target: (float32 scale rows, first row)}`` of the block-FP8 targets, read through the verified reader first."""
    got: Dict[int, Tuple[torch.Tensor, int]] = {}

    def deliver(w: Want, data: memoryview, owner, off: int) -> None:
        ti, k0, k1 = w.tag
        t = plan.targets[ti]
        dtype = t.scale.dtype if t.scale is not None else "F32"  # only block-FP8 targets have scale wants
        raw = torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype))
        got[ti] = (raw.view(k1 - k0, -1).float(), k0)

    wants = _scale_wants(plan)
    if wants:
        stats.needed_bytes += sum(w.stop - w.start for w in wants)
        read(storage, wants, deliver, threads=threads, pool=pool, stats=stats)
    return got


def _host_alloc(pinned: bool):
    """The pool's allocator: plain host tensors, or page-locked ones of exactly the size asked."""

    def alloc(n: int):
        t = host_empty(n)  # byte_view can view it writably, NumPy or not
        if pinned and n and int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)) != 0:
            pinned_t = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # registration refused: the allocator's
            return byte_view(pinned_t), (pinned_t, False)
        return byte_view(t), (t, pinned and n > 0)

    def free(owner) -> None:
        t, registered = owner
        if registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            except Exception:  # the memory is freed either way; never fail a load on this
                pass

    return alloc, free


def load_settings(cuda: bool, *, threads: Optional[int] = None, buffer_bytes: Optional[int] = None) -> Tuple[int, int]:
    """``(io threads, buffer bytes)`` of a load: the values given, else the defaults for its targets.

    CUDA targets: ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` and
    ``SHARDCKPT_LOAD_CUDA_BUFFER_BYTES`` (pinned buffers, so reads overlap
    the device copies); otherwise ``SHARDCKPT_LOAD_CPU_IO_THREADS`` (at most
    one per usable core) and
    ``SHARDCKPT_LOAD_BUFFER_BYTES`` (host memory beyond the model stays
    small). Knobs are read at call time.

        >>> load_settings(False, threads=2, buffer_bytes=1 << 20)
        (2, 1048576)
    """
    if threads is None:
        threads = _knobs.LOAD_CUDA_IO_THREADS if cuda else _knobs.LOAD_CPU_IO_THREADS
    if buffer_bytes is None:
        buffer_bytes = _knobs.LOAD_CUDA_BUFFER_BYTES if cuda else _knobs.LOAD_BUFFER_BYTES
    return threads, buffer_bytes


def stream_into(
    storage: Storage,
    plan: LoadPlan,
    staged: Optional[Sequence[Sequence[torch.Tensor]]],
    *,
    threads: Optional[int] = None,
    buffer_bytes: Optional[int] = None,
    stats: Optional[ReadStats] = None,
    comm: Optional[Comm] = None,
    process_group: Optional["ProcessGroup"] = None,
    sources: Optional[_replicas.Sources] = None,
    read: Callable[..., ReadStats] = read_verified,
) -> ReadStats:
    """Read, verify and copy every piece of ``plan`` into its tensor (or into ``staged``).

    ``threads``/``buffer_bytes`` None: :func:`load_settings` for the targets.
    With ``comm`` of several ranks (the load's; collective then), a byte
    range several ranks need is read by one of them and sent to the others
    over ``process_group`` (``shardckpt/_replicas.py``;
    ``SHARDCKPT_LOAD_READ_ONCE=0`` turns it off). With ``sources`` (the
    memory tier: ``storage`` holds only some files), a range of a file this
    rank's storage lacks is read by a rank that has it and sent here, over
    the same transfer engine (always on). ``read``: the verified reader
    (``_readers.read_verified``, or a wrapper of it).

    Raises:
        ChecksumMismatchError / CorruptCheckpointError / StorageError: as the
            reader does; unless staging, the message names the tensors this
            rank had already overwritten.
    """
    dests = staged if staged is not None else [[dst for _, dst in t.parts] for t in plan.targets]
    cuda = staged is None and torch.cuda.is_available() and any(d.is_cuda for ds in dests for d in ds)
    if threads is None and not cuda and any(t.scale is not None for t in plan.targets):
        threads = max(_knobs.LOAD_CPU_IO_THREADS, _fp8.host_threads())  # the readers dequantize: CPU work
    threads, buffer_bytes = load_settings(cuda, threads=threads, buffer_bytes=buffer_bytes)
    range_bytes = min(_knobs.LOAD_RANGE_BYTES, buffer_bytes)
    alloc, free = _host_alloc(cuda)
    pool = BufferPool(buffer_bytes, slot_bytes=range_bytes, alloc=alloc, free=free)
    touched: Dict[int, None] = {}
    events: List[Any] = []
    dev_scales: Dict[Tuple[int, str], torch.Tensor] = {}  # block-FP8 scale rows on a target's device

    def place(w: Want, raw: torch.Tensor):
        """Copy a want's bytes (``raw``: uint8, host or device) into its destination; a fence or None."""
        job: _Copy = w.tag
        isz = job.isz
        if raw.data_ptr() % isz:
            raw = raw.clone()  # a foreign file's chunk not aligned to its item size
        flat = raw.view(job.dtype)
        # as_strided's offset counts from the start of the storage, not of the view.
        at = flat.storage_offset() + sum(o * s for o, s in zip(job.src_offsets, job.strides)) - job.first
        src = flat.as_strided(job.sizes, job.strides, at)
        touched[job.target] = None
        scale = plan.targets[job.target].scale
        if scale is not None:  # block FP8: dequantized as it lands
            rows, k0 = scales[job.target]
            box: Dict[str, Any] = dict(row0=w.chunk.offsets[0] + job.src_offsets[0], col0=w.chunk.offsets[1] + job.src_offsets[1],
                                       block=scale.block, scale_row0=k0)
            if not (job.dst.is_cuda or src.is_cuda):
                _fp8.dequantize_into(job.dst, src, rows, **box)  # host kernels, this thread
                return None
            # A device target: the FP8 bytes go to the device (half those of
            # bf16) and are dequantized there, queued behind the copy.
            dev = job.dst.device if job.dst.is_cuda else src.device
            key = (job.target, str(dev))
            if key not in dev_scales:
                dev_scales[key] = rows.to(dev)
            q = src if src.device == dev else torch.empty(job.sizes, dtype=src.dtype, device=dev).copy_(src, non_blocking=True)
            dst = job.dst if job.dst.device == dev else torch.empty(job.sizes, dtype=job.dst.dtype, device=dev)
            _fp8.dequantize_native(dst, q, dev_scales[key], **box)
            if dst is not job.dst:
                job.dst.copy_(dst)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            return ev
        if job.dst.is_cuda or src.is_cuda:
            job.dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            return ev
        job.dst.copy_(src)
        return None

    def deliver(w: Want, data: memoryview, owner, off: int):
        return place(w, owner[0][off : off + len(data)])

    def sink(target: int, dst: torch.Tensor, dtype: torch.dtype, nbytes: int):
        """Verified bytes copied into the tensor by the reader thread that verified them (one pass, in cache)."""
        got = _byte_sink(dst, dtype, nbytes)
        if got is None:
            return None
        copy, view = got

        def put(pos: int, data: Optional[memoryview]) -> None:
            touched[target] = None
            if data is not None:  # None: the reader read the verified bytes into ``view`` itself
                copy(pos, data)

        return put, view

    # Replicated ranges read once (several ranks) hand every want to their
    # own transfer engine: no sinks there.
    once = comm is not None and comm.world > 1 and (_replicas.enabled() or sources is not None)
    wants = _wants(plan, dests, range_bytes, _no_sink if cuda or once else sink, restore=staged is None)
    scales: Dict[int, Tuple[torch.Tensor, int]] = {}
    if not (cuda or once):
        wants = _fp8_sinks(plan, wants, scales, touched)
    stats = stats or ReadStats()
    stats.needed_bytes += sum(w.stop - w.start for w in wants)
    try:
        with torch.no_grad():
            scales.update(_read_scales(storage, plan, read, threads=threads, pool=pool, stats=stats))
            if sources is not None and comm is not None and comm.world > 1 and not _p2p.transfer_device(process_group):
                raise LoadFailedError(
                    f"{comm.op}: the process group's backend ({process_group!r}) can send neither CPU nor CUDA tensors: "
                    "the memory tier needs gloo or NCCL"
                )
            if comm is not None and comm.world > 1 and (_replicas.enabled() or sources is not None) and _p2p.transfer_device(process_group):
                # Ranges several ranks need are read by one and sent to the others.
                return _replicas.read_once(
                    storage, wants, comm=comm, group=process_group, read=read, deliver=deliver, place=place,
                    shareable=lambda w: plan.targets[w.tag.target].replicated and _replicas.enabled(),
                    pool=pool, threads=threads, stats=stats,
                    # The memory tier's rounds carry a shard, not a few replicated tensors: fewer, larger ones.
                    round_bytes=max(range_bytes, buffer_bytes if sources is not None else buffer_bytes // 2),
                    sources=sources,
                )
            return read(storage, wants, deliver, threads=threads, pool=pool, stats=stats)
    except CheckpointError as e:
        if staged is None and touched:
            names = [plan.targets[i].name for i in touched]
            raise type(e)(f"{e}. Tensors already overwritten: {format_offenders(names)}; load a good checkpoint "
                          "into this state again (atomic=True stages first and changes nothing on failure)") from None
        raise
    finally:
        pool.close()  # waits for the device copies; releases the pinned memory
        if events:
            events[-1].synchronize()
