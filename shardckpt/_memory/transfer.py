"""Files between ranks over the process group, on the one wire between ranks (``_p2p``).

The memory tier moves bytes between ranks in two ways, both over the
primitives of ``shardckpt/_p2p.py`` (one device choice,
``transfer_device``: CUDA tensors under NCCL, CPU under gloo; one wait,
``wait_ops``, bounded by ``collective_timeout_s`` and watching the peers'
heartbeats, so a dead peer is named instead of hanging a rank):

* byte ranges of a load (the restore): ``_replicas.read_once`` with
  ``Sources`` — each range read, verified, by a rank whose node holds it and
  sent to the rank that loads it, pipelined through reused round buffers
  (``_memory/restore.py``);
* whole files (:func:`run_sends`: the save's peer copy, a restore's
  manifest and index files), in pieces of at most ``PIECE_BYTES`` through
  buffers allocated once per call and reused for every piece (pinned host
  memory when the wire is CUDA).

Every rank walks one global list of ``(src, dst, file)`` sends in the same
order and takes part in the ones it is in: blocking sends in one total
order cannot deadlock (the earliest unfinished send has both ends waiting on
it). The receiver writes a temporary file and renames it whole; what it
received is verified by the caller before any use.
"""

from __future__ import annotations

import logging
import os
import uuid
from io import BufferedReader, BufferedWriter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._io import byte_view, host_empty
from .._p2p import p2p_op, start_ops, transfer_device, wait_ops, warm_nccl

__all__ = ["PIECE_BYTES", "wire_device", "run_sends", "move_tensors"]

log = logging.getLogger("shardckpt")

#: Largest piece of a file sent at once (bounds the send and receive buffers).
PIECE_BYTES = 64 << 20


