"""Format v2 internals: chunk resolution (v1 from the chunk list; v2 from layout records and headers)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from .resolve import MetaCache, ResolvedChunk


def _meets(offsets: Sequence[int], sizes: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> bool:
    for bo, bs in boxes:
        if len(bo) != len(offsets):
            continue
        if all(min(o + n, p + m) > max(o, p) for o, n, p, m in zip(offsets, sizes, bo, bs)):
            return True
        if not offsets and not bo:  # 0-d: the one element
            return True
    return False


def resolve(manifest: Any, storage: Any, name: str, boxes, cache: MetaCache) -> List[ResolvedChunk]:
    t = manifest.tensors[name]
    out = []
    for c in t.chunks:
        if c.nbytes and _meets(c.offsets, c.sizes, boxes):
            out.append(
                ResolvedChunk(
                    name=name,
                    key=c.key,
                    file=c.file,
                    byte_offset=c.byte_offset,
                    nbytes=c.nbytes,
                    offsets=tuple(c.offsets),
                    sizes=tuple(c.sizes),
                    crc32c=c.crc32c,
                )
            )
    out.sort(key=lambda c: c.offsets)
    return out
