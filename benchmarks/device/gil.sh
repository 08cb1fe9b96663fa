#!/bin/bash
# Issue 9: the GIL cost of a background save on the lent H200 host, thread writer vs process writer vs
# the same save in another process (control), CUDA and CPU state.
# Run from the repo root on a machine with no package registry: the wheels the
# device lacks (crc32c for its Python) lie in $WHL (carried beside the tree).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
nproc; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
for dev in ${DEVICES:-cuda cpu}; do
  echo "=== --device $dev"
  python3 benchmarks/bench_async.py --gil --writer both --device $dev --size-gb ${SIZE_GB:-2} --tensors 32 --iters ${ITERS:-5} --dir /tmp/gil-$dev 2>&1 | grep -v Warn
done