def wire_device(group) -> torch.device:
    """Where the bytes must be for this group's backend (``_p2p.transfer_device``): CUDA for NCCL, else CPU."""
    if transfer_device(group) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host(n: int, pinned: bool) -> torch.Tensor:
    if pinned and n:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    return host_empty(n)


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
    comm: Any = None,
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
    left waiting. With ``comm`` (the caller's ``_collective.Comm``), each
    wave's wait is bounded by its ``collective_timeout_s`` and a peer whose
    heartbeat stops is named (``LoadFailedError``); without, waits are
    the backend's. Buffers: one host piece per transfer this rank is in
    (pinned when the wire is CUDA, plus one device piece), allocated once
    and reused for every wave.
    """
    got: List[str] = []
    if not sends:
        return got, 0, 0  # nothing to do anywhere (also: no process group at all)
    device = wire_device(group)
    if device.type == "cuda":
        warm_nccl(group)  # every rank walks the same list, so every rank is here
    mine = [(src, dst, rel) for src, dst, rel in sends if me in (src, dst)]
    if not mine:
        return got, 0, 0
    cuda = device.type == "cuda"
    sent_bytes = recv_bytes = 0
    readers: Dict[int, Optional[BufferedReader]] = {}
    writers: Dict[int, Tuple[str, BufferedWriter]] = {}
    host: Dict[int, torch.Tensor] = {}
    wire: Dict[int, torch.Tensor] = {}
    try:
        for i, (src, dst, rel) in enumerate(mine):
            n = min(piece_bytes, int(sizes[rel]))
            host[i] = _host(n, cuda)
            wire[i] = torch.empty(n, dtype=torch.uint8, device=device) if cuda else host[i]
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
            ops, received, peers = [], [], set()
            for i, (src, dst, rel) in enumerate(mine):
                off = w * piece_bytes
                size = int(sizes[rel])
                if off >= size:
                    continue
                n = min(piece_bytes, size - off)
                if me == src:
                    view = byte_view(host[i])[:n]
                    f = readers[i]
                    got_n = (f.readinto(view) or 0) if f is not None else 0
                    if got_n < n:  # short read: zeros; the receiver's verification rejects the copy
                        view[got_n:] = bytes(n - got_n)
                    if cuda:
                        wire[i][:n].copy_(host[i][:n], non_blocking=True)
                    ops.append(p2p_op("send", wire[i][:n], group_ranks[dst], group, 0))
                    peers.add(group_ranks[dst])
                    sent_bytes += n
                else:
                    ops.append(p2p_op("recv", wire[i][:n], group_ranks[src], group, 0))
                    peers.add(group_ranks[src])
                    received.append((i, n))
            if cuda:
                torch.cuda.current_stream().synchronize()  # the pieces are on the device before NCCL reads them
            works = start_ops(ops)
            if comm is not None:
                wait_ops(works, comm, sorted(peers), cuda, doing="copying memory-tier files between ranks")
            else:
                for req in works:
                    req.wait()
            for i, n in received:
                if cuda:
                    host[i][:n].copy_(wire[i][:n])
                writers[i][1].write(byte_view(host[i])[:n])
                recv_bytes += n
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


def move_tensors(
    outgoing: Sequence[Tuple[int, torch.Tensor]],
    incoming: Sequence[Tuple[int, torch.Tensor]],
    *,
    group: Any,
    group_ranks: Sequence[int],
    device: Optional[int] = None,
    comm: Any = None,
    piece_bytes: int = PIECE_BYTES,
) -> Tuple[int, int]:
    """Send each ``(dst, tensor)`` and receive into each ``(src, tensor)`` over ``group``; returns ``(sent, received)`` bytes.

    Args:
        outgoing: ``(group position of the receiver, contiguous uint8 host tensor)``.
        incoming: ``(group position of the sender, contiguous uint8 host tensor to fill)``;
            its size is the sender's.
        group: the process group (its ranks are ``group_ranks``).
        group_ranks: global rank of each group position.
        device: None: the host tensors go as they are (gloo), one
            operation each, all posted at once. A CUDA device index (NCCL):
            in waves of ``piece_bytes`` through two reused device buffers per
            transfer, on a side stream (copy in, send/receive, copy out stay
            ordered without the host waiting between them; the host tensors
            should be pinned).
        comm: the caller's ``_collective.Comm``: waits bounded by its
            ``timeout_s`` and a dead peer named (``wait_ops``); None: the
            backend's own waits.
        piece_bytes: largest piece on the device.

    Raises:
        LoadFailedError (with ``comm``): a peer died or did not take part in time.

    Every rank calls it with the pairs it is in (matching on both sides); a
    rank in none returns at once. With NCCL the group must have run a
    collective before a call that not every rank takes part in
    (:func:`shardckpt._p2p.warm_nccl`).

    Example:
        >>> move_tensors([(1, buf)], [], group=pg, group_ranks=[0, 1])  # doctest: +SKIP
        (1048576, 0)
    """
    sent = sum(int(t.numel()) for _, t in outgoing)
    received = sum(int(t.numel()) for _, t in incoming)
    peers = sorted({group_ranks[p] for p, _ in list(outgoing) + list(incoming)})

    def wait(works: List[Any], cuda: bool) -> None:
        if comm is not None:
            wait_ops(works, comm, peers, cuda, doing="copying memory-tier bytes between ranks")
        else:
            for w in works:
                w.wait()

    if not outgoing and not incoming:
        return 0, 0
    if device is None:
        ops = [p2p_op("send", t, group_ranks[d], group, 0) for d, t in outgoing if t.numel()]
        ops += [p2p_op("recv", t, group_ranks[s], group, 0) for s, t in incoming if t.numel()]
        wait(start_ops(ops), False)
        return sent, received
    dev = torch.device("cuda", device)
    stream = torch.cuda.Stream(device=dev)
    transfers = [(True, d, t) for d, t in outgoing] + [(False, s, t) for s, t in incoming]
    waves = max(-(-int(t.numel()) // piece_bytes) for _, _, t in transfers)
    # The staging buffers are allocated *on the side stream*. Allocated on
    # the calling thread's current stream -- the default stream, which the
    # training thread keeps allocating and freeing on -- the caching
    # allocator may hand over a block that training freed while its kernels
    # still queued there write to it, and those writes land after this
    # stream filled the block: on 2x H200 peer copies arrived damaged (caught
    # by the block CRCs) until this changed (benchmarks/device/p2p_race.py
    # shows both). A block of this stream's own is only reused after this
    # stream's earlier work, so stream order alone keeps the bytes intact.
    with torch.cuda.stream(stream):
        bufs = [[torch.empty(min(piece_bytes, max(1, int(t.numel()))), dtype=torch.uint8, device=dev) for _ in range(2)]
                for _, _, t in transfers]
        for w in range(waves):
            ops, outs = [], []
            for i, (send, other, t) in enumerate(transfers):
                off = w * piece_bytes
                n = min(piece_bytes, int(t.numel()) - off)
                if n <= 0:
                    continue
                buf = bufs[i][w % 2][:n]
                if send:
                    buf.copy_(t[off : off + n], non_blocking=t.is_pinned())
                    ops.append(p2p_op("send", buf, group_ranks[other], group, 0))
                else:
                    ops.append(p2p_op("recv", buf, group_ranks[other], group, 0))
                    outs.append((t[off : off + n], buf))
            # NCCL's stream waits for this one (the copies in); ``wait`` makes
            # this stream wait for NCCL's (the copies out come after).
            wait(start_ops(ops), True)
            for dst, buf in outs:
                dst.copy_(buf, non_blocking=dst.is_pinned())
            # The host reads and rewrites the pieces next: the wave is done on the device.
            stream.synchronize()
    return sent, received
