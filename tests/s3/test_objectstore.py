"""Object storage against real servers on loopback: SeaweedFS, and SeaweedFS behind a fault proxy.

Every server is started by the tests (tests/_s3servers.py); data stays small
(a few MiB) so that the whole suite stays fast on 2 cores. Multipart paths are
exercised by shrinking the part size to S3's 5 MiB minimum.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks

import shardckpt
from shardckpt import _knobs, converters
from shardckpt._storage import S3Storage, Storage
from shardckpt.errors import CheckpointError, SaveFailedError, StorageError

pytestmark = pytest.mark.s3

PART = 5 << 20  # S3's smallest part but the last


def _client(opts):
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
    )


def _split(url):
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key


# -- FSDP2 on 2 ranks -> 3 ranks, verify, export --------------------------------


def _fsdp2_save(rank, world, url, opts):
    from models import build, full_state, shard_fsdp2

    model = shard_fsdp2(build(3))
    shardckpt.save({"model": model, "step": 11}, url, storage_options=opts)
    return full_state(model)


def _fsdp2_load(rank, world, url, opts):
    from models import build, full_state, shard_fsdp2

    model = shard_fsdp2(build(99))
    state = {"model": model, "step": 0}
    shardckpt.load(state, url, storage_options=opts)
    return full_state(model), state["step"]


def test_fsdp2_save_2_load_3_verify_export(weed_url, tmp_path):
    url, opts = weed_url
    saved = run_ranks(2, _fsdp2_save, url, opts)[0]
    loaded = run_ranks(3, _fsdp2_load, url, opts)
    for full, step in loaded:
        assert step == 11 and full.keys() == saved.keys()
        assert all(torch.equal(full[k], saved[k]) for k in saved)
    m = shardckpt.verify(url, storage_options=opts)
    assert m.world_size == 2
    out = tmp_path / "hf"
    converters.to_safetensors(url, str(out), storage_options=opts)
    from safetensors.torch import load_file

    got = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            got.update(load_file(str(out / f)))
    assert set(got) == {f"model.{k}" for k in saved} or set(got) == set(saved)
    for k, v in saved.items():
        assert torch.equal(got.get(f"model.{k}", got.get(k)), v)


def test_manager_save_restore_retention(weed_url):
    url, opts = weed_url
    mgr = shardckpt.CheckpointManager(url, keep_last=2, storage_options=opts)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((300,), float(step)), "step": step})
    assert mgr.steps() == [2, 3]
    live = {"w": torch.zeros(300), "step": 0}
    assert mgr.restore(live) == 3 and torch.equal(live["w"], torch.full((300,), 3.0))
    assert not Storage(url, storage_options=opts).walk_files(os.path.basename(mgr.step_url(1)))


# -- multipart: parallel parts, invisible until complete, aborted on failure ---------


def test_multipart_roundtrip_and_ranges(weed_url, monkeypatch):
    url, opts = weed_url
    monkeypatch.setattr(_knobs, "S3_PART_BYTES", PART)
    monkeypatch.setattr(_knobs, "S3_READ_PART_BYTES", 1 << 20)
    st = Storage(url, storage_options=opts)
    assert isinstance(st, S3Storage)
    data = os.urandom(3 * PART + 12345)
    w = st.open_write("data/big")
    for i in range(0, len(data), 3 << 20):
        w.write(data[i : i + (3 << 20)])
    assert not st.exists("data/big"), "an object must not be visible before its upload completes"
    w.close()
    assert st.size("data/big") == len(data) and st.read_bytes("data/big") == data
    # Many ranges in one call: merged, split into pieces, fetched concurrently.
    bufs = [(o, memoryview(bytearray(n))) for o, n in [(0, 10), (PART - 3, 7), (2 * PART, PART + 100), (len(data) - 5, 5)]]
    st.read_into("data/big", bufs)
    for o, b in bufs:
        assert bytes(b) == data[o : o + len(b)]
    with pytest.raises(EOFError):
        st.read_into("data/big", [(len(data) - 2, memoryview(bytearray(4)))])
    assert st.stat_sizes(["data/big", "data/none"]) == {"data/big": len(data), "data/none": None}


def test_aborted_multipart_leaves_nothing(weed_url, monkeypatch):
    url, opts = weed_url
    monkeypatch.setattr(_knobs, "S3_PART_BYTES", PART)
    st = Storage(url, storage_options=opts)
    w = st.open_write("data/partial")
    w.write(os.urandom(2 * PART + 1))
    w.abort()
    assert not st.exists("data/partial")
    bucket, key = _split(st.url_of("data/partial"))
    ups = _client(opts).list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert ups == [], "the aborted upload's parts are still stored"


# -- the commit checks the data objects -----------------------------------------------


def test_vanished_data_objects_fail_the_commit_and_keep_the_previous_step(weed_url, monkeypatch):
    url, opts = weed_url
    mgr = shardckpt.CheckpointManager(url, keep_last=1, storage_options=opts)
    mgr.save(1, {"w": torch.ones(100), "step": 1})
    from shardckpt import _save

    real = _save.write_files

    def then_vanish(storage, files, **kw):
        out = real(storage, files, **kw)
        # Another process (cleanup(), a lifecycle rule) deletes a data object.
        storage.remove(sorted(files)[0])
        return out

    monkeypatch.setattr(_save, "write_files", then_vanish)
    with pytest.raises(SaveFailedError, match="data/.* is missing"):
        mgr.save(2, {"w": torch.full((100,), 2.0), "step": 2})
    monkeypatch.undo()
    assert mgr.steps() == [1]
    live = {"w": torch.zeros(100), "step": 0}
    assert mgr.restore(live) == 1 and torch.equal(live["w"], torch.ones(100))
    shardckpt.verify(mgr.step_url(1), storage_options=opts)


# -- credentials --------------------------------------------------------------------------


def test_no_credentials_is_our_error_with_a_hint(weed_url, monkeypatch):
    url, opts = weed_url
    shardckpt.save({"x": torch.ones(3)}, url, storage_options=opts)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    # No credentials anywhere: no files, no instance metadata service.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bare = {"endpoint_url": opts["endpoint_url"], "client_kwargs": opts["client_kwargs"]}
    with pytest.raises(StorageError, match="credentials.*storage_options"):
        shardckpt.verify(url, storage_options=bare)
    with pytest.raises(CheckpointError, match="credentials"):
        shardckpt.load({"x": torch.zeros(3)}, url, storage_options=bare)
    # The CLI: the documented error status (2), one line naming the fix, no traceback.
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "shardckpt", "verify", url, "--storage-option", f"endpoint_url={opts['endpoint_url']}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert r.returncode == 2 and "credentials" in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)


# -- through the fault proxy ----------------------------------------------------------------


@pytest.fixture
def fast_retries(monkeypatch):
    """Short back-off and stall limits so that faults cost milliseconds, not minutes."""
    monkeypatch.setattr(_knobs, "RETRY_BASE_DELAY_S", 0.01)
    monkeypatch.setattr(_knobs, "RETRY_MAX_DELAY_S", 0.1)
    monkeypatch.setattr(_knobs, "S3_STALL_TIMEOUT_S", 2.0)
    monkeypatch.setattr(_knobs, "S3_CONNECT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(_knobs, "S3_PART_BYTES", PART)
    monkeypatch.setattr(_knobs, "S3_READ_PART_BYTES", 1 << 20)


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(2 << 20, generator=g), "b": torch.randn(1000, generator=g), "step": step}


def _equal(a, b):
    return torch.equal(a["a"], b["a"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_saves_through_faults_commit_whole_or_nothing(weed_url, fault_proxy, fast_retries):
    url, opts = weed_url
    proxied = dict(opts, endpoint_url=fault_proxy.endpoint)
    # The first two connections are faulted for sure: a client that keeps
    # few connections alive may open only three, which the draw can pass.
    fault_proxy.set_faults(reset=0.12, slowdown=0.12, delay=0.1, stall=0.03, first=("slowdown", "reset"))
    mgr = shardckpt.CheckpointManager(url, keep_last=2, storage_options=proxied)
    ok, failed = [], []
    for step in range(1, 6):
        try:
            mgr.save(step, _state(step))
            ok.append(step)
        except CheckpointError as e:  # ours, never botocore's or aiohttp's
            failed.append(step)
            assert isinstance(e, (SaveFailedError, StorageError)), repr(e)
        # Checked over a direct connection: every committed step is whole.
        direct = shardckpt.CheckpointManager(url, keep_last=2, storage_options=opts)
        committed = direct.steps()
        assert set(committed) <= set(ok), f"a failed save was committed: {committed} vs {ok}"
        assert committed == ok[-2:], "retention removed a good step or kept too many"
        for s in committed:
            live = {"a": torch.zeros(2 << 20), "b": torch.zeros(1000), "step": 0}
            direct.restore(live, step=s)
            assert _equal(live, _state(s))
        if committed:
            shardckpt.verify(direct.step_url(committed[-1]), storage_options=opts)
    assert fault_proxy.faults_dealt() > 0, fault_proxy.stats
    assert ok, f"no save survived the faults (stats {fault_proxy.stats})"


def test_loads_through_faults_verified_or_clear_error(weed_url, fault_proxy, fast_retries):
    url, opts = weed_url
    shardckpt.save(_state(5), url, storage_options=opts)
    proxied = dict(opts, endpoint_url=fault_proxy.endpoint)
    fault_proxy.set_faults(reset=0.2, slowdown=0.15, delay=0.1, stall=0.03, first=("slowdown", "reset"))
    results = []
    for _ in range(5):
        live = {"a": torch.zeros(2 << 20), "b": torch.zeros(1000), "step": 0}
        try:
            shardckpt.load(live, url, storage_options=proxied)
            assert _equal(live, _state(5)), "a load returned wrong bytes"
            results.append("ok")
        except CheckpointError as e:
            # Our error, and the live state untouched.
            assert live["step"] == 0 and not live["a"].any(), f"half-loaded after {e}"
            results.append(type(e).__name__)
    assert fault_proxy.faults_dealt() > 0 and "ok" in results, (results, fault_proxy.stats)


def test_stalled_server_times_out_with_storage_error(weed_url, fault_proxy, fast_retries, monkeypatch):
    url, opts = weed_url
    shardckpt.save(_state(1), url, storage_options=opts)
    monkeypatch.setattr(_knobs, "S3_STALL_TIMEOUT_S", 0.5)
    fault_proxy.set_faults(stall=1.0, stall_s=30)
    st = Storage(url, storage_options=dict(opts, endpoint_url=fault_proxy.endpoint), retries=2)
    with pytest.raises(StorageError, match=r"manifest\.json.*failed after 2 attempts"):
        st.read_bytes("manifest.json")
    buf = memoryview(bytearray(100))
    with pytest.raises(StorageError, match="stalled transfer"):
        st.read_into("manifest.json", [(0, buf)])


def test_persistent_slowdown_fails_the_save_naming_the_object(weed_url, fault_proxy, fast_retries):
    url, opts = weed_url
    fault_proxy.set_faults(slowdown=1.0)
    with pytest.raises(CheckpointError, match="failed after 5 attempts") as ei:
        shardckpt.save(_state(1), url, storage_options=dict(opts, endpoint_url=fault_proxy.endpoint))
    assert url in str(ei.value)
    assert not Storage(url, storage_options=opts).exists("manifest.json")


def test_streamed_ranged_reads_are_exact_through_resets(weed_url, fault_proxy, fast_retries):
    """GET bodies stream straight into the caller's buffers; a body cut mid-way is fetched again, never left half-written."""
    url, opts = weed_url
    data = os.urandom(6 * (1 << 20) + 777)
    Storage(url, storage_options=opts).write_atomic("data/obj", data)
    proxied = Storage(url, storage_options=dict(opts, endpoint_url=fault_proxy.endpoint), retries=12)
    # Resets at a random byte of the exchange, so many of them cut a body
    # after part of it was copied into the buffer; 12 attempts make a
    # spurious failure (0.25^12 per piece) impossible in practice.
    fault_proxy.set_faults(reset=0.25)
    for _ in range(3):
        whole = bytearray(len(data))
        pieces = [(o, memoryview(bytearray(n))) for o, n in [(5, 1 << 20), (3 << 20, 2 << 20), (len(data) - 100, 100)]]
        proxied.read_into("data/obj", [(0, memoryview(whole))])
        proxied.read_into("data/obj", pieces)
        assert bytes(whole) == data
        for o, b in pieces:
            assert bytes(b) == data[o : o + len(b)]
    assert fault_proxy.stats.get("reset", 0) > 0, fault_proxy.stats


