"""The one manifest builder: what every writing rank wrote, into the ``Manifest`` that commits it (torch-free).

``save`` (``_save._build_manifest``) and the converters (``converters._common.write_native``)
both end here: they describe each tensor (dtype, shape, layout record or
none) and hand over what each rank wrote — its chunks, data files and index
file — and this module files them, checks that the chunks tile their tensors,
and stamps the version, block size and library version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .._version import __version__
from .manifest import FORMAT_VERSION, ChunkMeta, FileMeta, IndexMeta, Manifest, TensorMeta, tiling_problems

__all__ = ["RankOutput", "build_manifest"]


@dataclass
class RankOutput:
    """What one rank wrote.

    Attributes:
        rank: its rank in the save's group (the index file's owner).
        chunks: ``(tensor name, chunk)`` of every chunk it wrote.
        files: its data files and their sizes.
        index: its index file as ``(path, size, crc32c)``, or None.
    """

    rank: int
    chunks: Sequence[Tuple[str, ChunkMeta]] = ()
    files: Dict[str, int] = field(default_factory=dict)
    index: Optional[Tuple[str, int, int]] = None


def build_manifest(
    tensors: Dict[str, TensorMeta],
    outputs: Iterable[RankOutput],
    *,
    world_size: int,
    values: Any,
    save_id: str,
    block_bytes: int,
    meshes: Optional[List[Any]] = None,
    extra: Optional[Dict[str, Any]] = None,
    check_regular: bool = False,
) -> Manifest:
    """The manifest of a save: ``tensors`` (no chunks yet) filled with what each rank wrote.

    Every chunk goes to its tensor's ``chunks`` (serialized in v1 only; kept
    for the Hugging Face index and the tiling check); a tensor without a
    layout record (``regular`` None) lists the ranks that wrote it as
    ``writers``.

    Args:
        tensors: every saved tensor, ``regular`` set for layout-derived ones.
        outputs: one per writing rank.
        world_size, values, save_id, block_bytes, meshes, extra: the manifest's fields.
        check_regular: also check that the chunks of layout-derived tensors
            tile them (``save`` checks their byte count instead: cheaper).

    Raises:
        AssertionError: the chunks do not tile a tensor (an internal error:
            nothing may be committed).

    Example:
        >>> t = {"w": TensorMeta("F32", [2])}
        >>> c = ChunkMeta("d.safetensors", "w", [0], [2], 8, 8, 0)
        >>> m = build_manifest(t, [RankOutput(0, [("w", c)], {"d.safetensors": 16})], world_size=1, values=None,
        ...                    save_id="s", block_bytes=1 << 20)
        >>> m.tensors["w"].writers, m.version == FORMAT_VERSION
        ([0], True)
    """
    files: Dict[str, FileMeta] = {}
    indexes: Dict[str, IndexMeta] = {}
    for out in outputs:
        for rel, size in out.files.items():
            files[rel] = FileMeta(size)
        if out.index is not None:
            path, size, crc = out.index
            indexes[path] = IndexMeta(rank=out.rank, size=size, crc32c=crc)
            files[path] = FileMeta(size)
        for name, c in out.chunks:
            t = tensors[name]
            t.chunks.append(c)
            if t.regular is None:
                if t.writers is None:
                    t.writers = []
                t.writers.append(out.rank)
    for t in tensors.values():
        if t.regular is None:
            t.writers = sorted(set(t.writers or []))
    checked = tensors if check_regular else {n: t for n, t in tensors.items() if t.regular is None}
    bad = tiling_problems(checked)
    if bad:
        raise AssertionError("internal error, written chunks do not tile their tensors: " + "; ".join(bad[:10]))
    return Manifest(
        world_size=world_size,
        tensors=tensors,
        files=files,
        values=values,
        save_id=save_id,
        library_version=__version__,
        extra=dict(extra or {}),
        version=FORMAT_VERSION,
        block_bytes=block_bytes,
        meshes=list(meshes or []),
        indexes=indexes,
    )
