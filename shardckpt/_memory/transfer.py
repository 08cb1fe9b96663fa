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
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

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

    A sender that cannot read its file sends zeros of the recorded size (the
    receiver's verification then rejects the copy): the other side is never
    left waiting. Raises only for transport errors (a dead peer).
    """
    got: List[str] = []
    if not any(me in (src, dst) for src, dst, _ in sends):
        return got, 0, 0  # nothing to do here (also: no process group at all)
    device = wire_device(group)
    sent_bytes = recv_bytes = 0
    for src, dst, rel in sends:
        if me not in (src, dst):
            continue
        size = int(sizes[rel])
        if me == src:
            peer = group_ranks[dst]
            f = None
            try:
                f = open(src_path(rel), "rb")
            except OSError as e:
                log.warning("shardckpt: memory tier: cannot read %s to send it to rank %d: %s", src_path(rel), dst, e)
            try:
                for off in range(0, size, piece_bytes):
                    n = min(piece_bytes, size - off)
                    buf = torch.zeros(n, dtype=torch.uint8)
                    if f is not None:
                        f.readinto(memoryview(buf.numpy()))  # short read: the rest stays zero, verification rejects it
                    dist.send(buf.to(device), dst=peer, group=group)
                    sent_bytes += n
            finally:
                if f is not None:
                    f.close()
        else:
            peer = group_ranks[src]
            path = dst_path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.part")
            try:
                with open(tmp, "wb") as out:
                    for off in range(0, size, piece_bytes):
                        n = min(piece_bytes, size - off)
                        buf = torch.empty(n, dtype=torch.uint8, device=device)
                        dist.recv(buf, src=peer, group=group)
                        out.write(memoryview(buf.cpu().numpy()))
                        recv_bytes += n
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
                raise
            got.append(rel)
    return got, sent_bytes, recv_bytes

