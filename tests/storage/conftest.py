"""The storage conformance suite reuses the S3 servers of tests/s3 (moto: tests/_moto.py; SeaweedFS: tests/_s3servers.py)."""

from _moto import s3_endpoint  # noqa: F401  (pytest fixture)
from _s3servers import seaweed_endpoint  # noqa: F401  (pytest fixture)