def test_retries_are_not_multiplied(weed_url, fault_proxy, fast_retries):
    """Every attempt is one connection at the proxy: the client's own retries never stack on ours."""
    url, opts = weed_url
    Storage(url, storage_options=opts).write_atomic("data/obj", os.urandom(1000))
    st = Storage(url, storage_options=dict(opts, endpoint_url=fault_proxy.endpoint), retries=3)
    fault_proxy.set_faults(slowdown=1.0)
    with pytest.raises(StorageError, match=r"data/obj.*failed after 3 attempts"):
        st.read_bytes("data/obj")
    assert fault_proxy.stats == {"slowdown": 3}, fault_proxy.stats
    # A multipart upload: its first request (create) is attempted 3 times too.
    w = st.open_write("data/big")
    with pytest.raises(StorageError, match=r"data/big.*failed after 3 attempts"):
        w.write(os.urandom(PART + 1))
        w.close()
    w.abort()
    # obstore's writer cannot tell whether its upload was created, so its
    # abort also lists the key's uploads (3 more attempts, one each).
    assert fault_proxy.stats == {"slowdown": 9}, fault_proxy.stats


def test_endpoint_and_region_from_client_kwargs(weed_url):
    """botocore-style options (endpoint and region inside client_kwargs) reach obstore and s3fs's listing client."""
    url, opts = weed_url
    nested = {k: v for k, v in opts.items() if k != "endpoint_url"}
    nested["client_kwargs"] = dict(opts.get("client_kwargs") or {}, endpoint_url=opts["endpoint_url"], region_name="us-east-1")
    shardckpt.save({"x": torch.arange(10.0)}, url, storage_options=nested)
    live = {"x": torch.zeros(10)}
    shardckpt.load(live, url, storage_options=nested)
    assert torch.equal(live["x"], torch.arange(10.0))


def test_slow_client_creation_spends_no_attempt(weed_url, fault_proxy, fast_retries, monkeypatch):
    """Making s3fs's client (CPU work, slow on a loaded host) is not part of an attempt's deadline (its listings)."""
    import time

    url, opts = weed_url
    Storage(url, storage_options=opts).write_atomic("data/obj", os.urandom(1000))
    st = Storage(url, storage_options=dict(opts, endpoint_url=fault_proxy.endpoint), retries=3)
    real = type(st.fs).set_session

    async def slow(fs, *a, **kw):
        if fs._s3 is None:
            time.sleep(_knobs.S3_STALL_TIMEOUT_S + 0.5)  # longer than the deadline, blocking as CPU work does
        return await real(fs, *a, **kw)

    monkeypatch.setattr(type(st.fs), "set_session", slow)
    fault_proxy.set_faults(slowdown=1.0)
    with pytest.raises(StorageError, match=r"list .*/data.*failed after 3 attempts"):
        st.list_sizes("data/obj")
    assert fault_proxy.stats == {"slowdown": 3}, fault_proxy.stats
