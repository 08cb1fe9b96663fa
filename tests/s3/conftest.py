"""S3 tests run against a private moto server on loopback (see tests/_moto.py)."""

from _moto import BUCKET, s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
