"""S3 servers for the tests, started by the tests on loopback: SeaweedFS (``weed``) and the fault proxy.

``seaweed_endpoint`` (session): a ``weed server -s3`` on free 127.0.0.1 ports
with its data in a temp directory, one bucket, stopped at the end of the
session (and killed if it does not stop). ``faulty_s3`` (function): a
:class:`FaultProxy` in front of it whose fault rates a test sets.
moto's server stays in tests/_moto.py.
"""

from __future__ import annotations

import uuid

import pytest
from _faultproxy import FaultProxy
from _weed import SEAWEED_BUCKET, SeaweedServer, seaweed_options  # noqa: F401  (re-exported for tests)

#: The one SeaweedFS server of this test process, shared by every copy of the fixture (tests/s3 and
#: tests/storage import it into their conftest.py, and each copy started a server kept to the end of the
#: run: issue 47). Tests use their own prefix (``weed_url``), so sharing it changes nothing they see.
_SERVER: dict = {}
#: The server's Go heap limit: with Go's defaults it kept ~0.5 GB of buffers
#: after serving a few hundred MB (0.4 GiB at a suite run's peak: issue 47);
#: with this and GOGC=50, 0.16 GB (the test objects are a few MB each).
WEED_MEMORY_LIMIT = "64MiB"


@pytest.fixture(scope="session")
def seaweed_endpoint():
    """``(s3://bucket, storage_options)`` of a SeaweedFS server on loopback for this session."""
    if "server" in _SERVER and _SERVER["server"].proc.poll() is not None:
        _SERVER.pop("server").stop()  # died: its data directory goes, a new one starts
    if "server" not in _SERVER:
        _SERVER["server"] = SeaweedServer(memory_limit=WEED_MEMORY_LIMIT)
    try:
        yield f"s3://{SEAWEED_BUCKET}", seaweed_options(_SERVER["server"].endpoint)
    finally:
        # Session teardown (every copy at once): the first copy's stops the server.
        server = _SERVER.pop("server", None)
        if server is not None:
            server.stop()


@pytest.fixture
def weed_url(seaweed_endpoint):
    """A fresh checkpoint URL on the SeaweedFS server, and the storage options."""
    prefix, options = seaweed_endpoint
    return f"{prefix}/{uuid.uuid4().hex[:12]}/ck", options


@pytest.fixture
def fault_proxy(seaweed_endpoint):
    """A :class:`FaultProxy` in front of the SeaweedFS server (no faults until the test sets rates)."""
    _, options = seaweed_endpoint
    upstream = options["endpoint_url"].rsplit(":", 1)
    proxy = FaultProxy(("127.0.0.1", int(upstream[1])), seed=1234)
    try:
        yield proxy
    finally:
        proxy.close()

