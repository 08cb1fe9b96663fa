"""A fault-injecting TCP proxy on loopback, between an S3 client and its server.

Each accepted connection gets one fate, drawn from a generator seeded by
``(seed, connection number)`` so that a run is reproducible connection by
connection:

- ``pass``: bytes flow both ways untouched;
- ``reset``: bytes flow until a random byte count (0..``reset_window``) in
  either direction, then the connection is reset (RST) in the middle of a
  request or response;
- ``slowdown``: the first request is read (head and ``Content-Length`` body)
  and answered ``503 SlowDown`` with S3's XML error, then the connection closes;
- ``delay``: the connection waits ``delay_s`` before it is forwarded;
- ``stall``: the request is read and never answered (until ``stall_s`` or
  ``close()``): a hung server, which only a client timeout ends.

Rates are set with :meth:`set_faults` (fractions of new connections).
``stats`` counts the fates dealt. Everything is bounded: sockets have
timeouts, threads are daemons, ``close()`` ends every connection.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>fault-proxy</RequestId></Error>"
)
#: Idle time after which a forwarded connection is closed (the client reconnects).
IDLE_TIMEOUT_S = 60.0


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``, injecting seeded faults.

    Example::

        p = FaultProxy(("127.0.0.1", 8333), seed=1)
        p.set_faults(reset=0.1, slowdown=0.1)
        opts = {..., "endpoint_url": p.endpoint}
    """

    def __init__(self, upstream: Tuple[str, int], *, seed: int = 0):
        self.upstream = upstream
        self.seed = seed
        self.rates: Dict[str, float] = {}
        self.reset_window = 256 << 10
        self.delay_s = 0.2
        self.stall_s = 120.0
        self.stats: Dict[str, int] = {}
        self._first: Dict[int, str] = {}
        self._n = 0
        self._lock = threading.Lock()
        self._socks: List[socket.socket] = []
        self._closed = threading.Event()
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(128)
        self._srv.settimeout(0.5)
        self.port = self._srv.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._thread.start()

    def set_faults(
        self, *, reset: float = 0.0, slowdown: float = 0.0, delay: float = 0.0, stall: float = 0.0, first=(), **knobs
    ) -> None:
        """Fractions of new connections dealt each fault (the rest pass); knobs: reset_window, delay_s, stall_s.

        ``first``: fates of the next connections, in order, before the seeded
        draw resumes. A client that keeps a few connections alive may open
        only a handful, all of which the draw can pass: ``first`` makes
        sure the faults a test counts on are dealt.
        """
        if reset + slowdown + delay + stall > 1:
            raise ValueError("fault rates add up to more than 1")
        bad = [f for f in first if f not in ("reset", "slowdown", "delay", "stall", "pass")]
        if bad:
            raise ValueError(f"unknown fates {bad}")
        with self._lock:
            self._first = {self._n + i: f for i, f in enumerate(first)}
            self.rates = {"reset": reset, "slowdown": slowdown, "delay": delay, "stall": stall}
            for k, v in knobs.items():
                if not hasattr(self, k):
                    raise ValueError(f"unknown knob {k}")
                setattr(self, k, v)

    def faults_dealt(self) -> int:
        return sum(v for k, v in self.stats.items() if k != "pass")

    def close(self) -> None:
        self._closed.set()
        try:
            self._srv.close()
        except OSError:
            pass
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            _close(s)
        self._thread.join(timeout=5)

    # -- internals ---------------------------------------------------------------

    def _fate(self, n: int) -> Tuple[str, random.Random]:
        rng = random.Random(self.seed * 1_000_003 + n)
        x = rng.random()
        with self._lock:
            rates = dict(self.rates)
            scripted = self._first.pop(n, None)
        if scripted is not None:
            return scripted, rng
        for kind in ("reset", "slowdown", "delay", "stall"):
            r = rates.get(kind, 0.0)
            if x < r:
                return kind, rng
            x -= r
        return "pass", rng

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                n = self._n
                self._n += 1
            kind, rng = self._fate(n)
            with self._lock:
                self.stats[kind] = self.stats.get(kind, 0) + 1
            self._track(client)
            threading.Thread(target=self._handle, args=(client, kind, rng), name=f"faultproxy-{n}", daemon=True).start()

    def _handle(self, client: socket.socket, kind: str, rng: random.Random) -> None:
        try:
            client.settimeout(IDLE_TIMEOUT_S)
            if kind == "slowdown":
                _read_request(client)
                client.sendall(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                    + f"Content-Length: {len(SLOWDOWN_BODY)}\r\n\r\n".encode()
                    + SLOWDOWN_BODY
                )
                _close(client)
                return
            if kind == "stall":
                client.settimeout(0.5)
                end = time.monotonic() + self.stall_s
                while time.monotonic() < end and not self._closed.is_set():
                    try:
                        if not client.recv(1 << 16):
                            break
                    except socket.timeout:
                        continue
                _close(client)
                return
            if kind == "delay":
                self._closed.wait(self.delay_s)
            upstream = socket.create_connection(self.upstream, timeout=10)
            upstream.settimeout(IDLE_TIMEOUT_S)
            self._track(upstream)
            budget: Optional[List[int]] = [rng.randrange(0, self.reset_window + 1)] if kind == "reset" else None
            lock = threading.Lock()
            t = threading.Thread(target=self._pump, args=(upstream, client, budget, lock), daemon=True)
            t.start()
            self._pump(client, upstream, budget, lock)
            t.join(timeout=IDLE_TIMEOUT_S)
        except OSError:
            _close(client)

    def _pump(self, src: socket.socket, dst: socket.socket, budget: Optional[List[int]], lock: threading.Lock) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                if budget is not None:
                    with lock:
                        if len(data) >= budget[0]:
                            # Part of the bytes, then a reset on both sides.
                            cut, budget[0] = budget[0], 0
                            if cut:
                                dst.sendall(data[:cut])
                            _reset(src)
                            _reset(dst)
                            return
                        budget[0] -= len(data)
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)


def _read_request(s: socket.socket) -> None:
    """Read one HTTP request (head, then a Content-Length body) and drop it."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(1 << 16)
        if not chunk:
            return
        buf += chunk
        if len(buf) > 1 << 20:
            return
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip() or 0)
    remaining = length - len(rest)
    while remaining > 0:
        chunk = s.recv(min(remaining, 1 << 16))
        if not chunk:
            return
        remaining -= len(chunk)


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
