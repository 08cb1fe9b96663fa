"""The control plane at N ranks: the real exchanges of a save and a load against a real TCPStore.

What it runs: ``shardckpt._collective.agree`` — the code every save and load
uses to meet — for a world of N ranks, on one machine, against a real
``torch.distributed.TCPStore`` on loopback. Rank 0 runs for real (its waits,
batched reads, the union decision of ``_union.decide`` over real records of
an FSDP2 state (a 16-layer model + AdamW as DTensors, 720 tensors; or
``--state plain``: plain tensors) of rank 0, the verdicts); the N-1 peers' posts are
made beforehand, with the same keys and values a peer posts (one
``multi_set`` per batch, not timed), and one real peer (rank 1) runs its
half of each exchange in a thread to count a peer's round trips.

Prints per N: rank-0 seconds per save (4 exchanges) and per load (2),
round trips at rank 0 and at rank 1, the largest single value and the total
bytes through the store.

DCP is not run beside it: DCP's planning exchanges (``gather_object`` /
``scatter_object`` / ``all_gather_object`` over the process group) need N
real processes in a real process group; they cannot be driven for a
simulated N on one machine without re-implementing them, which would not
measure DCP.

Usage: python benchmarks/bench_control_plane.py [--ranks 256,1024,4096,16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from shardckpt import _collective as C
from shardckpt import _union
from shardckpt._collective import DISTINCT, FROM_ROOT, NONE, TO_ROOT, Comm
from shardckpt._layout import layout_of


class Counting:
    """A store wrapper that counts round trips and bytes (what a rank sends and receives)."""

    def __init__(self, store):
        self.store = store
        self.trips = 0
        self.bytes = 0
        self.largest = 0
        # Liveness checks a waiting rank makes about once a second: counted
        # apart, since how many there are depends on how long the wait lasts
        # (machine load), not on the protocol.
        self.ticking = False
        self.tick_trips = 0

    def _trip(self) -> None:
        if self.ticking:
            self.tick_trips += 1
        else:
            self.trips += 1

    def _count(self, n: int) -> None:
        if not self.ticking:
            self.bytes += n

    def _n(self, v) -> int:
        return len(v) if isinstance(v, (bytes, str)) else 8

    def set(self, k, v):
        self._trip()
        self._count(len(k) + self._n(v))
        self.largest = max(self.largest, self._n(v))
        return self.store.set(k, v)

    def get(self, k):
        self._trip()
        v = self.store.get(k)
        self._count(len(k) + len(v))
        return v

    def multi_get(self, keys):
        self._trip()
        vs = self.store.multi_get(keys)
        self._count(sum(len(k) for k in keys) + sum(len(v) for v in vs))
        return vs

    def multi_set(self, keys, values):
        self._trip()
        self._count(sum(len(k) for k in keys) + sum(len(v) for v in values))
        self.largest = max([self.largest] + [len(v) for v in values])
        return self.store.multi_set(keys, values)

    def add(self, k, n):
        self._trip()
        self._count(len(k) + 8)
        return self.store.add(k, n)

    def check(self, keys):
        self._trip()
        self._count(sum(len(k) for k in keys))
        return self.store.check(keys)

    def wait(self, keys, timeout=None):
        self._trip()
        return self.store.wait(keys, timeout) if timeout is not None else self.store.wait(keys)

    def delete_key(self, k):
        self._trip()
        return self.store.delete_key(k)

    def append(self, k, v):
        self._trip()
        return self.store.append(k, v)

    def clone(self):
        return Counting(self.store.clone())


def state_records(n_tensors: int, world: int):
    """Records and a value tree of ``n_tensors`` model tensors + AdamW state (exp_avg, exp_avg_sq, step), as plain tensors."""
    tensors: Dict[str, Any] = {}
    for i in range(n_tensors):
        t = torch.empty(0) if False else torch.zeros(1)
        tensors[f"model.layers.{i}.weight"] = t.expand(4096) if i % 2 else t.expand(64)
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim.state.model.layers.{i}.weight.{k}"] = tensors[f"model.layers.{i}.weight"]
        tensors[f"optim.state.model.layers.{i}.weight.step"] = torch.zeros(())
    layouts = {n: layout_of(n, t, rank=0, world_size=world) for n, t in sorted(tensors.items())}
    from shardckpt._save import _rotations

    recs = _union.records(layouts, _rotations(layouts))
    tree = {
        "step": 1000,
        "optim": {"param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                    "params": [f"model.layers.{i}.weight" for i in range(n_tensors)]}]},
    }
    return recs, tree


class _Layer(torch.nn.Module):
    """A transformer block's parameters (11: attention, gated MLP, two norms)."""

    def __init__(self, d: int):
        super().__init__()
        nn = torch.nn
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)
        self.attn_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d)


