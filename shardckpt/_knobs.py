"""Every tunable of the engine, in one place, each overridable from the environment.

The environment is read once, when this module is first imported; the engine
reads the attributes here at each use (``_knobs.IO_THREADS``, never a copy
taken at import, never a signature default), so assigning an attribute
in-process (as the benchmarks do) changes every call that starts after it
(docs/knobs.md says when each is read; tests/unit/test_knobs.py checks it).
A value that does not parse raises ``ValueError`` naming the variable.

==================================  ==========  ===========================================
environment variable                default     what it sets
==================================  ==========  ===========================================
``SHARDCKPT_IO_THREADS``            4           parallel writers/readers per rank (the
                                                ``io_threads=`` default of every call)
``SHARDCKPT_WRITE_BLOCK_BYTES``     32 MiB      bytes per ``write`` call and CRC update
``SHARDCKPT_READ_BLOCK_BYTES``      32 MiB      a coalesced read range is split into
                                                blocks of this size, read in parallel
``SHARDCKPT_COALESCE_GAP_BYTES``    1 MiB       on object storage, needed ranges of a file
                                                closer than this share one request (the
                                                gap is read and dropped); 0 locally
``SHARDCKPT_MIN_BYTES_PER_FILE``    64 MiB      a rank's data is split over several files
                                                (one per I/O thread) above this size
``SHARDCKPT_HEADER_BYTES_PER_FILE`` 16 MiB      estimated safetensors header bytes per data
                                                file: more chunks go to another file
                                                (safetensors readers refuse headers over
                                                100 MB; 4 KiB .. 64 MiB)
``SHARDCKPT_COLLECTIVE_TIMEOUT_S``  1800        bound of every cross-rank exchange of
                                                save/load/async_save/the manager (the
                                                ``collective_timeout_s=`` default)
``SHARDCKPT_LIVENESS_TIMEOUT_S``    10          a rank whose heartbeat stopped this long
                                                while its peers wait for it is named dead
                                                (seconds after a SIGKILL, not the timeout)
``SHARDCKPT_REGISTER_MIN_BYTES``    1 MiB       CUDA staging buffers at least this big are
                                                ``cudaHostRegister``-ed (exact size)
``SHARDCKPT_LOAD_BUFFER_BYTES``     64 MiB      bytes of read buffers one rank's load holds
                                                at once (pinned, exact size, for CUDA
                                                targets; released when ``load`` returns)
``SHARDCKPT_LOAD_CUDA_BUFFER_BYTES`` 512 MiB   the same for a load into CUDA tensors (pinned,
                                                exact size): room for reads to overlap the
                                                host-to-device copies
``SHARDCKPT_LOAD_CPU_IO_THREADS``   min(16,     reads in flight of a load into CPU tensors
                                    CPUs)       (each reader thread verifies and copies its
                                                pieces: more threads than cores fight)
``SHARDCKPT_LOAD_CUDA_IO_THREADS``  min(16,     reads in flight of a load into CUDA tensors
                                    CPUs)       (CPUs: those this process may run on)
``SHARDCKPT_LOAD_RANGE_BYTES``      8 MiB       largest coalesced read of a load, and the
                                                size of one reusable read buffer
``SHARDCKPT_LOAD_READ_ONCE``        1           0: every rank reads every byte it loads; 1:
                                                a byte range several ranks load (replicas)
                                                is read by one and sent to the others
``SHARDCKPT_LOAD_MAP``              1           a load into CPU tensors checks and copies
                                                local files' bytes out of a memory mapping
                                                (one pass); 0: reads into buffers first
``SHARDCKPT_LOAD_INTO``             1 on <= 4   tmpfs pieces of a CPU load are read with
                                    CPUs, else  ``preadv``: into the reader's scratch, checked
                                    0           whole, copied out (live tensors), or straight
                                                into staging tensors; 0: map them
``SHARDCKPT_LOAD_FUSED``            0           1: a mapped piece that goes as it is into
                                                CPU tensors is copied and checked in one
                                                pass (the C kernel, x86-64 with AVX2), live
                                                tensors' old bytes kept aside and put back
                                                if a block fails; 0: CRC, then copy
``SHARDCKPT_LOAD_STREAM_COPY``      1           verified bytes copied into CPU tensors
                                                bypass the cache (streaming stores, the C
                                                kernel); 0: NumPy's copy, through the cache
``SHARDCKPT_LOAD_LANES``            all         a load's reader threads each read a stretch
                                                of a block-device file in order, through one
                                                kept descriptor (4 readahead windows); map:
                                                CPU pieces mapped; read: CPU pieces read
                                                with preadv; all: read where cold (or on
                                                few cores), else map, and buffered ranges
                                                (CUDA loads) too; 0: no lanes
``SHARDCKPT_LOAD_DIRECT``           0           local reads of >= 1 MiB from a block device
                                                with O_DIRECT: 0 (never), auto (uncached), 1
``SHARDCKPT_EXPORT_PLACED``         1           an HF export of uncast tensors to local disk:
                                                reader threads write each verified piece at
                                                its offset; 0: the packed single writer
``SHARDCKPT_ASYNC_WRITER``          thread      who writes an async save's bytes: ``thread``
                                                (in the training process) or ``process``
                                                (a writer child, out of its GIL)
``SHARDCKPT_MEMORY_PEER_BACKEND``   (auto)      the memory tier's peer copy: the training
                                                group's backend (``nccl``: GPU to GPU,
                                                staged through two GPU buffers on a side
                                                stream; ``gloo``: host to host, in place),
                                                or forced to ``nccl`` / ``gloo``
``SHARDCKPT_REPLICAS``             warn        a save compares the copies of replicated
                                                state first: ``warn`` logs diverged
                                                replicas, ``check`` refuses the save,
                                                ``off`` skips (the ``replicas=`` default)
``SHARDCKPT_BLOCK_BYTES``           1 MiB       format v2: one CRC-32C per this many bytes
                                                of each chunk, so a ranged read verifies
                                                on its own (at least 4 KiB)
``SHARDCKPT_CHECKSUMS``             1           0: skip CRC-32C on write (records 0) and
                                                on read. Benchmarks only: a checkpoint
                                                written so fails verification, as it should
``SHARDCKPT_STORAGE_RETRIES``       5           attempts of each remote storage operation
``SHARDCKPT_RETRY_BASE_DELAY_S``    0.2         first back-off ceiling (doubles per try,
                                                full jitter)
``SHARDCKPT_RETRY_MAX_DELAY_S``     5           largest back-off ceiling
``SHARDCKPT_S3_PART_BYTES``         16 MiB      multipart part size (>= 5 MiB)
``SHARDCKPT_S3_WRITER_INFLIGHT``    4           parts of one file uploading at once
``SHARDCKPT_S3_READ_PART_BYTES``    8 MiB       size of each parallel ranged GET
``SHARDCKPT_S3_MAX_REQUESTS``       32          S3 requests in flight per process/client
``SHARDCKPT_S3_CONNECT_TIMEOUT_S``  10          TCP connect timeout of an S3 request
``SHARDCKPT_S3_STALL_TIMEOUT_S``    30          an S3 request without progress this long
                                                fails (and is retried)
``SHARDCKPT_S3_MIN_BYTES_PER_S``    1 MiB       slowest live transfer rate (deadline of a
                                                request: stall timeout + bytes / this)
==================================  ==========  ===========================================

Sizes accept plain integers or a unit suffix (``KiB``, ``MiB``, ``GiB``, ``KB``,
``MB``, ``GB``): ``SHARDCKPT_WRITE_BLOCK_BYTES=8MiB``.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "IO_THREADS",
    "WRITE_BLOCK_BYTES",
    "READ_BLOCK_BYTES",
    "COALESCE_GAP_BYTES",
    "MIN_BYTES_PER_FILE",
    "HEADER_BYTES_PER_FILE",
    "COLLECTIVE_TIMEOUT_S",
    "LIVENESS_TIMEOUT_S",
    "REGISTER_MIN_BYTES",
    "CHECKSUMS",
    "LOAD_BUFFER_BYTES",
    "LOAD_RANGE_BYTES",
    "LOAD_CUDA_BUFFER_BYTES",
    "LOAD_CUDA_IO_THREADS",
    "LOAD_CPU_IO_THREADS",
    "usable_cpus",
    "LOAD_READ_ONCE",
    "LOAD_MAP",
    "LOAD_INTO",
    "LOAD_FUSED",
    "LOAD_STREAM_COPY",
    "LOAD_LANES",
    "EXPORT_PLACED",
    "LOAD_DIRECT",
    "BLOCK_BYTES",
    "ASYNC_WRITER",
    "MEMORY_PEER_BACKEND",
    "REPLICAS",
    "STORAGE_RETRIES",
    "RETRY_BASE_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "S3_PART_BYTES",
    "S3_WRITER_INFLIGHT_PARTS",
    "S3_READ_PART_BYTES",
    "S3_MAX_REQUESTS",
    "S3_CONNECT_TIMEOUT_S",
    "S3_STALL_TIMEOUT_S",
    "S3_MIN_BYTES_PER_S",
    "ENV_PREFIX",
]

ENV_PREFIX = "SHARDCKPT_"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _env(name: str) -> str | None:
    v = os.environ.get(ENV_PREFIX + name)
    return None if v is None or not v.strip() else v.strip()


def _bad(name: str, raw: str, want: str) -> ValueError:
    return ValueError(f"environment variable {ENV_PREFIX}{name}={raw!r} is not {want}; unset it or fix the value")


def _int(name: str, default: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    raw = _env(name)
    if raw is None:
        return default
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", raw)
    if not m or m.group(2).lower() not in _UNITS:
        raise _bad(name, raw, "an integer (optionally with KiB/MiB/GiB/KB/MB/GB)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < minimum:
        raise _bad(name, raw, f"at least {minimum}")
    if maximum is not None and value > maximum:
        raise _bad(name, raw, f"at most {maximum}")
    return value


def _float(name: str, default: float) -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, "a number") from None
    if not value > 0:
        raise _bad(name, raw, "a positive number")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = _env(name)
    if raw is None:
        return default
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise _bad(name, raw, "a boolean (1/0, true/false)")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: ``taskset``, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return max(1, os.cpu_count() or 1)


#: I/O threads per rank for writes and reads. Writes and CRC32C release the GIL.
IO_THREADS = _int("IO_THREADS", 4)
#: Bytes handed to one ``write`` call (and one CRC update).
WRITE_BLOCK_BYTES = _int("WRITE_BLOCK_BYTES", 32 << 20)
#: Reads of a coalesced range are split into pieces of this size, read (and
#: checksummed) in parallel.
READ_BLOCK_BYTES = _int("READ_BLOCK_BYTES", 32 << 20)
#: On high-latency storage, needed ranges of a file at most this far apart
#: are fetched in one request (``_readers.coalesce_gap``; read at call time).
COALESCE_GAP_BYTES = _int("COALESCE_GAP_BYTES", 1 << 20, minimum=0)
#: A rank's data is split into several files (one per I/O thread) above this size.
MIN_BYTES_PER_FILE = _int("MIN_BYTES_PER_FILE", 64 << 20)
#: Estimated header bytes a data file may get before its chunks are split over
#: more files (many small tensors): safetensors' readers refuse headers over
#: 100 MB, so the bound stays well under that.
HEADER_BYTES_PER_FILE = _int("HEADER_BYTES_PER_FILE", 16 << 20, minimum=4096, maximum=64 << 20)
#: Bound of every cross-rank exchange of one save/load. An exchange waits for
#: the slowest rank to arrive, so it must exceed the longest write (or read)
#: of one rank's shard; a rank that never calls is named after this long.
COLLECTIVE_TIMEOUT_S = _float("COLLECTIVE_TIMEOUT_S", 1800.0)
#: A rank whose heartbeat (refreshed every second by a daemon thread of each
#: rank) has not changed for this long while peers wait for it is declared
#: dead at once, instead of after ``COLLECTIVE_TIMEOUT_S``. Must exceed the
#: longest stall of a live process (a GIL held by a C call, a swap storm).
LIVENESS_TIMEOUT_S = _float("LIVENESS_TIMEOUT_S", 10.0)
#: CUDA staging buffers at least this big are registered host memory (exact
#: size); smaller ones come from torch's pinned allocator (power-of-two sizes).
REGISTER_MIN_BYTES = _int("REGISTER_MIN_BYTES", 1 << 20, minimum=0)
#: Checksum on write and verify on read. Only benchmarks turn it off, to
#: measure the checksum's cost; never the library.
CHECKSUMS = _bool("CHECKSUMS", True)
#: Bytes of read buffers one load holds at once: a streaming load's host
#: memory beyond the model (pinned for CUDA targets). A v1 chunk larger than
#: this is read into one buffer of its exact size (v1 verifies whole chunks).
LOAD_BUFFER_BYTES = _int("LOAD_BUFFER_BYTES", 64 << 20)
#: Largest coalesced read of a load and the size of one reusable buffer:
#: small enough that several are in flight (reads overlap copies), large
#: enough that a request's latency is amortised.
LOAD_RANGE_BYTES = _int("LOAD_RANGE_BYTES", 8 << 20)
#: ``LOAD_BUFFER_BYTES`` and ``IO_THREADS`` of a load whose targets are CUDA
#: tensors (when the call does not pass ``buffer_bytes=``/``io_threads=``).
#: A GPU load is bound by disk reads overlapping pinned host-to-device copies:
#: on one H200 (3 B params + AdamW, cold) 64 MiB and 4 threads reached 1.42x
#: DCP, 512 MiB and 16 threads 1.52x. CPU-target loads keep the small bound
#: above (their buffers are host memory beyond the model). The pinned pool is
#: registered at exact size and released when ``load`` returns.
LOAD_CUDA_BUFFER_BYTES = _int("LOAD_CUDA_BUFFER_BYTES", 512 << 20)
LOAD_CUDA_IO_THREADS = _int("LOAD_CUDA_IO_THREADS", min(16, usable_cpus()))
#: ``IO_THREADS`` of a load whose targets are CPU tensors: each reader thread
#: verifies its piece and copies it into the tensor itself, so a thread per
#: core the process may use is the most that helps; more (4 on a 2-core box)
#: only fight over the cores the copies need, fewer (the former
#: ``min(IO_THREADS, cores)``: 4 on a 16-core host) leave the checksums and
#: copies of a warm load on 4 cores. At most 16, as for CUDA loads.
LOAD_CPU_IO_THREADS = _int("LOAD_CPU_IO_THREADS", min(16, usable_cpus()))
#: A byte range that several ranks of a load need (HSDP/DDP replicas,
#: replicated TP parameters and buffers) is read and verified by one of them
#: and sent to the others over the process group (shardckpt/_replicas.py):
#: storage reads stay ~1.0x the state whatever the replica count. 0: every
#: rank reads what it loads. Read at each ``load``.
LOAD_READ_ONCE = _bool("LOAD_READ_ONCE", True)
#: A load into CPU tensors of the saved dtype reads local files through a
#: memory mapping of each few-MiB piece: the reader thread checks the piece's
#: CRCs and copies it into the tensor straight out of the page cache (one pass;
#: ``read()`` from tmpfs costs a copy of its own). 0: read into buffers first
#: (a filesystem that cannot map files). Read at each load.
LOAD_MAP = _bool("LOAD_MAP", True)
#: 1: where a mapped load's piece lies in memory (a tmpfs or ramfs file),
#: the reader thread reads it with ``preadv`` instead of mapping it (no
#: page-table fill and teardown per piece): a piece for live tensors into the
#: thread's scratch (huge pages), its CRCs checked while in cache, and copied
#: out only if all of them matched (as a mapped piece: a damaged block leaves
#: the whole piece undelivered); a piece whose bytes all go as they are into
#: staging tensors (``atomic=True``) or unchecked straight into them, one
#: checksum block at a time. 0: such pieces are mapped as ``LOAD_MAP`` says.
#: Default: 1 on at most :data:`LOAD_INTO_MAX_CPUS` usable CPUs, else 0,
#: from wave 13's runs (1 GiB from /dev/shm, docs/performance.md): on the
#: 2-core box 4.98 against 4.27 GB/s mapped (the HF directory 6.93 against
#: 5.80); on the 16-core H100 host 7.70 against 11.27 (the HF directory
#: 12.09 either way): with 16 readers the second pass through the scratch
#: costs more memory bandwidth than the mappings' page tables do. Files on
#: disks follow ``LOAD_LANES``. Read at each load.
LOAD_INTO_MAX_CPUS = 4
LOAD_INTO = _bool("LOAD_INTO", usable_cpus() <= LOAD_INTO_MAX_CPUS)
#: A mapped piece that goes as it is into CPU tensors is copied and checked
#: in one pass over its bytes (the C kernel of ``shardckpt/_format/_crccopy.c``,
#: where it was built and the CPU has SSE4.2 and AVX2), live tensors' previous
#: bytes kept aside in the same pass and all put back if a block of the piece
#: fails: 1.06-1.10x the two passes on the 2-core VM, where the load is short
#: of CPU; 0.87x on a 16-core H100 host, where it is short of memory bandwidth
#: and the bytes kept aside are one more stream to memory (docs/performance.md,
#: wave 14). Off by default since wave 16: the kernel's ``check_copy`` (the
#: CRCs, then the copy, no bytes kept aside, the GIL released once a piece)
#: beat it on the 2-core VM too, interleaved, 1 GiB mapped from tmpfs: 4.56
#: against 4.20 GB/s (0.39 against 0.43 CPU s; the two passes in Python
#: 4.13), in an earlier run 6.01 against 5.27 with 1 MiB steps
#: (docs/performance.md, wave 16).
#: ``0``: the two passes (the CRC, then the copy), as without the kernel.
LOAD_FUSED = _bool("LOAD_FUSED", False)
#: Verified bytes a reader copies into CPU tensors (out of its scratch or a
#: file's mapping; copies of 256 KiB or more) bypass the cache: streaming
#: stores (the C kernel, x86-64 with AVX2), since the load does not read
#: them again and a plain store first reads each destination line. 1 GiB
#: from tmpfs on the 2-core VM: 4.82 against 4.33 GB/s, 12% less CPU
#: (docs/performance.md, wave 15). ``0``: NumPy's copy, through the cache.
LOAD_STREAM_COPY = _bool("LOAD_STREAM_COPY", True)
#: A load's reads of a file on a block device (a disk: sysfs shows its queue)
#: go in *lanes*: one reader thread reads a stretch of the file in order,
#: through one kept file descriptor, so the kernel sees sequential streams
#: (its readahead runs ahead of each thread, not into the pieces other
#: threads read). The stretch is 4 of the device's readahead windows
#: (``read_ahead_kb``), 8-64 MiB. ``map`` (``1`` too): each mapped range of a
#: CPU load is a lane, its pieces mapped as without lanes; ``read``: the
#: same, and a lane's pieces are read with ``preadv`` through the lane's
#: descriptor instead of mapped, as tmpfs pieces are (``LOAD_INTO``: into the
#: reader's scratch and checked whole for live tensors, straight into staging
#: ones), when ``LOAD_DIRECT`` is 0; ``all`` (default): a lane is read as
#: with ``read`` where tmpfs pieces are read too (``LOAD_INTO``: few cores) or
#: where its first page is not in the page cache (a cold lane: one
#: ``RWF_NOWAIT`` probe per lane), else mapped as with ``map``; and runs of
#: neighbouring buffered ranges (CUDA targets, casts) are lanes too, within
#: the pool's share of one thread; ``0``: no lanes, every piece a job of its
#: own spread over the threads (the scheduling before wave 12). Chosen on
#: H100 hosts (16 cores, virtio disk, docs/performance.md waves 12-13): the
#: 37 GB FSDP2 cold load 1.59 GB/s with CUDA lanes against 1.44 without on
#: one, 2.07-2.08 against 1.93-2.09 on another; CPU cold loads with ``map``
#: lanes 0.80x, 1.00x and 0.99x of the raw 8-stream read, ``read`` 0.88x,
#: 1.00x and 1.11x; warm ones on 16 cores faster mapped (tmpfs: 8.49-11.27
#: against 7.70-7.98 GB/s). tmpfs and network storage never use lanes. Read
#: at each load.
LOAD_LANES = (_env("LOAD_LANES") or "all").lower()
if LOAD_LANES in ("1", "on", "true", "yes"):
    LOAD_LANES = "map"
elif LOAD_LANES in ("off", "false", "no"):
    LOAD_LANES = "0"
if LOAD_LANES not in ("0", "map", "read", "all"):
    raise _bad("LOAD_LANES", os.environ[ENV_PREFIX + "LOAD_LANES"], "map, read, all or 0")
#: Local reads of >= 1 MiB from a block device with ``O_DIRECT``: ``0``
#: (default: the page cache; an uncached range of more than 4 of the device's
#: readahead windows is asked whole with ``POSIX_FADV_WILLNEED``), ``auto``
#: (ranges whose last page is not cached: a one-byte ``RWF_NOWAIT`` probe),
#: ``1`` (every such range, cached or not). Not the default: on the H100
#: host of 2026-12-06 (virtio, read_ahead_kb 8192) ``O_DIRECT`` reads were
#: no faster at any depth or size (docs/performance.md). tmpfs and network
#: filesystems always read through the cache. Read at each read.
LOAD_DIRECT = (_env("LOAD_DIRECT") or "0").lower()
if LOAD_DIRECT in ("on", "true", "yes"):
    LOAD_DIRECT = "1"
elif LOAD_DIRECT in ("off", "false", "no"):
    LOAD_DIRECT = "0"
if LOAD_DIRECT not in ("auto", "0", "1"):
    raise _bad("LOAD_DIRECT", os.environ[ENV_PREFIX + "LOAD_DIRECT"], "auto, 1 or 0")
#: A Hugging Face export (``converters.to_safetensors``) of tensors kept as
#: saved (no cast) to a local disk: the reader threads ``pwrite`` each
#: verified piece at its offset in the output file (no buffer between, many
#: writes in flight, reads overlapping writes). 0: the packed writer (a
#: producer fills buffers, one thread writes them). Read at each export.
EXPORT_PLACED = _bool("EXPORT_PLACED", True)
#: Format v2 block checksums: one CRC-32C per this many bytes of a chunk
#: (chunk-relative). 1 MiB: 4 bytes of metadata per MiB of data, and a ranged
#: read over-reads at most one block at each end. Written into the manifest,
#: so checkpoints saved with another value read the same.
BLOCK_BYTES = _int("BLOCK_BYTES", 1 << 20, minimum=4096)
#: Who writes an async save's data files: ``thread`` (a thread of the
#: training process) or ``process`` (a persistent writer child fed through
#: shared memory, so its per-block CRC work never takes the training GIL).
#: Read at each ``async_save``. See shardckpt/_writerproc.py, docs/performance.md.
ASYNC_WRITERS = ("thread", "process")
ASYNC_WRITER = (_env("ASYNC_WRITER") or "thread").lower()
if ASYNC_WRITER not in ASYNC_WRITERS:
    raise _bad("ASYNC_WRITER", os.environ[ENV_PREFIX + "ASYNC_WRITER"], "one of " + ", ".join(ASYNC_WRITERS))
#: The memory tier's peer-copy backend (``_memory/snapshot.py``): ``gloo``
#: (the default) copies host to host; ``nccl`` goes GPU to GPU. On 2x H200
#: (2026-11-28) the NCCL path delivered damaged bytes to the peer (caught by
#: the block CRCs: the step was not held, the previous one stayed), while
#: gloo and CUDA_LAUNCH_BLOCKING=1 did not; it stays opt-in until that race
#: is found. "" follows the process group's backend.
MEMORY_PEER_BACKENDS = ("", "nccl", "gloo")
MEMORY_PEER_BACKEND = (_env("MEMORY_PEER_BACKEND") or "").lower()
if MEMORY_PEER_BACKEND not in MEMORY_PEER_BACKENDS:
    raise _bad("MEMORY_PEER_BACKEND", os.environ[ENV_PREFIX + "MEMORY_PEER_BACKEND"], "nccl or gloo")

#: What a save does about replicated state whose copies differ between ranks
#: (``save(replicas=...)``'s default): ``warn`` (the default) logs each
#: diverged chunk on rank 0 and saves, ``check`` refuses the save before any
#: byte is written, ``off`` skips the comparison. Not ``check`` by default:
#: state that legitimately differs per rank under a replicated name (DDP with
#: ``broadcast_buffers=False``: each rank's BatchNorm statistics) would make
#: every save of a running job fail after an upgrade.
#: Read at each save. See shardckpt/_fingerprint.py, docs/guarantees.md.
REPLICAS = (_env("REPLICAS") or "warn").lower()
if REPLICAS not in ("check", "warn", "off"):
    raise _bad("REPLICAS", os.environ[ENV_PREFIX + "REPLICAS"], "one of check, warn, off")

# -- storage (shardckpt/_storage)

#: Attempts of each remote storage operation before a StorageError naming it.
STORAGE_RETRIES = _int("STORAGE_RETRIES", 5)
#: Ceiling of the first back-off delay; doubles after each failure ("full
#: jitter": the delay is uniform below the ceiling, so throttled ranks spread out).
RETRY_BASE_DELAY_S = _float("RETRY_BASE_DELAY_S", 0.2)
#: No back-off ceiling grows past this.
RETRY_MAX_DELAY_S = _float("RETRY_MAX_DELAY_S", 5.0)
#: S3 multipart part size, also the largest object sent as one PutObject
#: (S3: parts >= 5 MiB but the last, at most 10,000 parts).
S3_PART_BYTES = _int("S3_PART_BYTES", 16 << 20, minimum=5 << 20)
#: Parts of one S3 writer uploading at once: a writer holds at most
#: (this + 1) parts of memory.
S3_WRITER_INFLIGHT_PARTS = _int("S3_WRITER_INFLIGHT", 4)
#: Size of each ranged GET an S3 read is split into (fetched concurrently).
S3_READ_PART_BYTES = _int("S3_READ_PART_BYTES", 8 << 20)
#: S3 requests in flight at once through one client (also its connection pool).
S3_MAX_REQUESTS = _int("S3_MAX_REQUESTS", 32)
#: TCP connect timeout of each S3 request.
S3_CONNECT_TIMEOUT_S = _float("S3_CONNECT_TIMEOUT_S", 10.0)
#: An S3 request with no progress this long fails (and is retried).
S3_STALL_TIMEOUT_S = _float("S3_STALL_TIMEOUT_S", 30.0)
#: Slowest transfer rate still alive: a request's deadline is the stall
#: timeout plus its bytes at this rate.
S3_MIN_BYTES_PER_S = _int("S3_MIN_BYTES_PER_S", 1 << 20)
