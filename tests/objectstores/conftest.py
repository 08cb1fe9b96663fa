"""GCS through gcsfs against ``gcp-storage-emulator`` (pure Python, PyPI), started by the tests on loopback.

The emulator is part of the test extra, so a missing one is a broken test
environment: the fixture fails with the install hint, it never skips.
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

GCS_BUCKET = "shardckpt-gcs"
#: Seconds for the emulator to answer after it starts.
GCS_START_TIMEOUT_S = 60

# gcsfs >= 2025.x first asks GCS's gRPC control API whether a bucket is
# zonal/hierarchical; the emulator speaks only JSON over HTTP, so that probe
# times out (60 s per bucket) before gcsfs falls back. Set at import so rank
# processes spawned later inherit it.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(x for x in (os.environ.get(_var), "127.0.0.1", "localhost") if x)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _emulator() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    if os.path.exists(here):
        return here
    found = shutil.which("gcp-storage-emulator")
    if not found:
        pytest.fail("gcp-storage-emulator is not installed: pip install -e '.[test]' (the test extra has it)", pytrace=False)
    return found


@pytest.fixture(scope="session")
def gcs_endpoint():
    """``(gs://bucket, storage_options)`` of a GCS emulator on loopback for this session (in memory)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [_emulator(), "start", "-H", "127.0.0.1", "--port", str(port), "--default-bucket", GCS_BUCKET, "--in-memory", "-q"],
        # Its own output must not hold the test's pipes open after a crash.
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    try:
        deadline = time.monotonic() + GCS_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"gcp-storage-emulator exited with code {proc.returncode} before serving {endpoint}", pytrace=False)
            try:
                _DIRECT.open(f"{endpoint}/storage/v1/b/{GCS_BUCKET}", timeout=1).read()
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"gcp-storage-emulator did not serve {endpoint} within {GCS_START_TIMEOUT_S} s: {e}", pytrace=False
                    )
                time.sleep(0.1)
        yield f"gs://{GCS_BUCKET}", {"endpoint_url": endpoint, "token": "anon", "project": "shardckpt-test"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def gcs_url(gcs_endpoint):
    """A fresh checkpoint URL in the emulator's bucket, and the storage options."""
    prefix, options = gcs_endpoint
    return f"{prefix}/{uuid.uuid4().hex[:12]}/ck", options