class _Model(torch.nn.Module):
    """16 blocks + embedding, final norm and head: 180 parameters (720 tensors with AdamW's state)."""

    def __init__(self, layers: int = 16, d: int = 64, vocab: int = 128):
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab)


def fsdp2_records(world: int, layers: int = 16, *, shard: str = "dtensor"):
    """Records and value tree of rank 0 of an FSDP2 run of ``world`` ranks: a ``layers``-block model + AdamW.

    Real DTensors on a 1-D mesh of ``world`` ranks, on torch's fake process
    group (one process plays rank 0; nothing is sent). ``shard="fully_shard"``
    runs FSDP2 itself (its setup costs O(world) per parameter: ~20 s at
    16,384 ranks); ``"dtensor"`` (default) makes each parameter the DTensor
    FSDP2 makes (``Shard(0)``, rank 0's ``torch.chunk`` piece) directly, in
    O(1) per parameter; tests/unit/test_control_plane_scale.py checks both
    give the same records. AdamW's state is made as its first step would
    (``exp_avg``/``exp_avg_sq`` like their parameter, a scalar ``step``), then
    flattened and laid out by the save's own code (``flatten_for_save``,
    ``layout_of``, ``_union.records``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardckpt._save import _layouts, _rotations
    from shardckpt._state import flatten_for_save

    if dist.is_initialized():
        raise RuntimeError("fsdp2_records needs no process group of its own (it starts a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = _Model(layers)
        if shard == "fully_shard":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif shard == "dtensor":
            for mod in list(model.modules()):
                for pname, p in list(mod.named_parameters(recurse=False)):
                    local = torch.chunk(p.detach(), world, dim=0)[0].clone()
                    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
                    setattr(mod, pname, torch.nn.Parameter(dt))
        else:
            raise ValueError(f"shard must be 'dtensor' or 'fully_shard', not {shard!r}")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        flat = flatten_for_save({"model": model, "optim": opt, "step": 1000}, rank=0, world=world)
        layouts = _union.normalize(_layouts(flat.tensors, 0, world), tuple(range(world)))
        return _union.records(layouts, _rotations(layouts)), flat.tree
    finally:
        dist.destroy_process_group()


def _prepost(raw, seq_store, comm: Comm, outcome: Any, blob=None, digest=None) -> str:
    """What peers 2..N-1 post for the next exchange of ``comm`` (one multi_set per batch)."""
    k = C._seq_key(comm, seq_store)
    base = f"shardckpt/{comm.channel}/{k[1]}/{C._SEQ.get(k, 0) + 1}"
    body = pickle.dumps(outcome)
    keys = [f"{base}/r{i}" for i in range(2, comm.world)]
    for i in range(0, len(keys), 4096):
        raw.multi_set(keys[i : i + 4096], [body] * len(keys[i : i + 4096]))
    if blob is not None:
        raw.add(f"{base}/h/{digest}", comm.world - 2)
        for k in range(C._pieces(digest)):  # posted by the first peer to claim the hash
            raw.set(f"{base}/p/{digest}/{k}", blob[k * C.MAX_VALUE_BYTES : (k + 1) * C.MAX_VALUE_BYTES])
    raw.add(f"{base}/n", comm.world - 2)
    return base


def run(n: int, n_tensors: int = 300, *, state: str = "fsdp2", records: Any = None) -> Dict[str, Any]:
    """One save's and one load's exchanges at ``n`` ranks.

    ``state``: ``"fsdp2"`` (default) the FSDP2 DTensor state of
    :func:`fsdp2_records` (a 16-layer model + AdamW, 720 tensors;
    ``n_tensors`` unused), ``"plain"`` :func:`state_records` of
    ``n_tensors`` plain tensors (meshes None); ``records``: a given
    ``(records, value tree)`` instead.
    """
    if records is not None:  # another state's (records, value tree): bench_moe_scale.py's
        recs, tree = records
    elif state == "fsdp2":
        recs, tree = fsdp2_records(n)
    elif state == "plain":
        recs, tree = state_records(n_tensors, n)
    else:
        raise ValueError(f"state must be 'fsdp2' or 'plain', not {state!r}")
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    raw0 = dist.PrefixStore("bench", server)
    root = Counting(raw0)
    peer = Counting(raw0.clone())
    setup = raw0.clone()
    local = threading.local()
    C.default_store = lambda: local.store  # rank 0 and the peer thread each use their own counted connection
    ticker_call = C._Ticker.__call__

    def counted_tick(self):
        self.store.ticking = True
        try:
            return ticker_call(self)
        finally:
            self.store.ticking = False

    C._Ticker.__call__ = counted_tick
    comms = [Comm(rank=r, world=n, ranks=tuple(range(n)), timeout_s=120, op="bench", channel=f"b{n}") for r in (0, 1)]
    blob = pickle.dumps(_union.Packed((recs, tree)))  # what a save shares (compressed), as the real peer below
    digest = f"{C._hash(blob)}.{-(-len(blob) // C.MAX_VALUE_BYTES)}"
    summary = {"data/x-r00001-00.safetensors": 1 << 30, "index": ("data/x-index-r00001.json", 4096, 1)}
    keep: Dict[str, Any] = {}

    def decide(groups):
        return _union.decide(groups, comms[0].ranks, "bench://", keep)

    # (mode, share value, decide) of a save's 4 exchanges and a load's 2.
    save = [(DISTINCT, _union.Packed((recs, tree))), (FROM_ROOT, "save-id"), (TO_ROOT, summary), (NONE, None)]
    load = [(NONE, None), (NONE, None)]
    out: Dict[str, Any] = {"ranks": n}
    for label, steps in (("save", save), ("load", load)):
        t_root = 0.0
        for mode, value in steps:
            outcome = (None, digest if mode == DISTINCT else None, value if mode == TO_ROOT else None)
            base = _prepost(setup, root, comms[0], outcome, blob if mode == DISTINCT else None, digest)
            res: Dict[str, Any] = {}

            def one(r: int, store, mode=mode, value=value, res=res) -> None:
                local.store = store
                t = time.perf_counter()
                C.agree(comms[r], lambda: value, what="bench", share=(lambda v: v) if mode != NONE else None,
                        mode=mode, decide=decide)
                res[r] = time.perf_counter() - t

            th = threading.Thread(target=one, args=(1, peer))
            th.start()
            # Rank 0 arrives last, every time: the last to arrive also sets the
            # "all arrived" key, and a race between the two threads would move
            # that round trip between rank 0's count and the peer's.
            while th.is_alive() and int(setup.add(f"{base}/n", 0)) < n - 1:
                time.sleep(0.0005)
            one(0, root)
            th.join()
            t_root += res[0]
        out[f"{label}_s"] = t_root
        out[f"{label}_trips_root"], out[f"{label}_trips_peer"] = root.trips, peer.trips
        out[f"{label}_tick_trips"] = root.tick_trips + peer.tick_trips
        out[f"{label}_bytes_root"] = root.bytes
        out[f"{label}_bytes_peer"] = peer.bytes
        out[f"{label}_largest"] = max(root.largest, peer.largest, len(blob) if label == "save" else 0)
        root.trips = peer.trips = root.bytes = peer.bytes = root.largest = peer.largest = 0
        root.tick_trips = peer.tick_trips = 0
    out["payload_bytes"] = len(blob)
    # Every peer moves what rank 1 moved: total = rank 0 + (N-1) x rank 1.
    for label in ("save", "load"):
        out[f"{label}_bytes_total"] = out[f"{label}_bytes_root"] + (n - 1) * out[f"{label}_bytes_peer"]
    C._Ticker.__call__ = ticker_call
    del server
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="256,1024,4096,16384")
    ap.add_argument("--state", choices=("fsdp2", "plain"), default="fsdp2",
                    help="fsdp2: a 16-layer FSDP2 model + AdamW as DTensors (720 tensors); plain: --tensors plain tensors")
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: List[Dict[str, Any]] = []
    print("| ranks | save s (rank 0) | load s (rank 0) | save trips r0 / peer | load trips r0 / peer "
          "| largest value | save bytes total | load bytes total |")
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.ranks.split(",")]:
        r = run(n, args.tensors, state=args.state)
        rows.append(r)
        print(f"| {n:,} | {r['save_s']:.3f} | {r['load_s']:.3f} | {r['save_trips_root']} / {r['save_trips_peer']} "
              f"| {r['load_trips_root']} / {r['load_trips_peer']} | {r['save_largest'] / 1024:.1f} KiB "
              f"| {r['save_bytes_total'] / 2**20:.2f} MiB | {r['load_bytes_total'] / 2**20:.2f} MiB |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
