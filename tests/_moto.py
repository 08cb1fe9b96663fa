"""A private S3 endpoint for the tests: ``moto_server`` on loopback, one bucket.

The fixtures live here so every test folder that needs S3 (tests/s3,
tests/storage) imports them into its conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from _weed import _die_with_parent, _free_port

BUCKET = "shardckpt-test"

# The endpoint is on loopback: never send it through a proxy from the
# environment (set at import, so rank processes spawned later inherit it).
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(x for x in (os.environ.get(_var), "127.0.0.1", "localhost") if x)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _moto_server() -> str:
    # The venv's own entry point first (tests run with .venv/bin/python).
    here = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if os.path.exists(here):
        return here
    found = shutil.which("moto_server")
    if not found:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    return found


#: The one moto server of this test process, shared by every copy of the fixture: each test module
#: that imports ``s3_endpoint`` holds its own session-scoped copy, and each copy started a server that
#: lived to the end of the run (five at once in one worker, 76 MB each: issue 47). Tests use their own
#: prefix (``s3_url``) or bucket, so sharing the server changes nothing they see.
_SERVER: dict = {}


def _start_moto() -> dict:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.Popen(
        [_moto_server(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        # Stopped with the test process even when that is killed (no teardown).
        preexec_fn=_die_with_parent,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with code {proc.returncode}")
            try:
                _DIRECT.open(endpoint + "/", timeout=1).read()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not answer on {endpoint} within 30 s") from None
                time.sleep(0.1)
        # moto takes unsigned requests; a plain PUT makes the bucket.
        _DIRECT.open(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=10).read()
    except BaseException:
        _stop(proc)
        raise
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return {"proc": proc, "options": options}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
    """Yield ``(url_prefix, storage_options)`` for the bucket on this test process's local moto server."""
    if not _SERVER or _SERVER["proc"].poll() is not None:
        _SERVER.update(_start_moto())
    try:
        yield f"s3://{BUCKET}", _SERVER["options"]
    finally:
        # Session teardown (every copy at once): the first copy's stops the server.
        if _SERVER and _SERVER["proc"].poll() is None:
            _stop(_SERVER["proc"])


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh checkpoint URL in the test bucket, and the storage options."""
    prefix, options = s3_endpoint
    return f"{prefix}/{uuid.uuid4().hex[:12]}/ck", options
