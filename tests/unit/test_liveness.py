"""Peer liveness, one function (``_collective.stopped``) every waiter asks: the exchanges and the wire (``_p2p.wait_ops``).

Real heartbeats: a process-local c10d store (``HashStore``) where a thread
beats like ``_collective``'s heartbeat thread does (one counter per rank,
listed in the roster), with ``SHARDCKPT_LIVENESS_TIMEOUT_S`` made short.
"""

from __future__ import annotations

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
    watch = Liveness()
    t0 = time.monotonic()  # before the first look: a peer named dead has been watched at least 0.3 s since t0
    assert stopped(peers, watch, store=store) == []  # first look: nothing judged yet
    dead: list = []
    while not dead and time.monotonic() - t0 < 30:
        time.sleep(0.1)
        for r in peers[:-1]:  # every peer but the last beats between two looks, however slow the host
            _beat(store, r)
        dead = stopped(peers, watch, store=store)
        if time.monotonic() - t0 < 0.3:
            assert dead == [], dead  # not stopped long enough yet
    assert dead == [peers[-1]]


def test_a_rank_that_never_beat_is_not_judged(monkeypatch):
    monkeypatch.setattr(_knobs, "LIVENESS_TIMEOUT_S", 0.0)
    store = dist.HashStore()
    _beat(store, 0)
    watch = Liveness()
    assert stopped([5], watch, store=store) == [] and stopped([5, 6], watch, store=store) == []
    stopped([0, 5], watch, store=store)
    assert stopped([0, 5], watch, store=store) == [0]  # 0 beat once and stopped; 5 may not have started

