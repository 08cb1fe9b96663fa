"""One unsharded file: ``.safetensors``, or a ``.pt`` that ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
import zipfile
from typing import TYPE_CHECKING, Any, Dict, List

import torch

from shardckpt._format import torch_dtype
from shardckpt._format.checksum import checksum
from shardckpt._format.values import TAG, decode_value
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointExistsError, UnsupportedStateError

from ._common import WANT_BYTES, Reader, Streamer, run_parallel, write_plain
from ._options import ConvertResult, Options, Progress, SelectOptions, check_apart, out_dtype, parse_dtype, split_url
from ._safetensors import export_names
from ._source import BLOCK_BYTES, OutEntry, open_checkpoint, whole_entry

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["to_full"]

log = logging.getLogger("shardckpt")

_PT_SUFFIXES = (".pt", ".pth", ".bin")


def to_full(src: str, dst: str, *, dtype: Any = None, **options: Unpack[SelectOptions]) -> ConvertResult:
    """Write a checkpoint as one unsharded file, streaming.

    ``dst`` ending in ``.safetensors``: every tensor under its full
    checkpoint name (``model.emb.weight``, ``optim.state...``) — tensors
    only, plain values are not kept. Ending in ``.pt``/``.pth``/``.bin``: the
    whole saved structure as ``torch.save`` would write it (nested dicts,
    plain values, tensors), readable with ``torch.load(weights_only=True)``
    and with no pickle of code; with ``keys``/``key_map`` it is a flat
    ``{name: tensor}`` dict.

    Memory stays at a few 16 MiB blocks for both formats: the ``.pt`` file is
    laid out by ``torch.save`` under ``torch.serialization.skip_data`` with
    never-touched placeholder tensors, then each tensor's bytes are written
    at its record's offset and the zip CRC-32s are filled in. A remote
    ``.pt`` destination is built in the local temp directory and uploaded
    (needs that much local disk).

    Args:
        src: a shardckpt checkpoint or safetensors directory/file.
        dst: output file path or fsspec URL.
        dtype: cast floating-point tensors; int/bool keep their dtype.
        **options: :class:`SelectOptions`: ``keys`` select tensors (full
            checkpoint names), ``key_map`` renames them; ``storage_options``
            for ``src``, ``dst_storage_options``, ``overwrite`` an existing
            ``dst``, ``progress``, ``io_threads``.

    Raises:
        ValueError: ``dst`` has another suffix.
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False.
        ChecksumMismatchError: the source is damaged (``dst`` is not written).

    Local ``dst`` is written to a hidden temp file and renamed into place.

    Example:
        >>> converters.to_full("run/step-9", "model_full.safetensors")   # doctest: +SKIP
    """
    opts = Options.of("to_full", options, select=True)
    check_apart(src, dst)
    source = open_checkpoint(src, opts.storage_options)
    names = export_names(source, prefix=None, keys=opts.keys, key_map=opts.key_map)
    cast = parse_dtype(dtype)
    entries = [whole_entry(source.tensors[n], out, out_dtype(source.tensors[n].dtype, cast)) for n, out in names.items()]
    reader = Reader(source, threads=opts.io_threads)
    reader.check_source_files(list(names))
    lower = dst.lower()
    if lower.endswith(".safetensors"):
        return _write_single(dst, entries, reader, opts)
    if not lower.endswith(_PT_SUFFIXES):
        raise ValueError(f"to_full: {dst!r} must end in .safetensors or one of {', '.join(_PT_SUFFIXES)}")
    flat = opts.keys is not None or opts.key_map is not None or source.values is None
    by_name = {e.src.name: e for e in entries}
    return _write_pt(dst, source.values, by_name, reader, opts, flat=flat)


def _write_single(dst: str, entries: List[OutEntry], reader: Reader, opts: Options) -> ConvertResult:
    """One plain ``.safetensors`` file: built under a hidden name and renamed into place where the storage can."""
    parent, base = split_url(dst)
    root = Storage(parent, storage_options=opts.dst_storage_options)
    if root.exists(base) and not opts.overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True to replace it")
    if not root.caps.atomic_rename:
        # An object appears whole when its upload completes; removed again if the source fails its checks.
        res = write_plain(root, {base: entries}, reader, opts, desc="to_full")
    else:
        tmp = f".{base}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            res = write_plain(root, {tmp: entries}, reader, opts, desc="to_full")
            root.rename(tmp, base)
        finally:
            root.remove(tmp)
    return res._replace(url=dst, files=[base])


def _placeholders(values: Any, by_name: Dict[str, OutEntry], flat: bool):
    """The structure to ``torch.save`` with untouched ``torch.empty`` tensors, and name of each tensor by id."""
    names: Dict[int, OutEntry] = {}

    def ph(e: OutEntry) -> torch.Tensor:
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        names[id(t)] = e
        return t

    if flat:
        return {e.key: ph(e) for e in by_name.values()}, names

    skip = object()
    skipped: List[str] = []

    def walk(node, path):
        if isinstance(node, dict):
            kind = node.get(TAG)
            if kind == "tensor":
                e = by_name.get(node.get("name"))
                if e is None:
                    raise UnsupportedStateError(f"values refer to tensor {node.get('name')!r}, which the checkpoint lacks")
                return ph(e)
            if kind == "per_rank":
                # One value per saving rank (RNGState, PerRank): a single
                # file has no place for them, and a resumed job reads them
                # from the checkpoint itself.
                skipped.append(path or "<root>")
                return skip
            if kind == "tuple":
                return tuple(x for x in (walk(x, f"{path}.{i}") for i, x in enumerate(node["items"])) if x is not skip)
            if kind == "dict":
                out = ((decode_value(k), walk(v, f"{path}.{decode_value(k)}")) for k, v in node["items"])
                return {k: v for k, v in out if v is not skip}
            if kind == "bytes":
                # torch.load(weights_only=True) reads bytes but not io.BytesIO.
                return bytes(decode_value(dict(node, io=False)))
            if kind is not None:
                return decode_value(node)
            out = ((k, walk(v, f"{path}.{k}" if path else k)) for k, v in node.items())
            return {k: v for k, v in out if v is not skip}
        if isinstance(node, list):
            return [x for x in (walk(x, f"{path}.{i}") for i, x in enumerate(node)) if x is not skip]
        return node

    obj = walk(values, "")
    if obj is skip:
        obj = {}
    per_rank = tuple(f"{p}.@rank" for p in skipped)
    missing = {n for n in set(by_name) - {e.src.name for e in names.values()} if not n.startswith(per_rank)}
    if skipped:
        log.warning(
            "shardckpt: to_full: per-rank values (RNGState, PerRank) are not exported to a single file: skipped %s",
            ", ".join(sorted(skipped)[:20]),
        )
    if missing:
        # Tensors the values tree does not reach still belong in a full file.
        if not isinstance(obj, dict):
            obj = {"values": obj}
        for n in sorted(missing):
            obj[n] = ph(by_name[n])
    return obj, names


def _leaves(obj) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def _record_map(path: str) -> Dict[int, Dict[str, Any]]:
    """data offset -> {name, size, crc_at (data descriptor CRC position), cd_at (central directory CRC position)}."""
    out: Dict[int, Dict[str, Any]] = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        infos = z.infolist()
        start_dir = z.start_dir
        cd_pos: Dict[str, int] = {}
        f.seek(start_dir)
        pos = start_dir
        for _ in infos:
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                break
            n, m, k = struct.unpack("<HHH", head[28:34])
            name = f.read(n).decode("utf-8")
            cd_pos[name] = pos + 16
            f.seek(m + k, os.SEEK_CUR)
            pos += 46 + n + m + k
        for zi in infos:
            f.seek(zi.header_offset)
            local = f.read(30)
            n, m = struct.unpack("<HH", local[26:30])
            data = zi.header_offset + 30 + n + m
            desc = None
            if zi.flag_bits & 0x08:
                f.seek(data + zi.file_size)
                sig = f.read(4)
                desc = data + zi.file_size + (4 if sig == b"PK\x07\x08" else 0)
            out[data] = {"name": zi.filename, "size": zi.file_size, "crc_at": desc,
                         "local_crc_at": zi.header_offset + 14, "cd_at": cd_pos.get(zi.filename)}
    return out


def _write_pt(dst, values, by_name, reader: Reader, opts: Options, *, flat) -> ConvertResult:
    t0 = time.perf_counter()
    parent, base = split_url(dst)
    root = Storage(parent, storage_options=opts.dst_storage_options)
    if root.exists(base) and not opts.overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True to replace it")
    # torch.save needs a file path: build the file there, patch its payloads
    # in place, publish it at the end (a rename next to it on local disk).
    staged = root.open_staged(base)
    tmp = staged.path
    total = sum(e.nbytes for e in by_name.values())
    bar = Progress(total, opts.progress, "to_full")
    try:
        obj, ids = _placeholders(values, by_name, flat)
        order = [ids[id(t)] for t in _leaves(obj)]
        with torch.serialization.skip_data():
            torch.save(obj, tmp)
        del obj, ids
        metas = _leaves(torch.load(tmp, map_location="meta", weights_only=True))
        if len(metas) != len(order):
            raise AssertionError("internal error: torch.save structure changed on reload")
        offsets = []
        for _, m in zip(order, metas):
            off = getattr(m.untyped_storage(), "_checkpoint_offset", None)
            if off is None:
                raise UnsupportedStateError("this torch cannot report storage offsets of a saved file (torch >= 2.6 needed for .pt output)")
            offsets.append(off)
        records = _record_map(tmp)
        # The records are laid out: stream each tensor's bytes into its own
        # (the shared reader and writer path), CRC-32 as they go.
        crcs = [0] * len(order)
        # Records are independent: a few workers each stream their share of
        # the tensors (largest first, bytes balanced) into their records at
        # once, CRC-32 as the bytes go; blocks shrink as workers are added.
        n = max(1, min(opts.io_threads, len(order)))
        shares: List[List[int]] = [[] for _ in range(n)]
        load = [0] * n
        for i in sorted(range(len(order)), key=lambda i: -order[i].nbytes):
            k = load.index(min(load))
            shares[k].append(i)
            load[k] += order[i].nbytes
        reader.threads = max(1, opts.io_threads // n)
        stop = threading.Event()

        def write_share(share: List[int]) -> None:
            stream = Streamer(reader, block_bytes=max(WANT_BYTES, BLOCK_BYTES // n), progress=bar, stop=stop)
            try:
                for i in share:
                    pos = offsets[i]
                    for mv in stream.slabs(order[i]):
                        staged.write_at(mv, pos)
                        pos += len(mv)
                        crcs[i] = checksum("crc32", mv, crcs[i])
            finally:
                stream.close()

        run_parallel(write_share, shares, workers=n, stop=stop)
        for i, e in enumerate(order):
            rec = records.get(offsets[i])
            if rec is None or rec["size"] != e.nbytes:
                raise AssertionError(f"internal error: no zip record of {e.nbytes} bytes at {offsets[i]} for {e.key}")
            packed = struct.pack("<I", crcs[i])
            for at in (rec["crc_at"], rec["cd_at"]) if rec["crc_at"] is not None else (rec["local_crc_at"], rec["cd_at"]):
                if at is not None:
                    staged.write_at(packed, at)
        reader.finish()
        staged.commit()
    finally:
        bar.close()
        staged.abort()  # a no-op once committed
    return ConvertResult(dst, [base], len(order), total, time.perf_counter() - t0)
