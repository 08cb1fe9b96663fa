"""S3 tests run against private servers on loopback: moto (tests/_moto.py), SeaweedFS and the fault proxy (tests/_s3servers.py)."""

from _moto import BUCKET, s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from _s3servers import fault_proxy, seaweed_endpoint, weed_url  # noqa: F401  (pytest fixtures)
