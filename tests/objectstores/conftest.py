"""GCS and Azure by the generic fsspec path, against emulators the tests start on loopback.

- GCS: gcsfs against ``gcp-storage-emulator`` (pure Python, in the test extra).
- Azure Blob: adlfs against Azurite's blob service (npm; installed on first
  use under ``AZURITE_PREFIX``, default ``~/.cache/shardckpt-node``).

A missing emulator is a broken test environment: the fixtures fail with the
install hint, they never skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest
from _weed import _die_with_parent, _free_port

GCS_BUCKET = "shardckpt-gcs"
AZURE_CONTAINER = "shardckpt-az"
#: Where the tests install Azurite (``npm install --prefix``); SHARDCKPT_AZURITE_PREFIX overrides.
AZURITE_PREFIX = os.environ.get("SHARDCKPT_AZURITE_PREFIX", os.path.expanduser("~/.cache/shardckpt-node"))
#: Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Seconds for an emulator to answer after it starts.
GCS_START_TIMEOUT_S = 60
AZURE_START_TIMEOUT_S = 60

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


#: The Azurite release the tests install and run (npm; Node.js >= 18).
AZURITE_VERSION = "3.35.0"


def _azurite() -> str:
    """The ``azurite-blob`` executable: under AZURITE_PREFIX, on PATH, or installed there now.

    The README's test command needs nothing but pip and this machine's npm, so
    the first run on a fresh machine installs Azurite from npm into a per-user
    cache (once; a file lock keeps concurrent sessions from racing the install).
    """
    here = os.path.join(AZURITE_PREFIX, "node_modules", ".bin", "azurite-blob")
    if os.path.exists(here):
        return here
    found = shutil.which("azurite-blob")
    if found:
        return found
    npm = shutil.which("npm")
    if not npm:
        pytest.fail(
            f"Azurite is not installed (looked in {AZURITE_PREFIX} and PATH) and npm is not on PATH: install "
            f"Node.js >= 18, or run: npm install --prefix {AZURITE_PREFIX} azurite@{AZURITE_VERSION}",
            pytrace=False,
        )
    import fcntl

    os.makedirs(AZURITE_PREFIX, exist_ok=True)
    with open(os.path.join(AZURITE_PREFIX, ".install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(here):
            r = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", AZURITE_PREFIX,
                 f"azurite@{AZURITE_VERSION}"],
                capture_output=True, text=True, timeout=600,
            )
            if r.returncode != 0 or not os.path.exists(here):
                pytest.fail(
                    f"npm install of azurite@{AZURITE_VERSION} into {AZURITE_PREFIX} failed ({r.returncode}): "
                    f"{(r.stderr or r.stdout)[-800:]}",
                    pytrace=False,
                )
    return here


@pytest.fixture(scope="session")
def azure_endpoint():
    """``(az://container, storage_options)`` of an Azurite blob service on loopback for this session (in memory)."""
    port = _free_port()
    log = open(os.path.join(tempfile.mkdtemp(prefix="shardckpt-azurite-"), "azurite.log"), "wb")
    proc = subprocess.Popen(
        [
            _azurite(),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,
    )
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )
    try:
        from azure.storage.blob import BlobServiceClient

        # No SDK retries: while the server starts, each refused connection must come back at once.
        client = BlobServiceClient.from_connection_string(conn, retry_total=0)
        deadline = time.monotonic() + AZURE_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.flush()
                with open(log.name, "rb") as f:
                    tail = f.read()[-1500:].decode(errors="replace")
                pytest.fail(f"Azurite exited with code {proc.returncode}: {tail}", pytrace=False)
            try:
                client.create_container(AZURE_CONTAINER)
                break
            except Exception as e:
                if "ContainerAlreadyExists" in str(e):
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"Azurite did not serve 127.0.0.1:{port} within {AZURE_START_TIMEOUT_S} s: {e}", pytrace=False)
                time.sleep(0.2)
        yield f"az://{AZURE_CONTAINER}", {"connection_string": conn}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(os.path.dirname(log.name), ignore_errors=True)


@pytest.fixture
def azure_url(azure_endpoint):
    """A fresh checkpoint URL in Azurite's container, and the storage options."""
    prefix, options = azure_endpoint
    return f"{prefix}/{uuid.uuid4().hex[:12]}/ck", options
