"""An s3fs too old for today's API (0.4.x, which pip's backtracking can pick) is named with its fix, not a TypeError deep inside."""

from __future__ import annotations

import os
import re

import pytest

s3fs = pytest.importorskip("s3fs")
fsspec = pytest.importorskip("fsspec")

import shardckpt  # noqa: E402
from shardckpt._storage._s3 import S3FS_MIN_VERSION  # noqa: E402
from shardckpt.errors import StorageError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Boto3Session:
    """boto3.Session's signature, which s3fs 0.4 handed every option it did not know."""

    def __init__(self, aws_access_key_id=None, aws_secret_access_key=None, aws_session_token=None,
                 region_name=None, botocore_session=None, profile_name=None):
        pass


class _OldS3FileSystem(fsspec.AbstractFileSystem):
    """s3fs 0.4.2's constructor: unknown options (``endpoint_url``) go to boto3's Session, which connects at once."""

    protocol = ("s3", "s3a")

    def __init__(self, anon=False, key=None, secret=None, token=None, use_ssl=True, client_kwargs=None,
                 requester_pays=False, default_block_size=None, default_fill_cache=True, default_cache_type="bytes",
                 version_aware=False, config_kwargs=None, s3_additional_kwargs=None, session=None, username=None,
                 password=None, **kwargs):
        super().__init__()
        self.session = _Boto3Session(key, secret, token, **kwargs)  # TypeError: ... 'endpoint_url'


@pytest.fixture
def old_s3fs(monkeypatch):
    real = fsspec.get_filesystem_class("s3")
    fsspec.register_implementation("s3", _OldS3FileSystem, clobber=True)
    monkeypatch.setattr(s3fs, "__version__", "0.4.2")
    try:
        yield
    finally:
        fsspec.register_implementation("s3", real, clobber=True)


@pytest.mark.parametrize("call", ["save", "load", "inspect"])
def test_old_s3fs_is_named_with_the_fix(old_s3fs, call):
    import torch

    url, so = "s3://bucket/run", {"endpoint_url": f"http://127.0.0.1:9/{call}", "key": "k", "secret": "s"}
    with pytest.raises(StorageError) as ei:
        if call == "save":
            shardckpt.save({"w": torch.ones(2)}, url, storage_options=so)
        elif call == "load":
            shardckpt.load({"w": torch.ones(2)}, url, storage_options=so)
        else:
            shardckpt.inspect(url, storage_options=so)
    msg = str(ei.value)
    assert "s3fs 0.4.2" in msg and f'pip install -U "s3fs>={S3FS_MIN_VERSION}"' in msg, msg
    assert "endpoint_url" in msg, msg  # the TypeError itself, for the record
    assert isinstance(ei.value.__cause__, TypeError)


def test_a_current_s3fs_refusing_options_is_not_blamed_on_its_version(monkeypatch):
    from shardckpt._storage import _s3

    monkeypatch.setattr(s3fs, "__version__", "2026.1.0")
    err = _s3._s3fs_refused("s3://b/x", TypeError("__init__() got an unexpected keyword argument 'endpoitn_url'"))
    assert "pip install" not in str(err) and "check their names" in str(err)


def test_the_extras_pin_the_same_lower_bound():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    pins = re.findall(r'"s3fs([^"]*)"', text)
    assert pins and all(p == f">={S3FS_MIN_VERSION}" for p in pins), pins
