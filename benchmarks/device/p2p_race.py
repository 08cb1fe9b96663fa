"""The memory tier's NCCL peer copy under a busy training thread: damaged bytes or not (2 GPUs, torchrun).

Issue 28's smoke run saw peer copies arrive damaged over NCCL (caught by the
block CRCs) but never with gloo or ``CUDA_LAUNCH_BLOCKING=1``. Hypothesis: the
copy's device staging buffers were allocated on the background thread's
current stream -- the default stream training also uses -- and then used on a
side stream and NCCL's stream. The caching allocator hands a block freed on
the default stream to the next allocation on that stream at once; training
kernels still queued there may write into it after the side stream filled it.

This script runs, in a background thread while the main thread trains (matmuls
and all-reduces on the default process group, allocating and freeing on the
default stream), ``ROUNDS`` peer exchanges of ``SIZES`` bytes between the two
ranks, each with fresh random contents, and counts damaged bytes:

- ``old``: staging buffers allocated outside the side stream (the code before the fix);
- ``lib``: ``shardckpt._memory.transfer.move_tensors`` as it is now.

Run: ``torchrun --nproc-per-node 2 benchmarks/device/p2p_race.py`` (PYTHONPATH with shardckpt).
"""

import os
import threading
import time

import torch
import torch.distributed as dist

from shardckpt._memory.transfer import move_tensors
from shardckpt._p2p import p2p_op, start_ops, warm_nccl

SIZES = [1311, 200_000, 3_000_000, 150 << 20]
ROUNDS = int(os.environ.get("ROUNDS", "6"))
PIECE = 64 << 20


def old_move(outgoing, incoming, group, ranks, dev):
    """The staging loop as it was: buffers allocated on the calling thread's current stream."""
    stream = torch.cuda.Stream(device=dev)
    transfers = [(True, d, t) for d, t in outgoing] + [(False, s, t) for s, t in incoming]
    bufs = [[torch.empty(min(PIECE, max(1, t.numel())), dtype=torch.uint8, device=dev) for _ in range(2)]
            for _, _, t in transfers]
    waves = max(-(-t.numel() // PIECE) for _, _, t in transfers)
    with torch.cuda.stream(stream):
        for w in range(waves):
            ops, outs = [], []
            for i, (send, other, t) in enumerate(transfers):
                off = w * PIECE
                n = min(PIECE, t.numel() - off)
                if n <= 0:
                    continue
                buf = bufs[i][w % 2][:n]
                if send:
                    buf.copy_(t[off:off + n], non_blocking=t.is_pinned())
                    ops.append(p2p_op("send", buf, ranks[other], group, 0))
                else:
                    ops.append(p2p_op("recv", buf, ranks[other], group, 0))
                    outs.append((t[off:off + n], buf))
            stream.synchronize()
            for work in start_ops(ops):
                work.wait()
            torch.cuda.synchronize(dev)
            for dst, buf in outs:
                dst.copy_(buf, non_blocking=dst.is_pinned())
            stream.synchronize()


def contents(rnd, sender, size):
    g = torch.Generator().manual_seed(rnd * 1000 + sender * 10 + SIZES.index(size))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def host(size, pin):
    t = torch.empty(size, dtype=torch.uint8)
    if pin and size >= (1 << 20):  # as the slots: big ones registered
        t = t.pin_memory()
    return t


def exchange(mode, group, rank, dev, results):
    torch.cuda.set_device(dev)
    peer = 1 - rank
    bad = 0
    t0 = time.perf_counter()
    for rnd in range(ROUNDS):
        out = [(peer, host(s, True).copy_(contents(rnd, rank, s))) for s in SIZES]
        inc = [(peer, host(s, True).zero_()) for s in SIZES]
        if mode == "old":
            old_move(out, inc, group, [0, 1], dev)
        else:
            move_tensors(out, inc, group=group, group_ranks=[0, 1], device=dev)
        for (_, got), s in zip(inc, SIZES):
            bad += int((got != contents(rnd, peer, s)).sum())
    results[mode] = (bad, time.perf_counter() - t0)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(dev)
    group = dist.new_group(ranks=[0, 1], backend="nccl")
    warm_nccl(group)
    w = torch.randn(4096, 4096, device="cuda")
    for mode in ("old", "lib", "old", "lib"):
        results = {}
        th = threading.Thread(target=exchange, args=(mode, group, rank, dev, results))
        dist.barrier()
        th.start()
        steps = 0
        busy = torch.ones(1, device="cuda")
        while busy.item():  # training: allocate, compute, free, all-reduce on the default stream
            x = torch.randn(8192, 4096, device="cuda")
            for _ in range(4):
                x = torch.tanh(x @ w)
            dist.all_reduce(x[:1024])
            del x
            steps += 1
            # Both ranks run the same number of all-reduces: they go on while either's exchange does.
            busy = torch.tensor([float(th.is_alive())], device="cuda")
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        th.join()
        torch.cuda.synchronize()
        bad, secs = results[mode]
        total = ROUNDS * sum(SIZES)
        print(f"rank {rank} mode={mode}: damaged bytes {bad} of {total} received over {ROUNDS} rounds "
              f"({secs:.2f} s, {steps} training steps alongside)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
