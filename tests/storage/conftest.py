"""The storage conformance suite reuses the moto S3 server of tests/s3 (see tests/_moto.py)."""

from _moto import s3_endpoint  # noqa: F401  (pytest fixture)
