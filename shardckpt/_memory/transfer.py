"""Files between ranks over the process group: point-to-point sends of byte tensors.

Works the same under gloo and NCCL: the bytes travel as ``uint8`` tensors on
the group's device (CPU for gloo, the current CUDA device for NCCL), in
pieces of at most ``PIECE_BYTES`` so memory stays bounded whatever the file
size. Every rank walks one global list of ``(src, dst, file)`` sends in the
same order and takes part in the ones it is in: blocking sends in one total
order cannot deadlock (the earliest unfinished send has both ends waiting on
it). The receiver writes a temporary file and renames it whole; what it
received is verified by the caller before any use.
"""

from __future__ import annotations

import logging
import os
import uuid
from io import BufferedReader, BufferedWriter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._io import byte_view, host_empty

__all__ = ["PIECE_BYTES", "wire_device", "run_sends"]

log = logging.getLogger("shardckpt")

#: Largest piece of a file sent at once (bounds the send and receive buffers).
PIECE_BYTES = 64 << 20


def wire_device(group) -> torch.device:
    """Where the bytes must be for this group's backend: the current CUDA device for NCCL, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_sends(
    sends: Sequence[Tuple[int, int, str]],
    *,
    me: int,
    group_ranks: Sequence[int],
    group,
    sizes: Dict[str, int],
    src_path: Callable[[str], str],
    dst_path: Callable[[str], str],
    piece_bytes: int = PIECE_BYTES,
) -> Tuple[List[str], int, int]:
    """Take part in ``sends`` (group positions); returns ``(files received, bytes sent, bytes received)``.

    The files move in *waves*: wave k carries the k-th piece of every file
    still being sent, all of a rank's sends and receives of a wave posted at
    once (``batch_isend_irecv``), so transfers between different pairs run
    together. Both ends of a send agree on its pieces (the sizes are shared),
    and a rank waits only on the wave it is in, which its partners reach
    after the earlier waves: no cycle, no deadlock. Memory: one piece per
    transfer this rank is in, per wave.

    A sender that cannot read its file sends zeros of the recorded size (the
    receiver's verification then rejects the copy): the other side is never
    left waiting. Raises only for transport errors (a dead peer).
    """
    mine = [(src, dst, rel) for src, dst, rel in sends if me in (src, dst)]
    got: List[str] = []
    if not mine:
        return got, 0, 0  # nothing to do here (also: no process group at all)
    device = wire_device(group)
    sent_bytes = recv_bytes = 0
    readers: Dict[int, Optional[BufferedReader]] = {}
    writers: Dict[int, Tuple[str, BufferedWriter]] = {}
    try:
        for i, (src, dst, rel) in enumerate(mine):
            if me == src:
                try:
                    readers[i] = open(src_path(rel), "rb")
                except OSError as e:
                    log.warning("shardckpt: memory tier: cannot read %s to send it to rank %d: %s", src_path(rel), dst, e)
                    readers[i] = None
            else:
                path = dst_path(rel)
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.part")
                # 0600, never through a planted link (shared memory: docs/manager.md, "scope and safety").
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o600)
                writers[i] = (tmp, open(fd, "wb"))
        waves = max(-(-int(sizes[rel]) // piece_bytes) for _, _, rel in mine)
        for w in range(waves):
            ops, received = [], []
            for i, (src, dst, rel) in enumerate(mine):
                off = w * piece_bytes
                size = int(sizes[rel])
                if off >= size:
                    continue
                n = min(piece_bytes, size - off)
                if me == src:
                    buf = host_empty(n)
                    view = byte_view(buf)
                    f = readers[i]
                    got_n = f.readinto(view) if f is not None else 0
                    if got_n < n:  # short read: zeros; the receiver's verification rejects the copy
                        view[got_n:] = bytes(n - got_n)
                    ops.append(dist.P2POp(dist.isend, buf.to(device), group_ranks[dst], group))
                    sent_bytes += n
                else:
                    buf = torch.empty(n, dtype=torch.uint8, device=device)
                    ops.append(dist.P2POp(dist.irecv, buf, group_ranks[src], group))
                    received.append((i, buf))
            for req in dist.batch_isend_irecv(ops) if ops else ():
                req.wait()
            for i, buf in received:
                writers[i][1].write(byte_view(buf.cpu()))
                recv_bytes += buf.numel()
        for i, (tmp, out) in sorted(writers.items()):
            out.close()
            os.replace(tmp, dst_path(mine[i][2]))
            got.append(mine[i][2])
    finally:
        for src_f in readers.values():
            if src_f is not None:
                src_f.close()
        for tmp, out in writers.values():
            out.close()
            try:
                os.remove(tmp)  # gone already when renamed
            except OSError:
                pass
    return got, sent_bytes, recv_bytes
