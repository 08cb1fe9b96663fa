"""Peer liveness, one function (``_collective.stopped``) every waiter asks: the exchanges and the wire (``_p2p.wait_ops``).

Real heartbeats: a process-local c10d store (``HashStore``) where a thread
beats like ``_collective``'s heartbeat thread does (one counter per rank,
listed in the roster), with ``SHARDCKPT_LIVENESS_TIMEOUT_S`` made short.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from shardckpt import _knobs
from shardckpt._collective import Liveness, stopped


def _beat(store, rank: int) -> None:
    # What _collective's heartbeat does for each process: move its counter, list it once.
    if store.add(f"shardckpt/alive/{rank}", 1) == 1:
        store.append("shardckpt/alive_roster", f"{rank},".encode())


@pytest.mark.parametrize("peers", [[1], [1, 2, 3]])
def test_a_peer_whose_counter_stops_is_named_once_the_timeout_passed(monkeypatch, peers):
    monkeypatch.setattr(_knobs, "LIVENESS_TIMEOUT_S", 0.3)
    store = dist.HashStore()
    for r in peers:
        _beat(store, r)
    stop = threading.Event()

    def beating() -> None:  # every peer but the last keeps beating
        while not stop.wait(0.05):
            for r in peers[:-1]:
                _beat(store, r)

    t = threading.Thread(target=beating, daemon=True)
    t.start()
    try:
        watch = Liveness()
        assert stopped(peers, watch, store=store) == []  # first look: nothing judged yet
        time.sleep(0.15)
        assert stopped(peers, watch, store=store) == []  # not long enough
        deadline = time.monotonic() + 5
        dead: list = []
        while not dead and time.monotonic() < deadline:
            time.sleep(0.1)
            dead = stopped(peers, watch, store=store)
        assert dead == [peers[-1]]
    finally:
        stop.set()
        t.join()


def test_a_rank_that_never_beat_is_not_judged(monkeypatch):
    monkeypatch.setattr(_knobs, "LIVENESS_TIMEOUT_S", 0.0)
    store = dist.HashStore()
    _beat(store, 0)
    watch = Liveness()
    assert stopped([5], watch, store=store) == [] and stopped([5, 6], watch, store=store) == []
    stopped([0, 5], watch, store=store)
    assert stopped([0, 5], watch, store=store) == [0]  # 0 beat once and stopped; 5 may not have started

