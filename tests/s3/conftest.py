"""S3 tests run against private servers on loopback: moto (tests/_moto.py), SeaweedFS and the fault proxy (tests/_s3servers.py).

Every test here runs once per data-path client of S3Storage
(``SHARDCKPT_S3_CLIENT``: obstore and s3fs): the same assertions hold for both.
"""

import pytest
from _moto import BUCKET, s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from _s3servers import fault_proxy, s3_client, seaweed_endpoint, weed_url  # noqa: F401  (pytest fixtures)


@pytest.fixture(autouse=True)
def _each_client(s3_client):  # noqa: F811  (the imported fixture, requested by name)
    """Apply the parametrized client to every test of this folder."""
    return s3_client
