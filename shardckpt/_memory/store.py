"""One node's shared-memory directory: steps, inventory, verification, staging, clean-up (no torch).

Layout (``docs/manager.md``, "Memory tier")::

    <dir>/                       default /dev/shm/shardckpt-<job id>
      step-00000042/             an ordinary checkpoint directory (manifest.json, data/...)
                                 holding the files of this node's ranks and of the
                                 ranks whose copy this node keeps (file names carry
                                 the writer's rank, so own and peer files never clash)
      .restore-r<rank>-<pid>/    a restore's staging directory: hard links to this
                                 node's verified files, plus files received from peers

The data, index and manifest bytes are written by the save engine (into a
``LocalStorage`` rooted at a step directory) or received from a peer; every
file is verified against the manifest (manifest checksum, index CRC, data
block CRCs) before a restore uses it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import List, Optional, Set, Tuple

from .._format import MANIFEST_NAME, open_manifest
from .._format.checksum import crc32c
from .._storage import Storage
from .._verify import _check_file
from .plan import Inventory

__all__ = ["step_dir", "memory_steps", "inventory", "remove_steps_except", "clean_stale", "check_file", "free_bytes"]

log = logging.getLogger("shardckpt")

_STEP_RE = re.compile(r"^step-(\d+)$")
_STAGING_RE = re.compile(r"^\.restore-r\d+-(\d+)$")


def step_dir(node_dir: str, step: int) -> str:
    """``<node_dir>/step-<8 digits>`` (the manager's step naming, inside the memory directory)."""
    return os.path.join(node_dir, f"step-{step:08d}")


def memory_steps(node_dir: str) -> List[Tuple[int, str]]:
    """``[(step, directory)]`` under ``node_dir``, oldest first (committed or not)."""
    try:
        names = os.listdir(node_dir)
    except OSError:
        return []
    out = []
    for n in names:
        m = _STEP_RE.match(n)
        if m:
            out.append((int(m.group(1)), os.path.join(node_dir, n)))
    return sorted(out)


def inventory(node_dir: str) -> Inventory:
    """What this node holds: ``step -> (save id, {file: size} of the step, files present here at that size)``.

    Only steps whose manifest reads and passes its own checksum count (the
    manifest is on every node: the save writes it on each). File contents
    are not read here: a restore verifies each file it uses.
    """
    out: Inventory = {}
    for step, d in memory_steps(node_dir):
        try:
            m = open_manifest(Storage(d), chunks=False)
            msize = os.path.getsize(os.path.join(d, MANIFEST_NAME))
        except Exception as e:  # damage or a save in flight: not a usable copy of this step
            log.debug("shardckpt: memory tier: %s is not usable: %s: %s", d, type(e).__name__, e)
            continue
        saved = m.extra.get("step") if isinstance(m.extra, dict) else None
        if saved != step:
            continue
        need = {rel: f.size for rel, f in m.files.items()}
        need[MANIFEST_NAME] = msize
        held: Set[str] = set()
        for rel, size in need.items():
            try:
                if os.path.getsize(os.path.join(d, rel)) == size:
                    held.add(rel)
            except OSError:
                pass
        out[step] = (m.save_id, need, held)
    return out


def remove_steps_except(node_dir: str, keep: int) -> List[int]:
    """Remove every step directory but ``keep``'s (older ones, and newer leftovers of an abandoned run)."""
    removed = []
    for step, d in memory_steps(node_dir):
        if step != keep:
            shutil.rmtree(d, ignore_errors=True)  # ranks of one node may race here: same end state
            removed.append(step)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def clean_stale(node_dir: str) -> List[str]:
    """Remove what a dead process left: restore staging directories and half-written temporary files."""
    removed: List[str] = []
    try:
        names = os.listdir(node_dir)
    except OSError:
        return removed
    for n in names:
        m = _STAGING_RE.match(n)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(node_dir, n), ignore_errors=True)
            removed.append(n)
    for _, d in memory_steps(node_dir):
        for root, _dirs, files in os.walk(d):
            for f in files:
                if f.startswith(".") and f.endswith((".tmp", ".part")):
                    try:
                        os.remove(os.path.join(root, f))
                        removed.append(os.path.join(root, f))
                    except OSError:
                        pass
    return removed


def free_bytes(path: str) -> Optional[int]:
    """Free bytes of the filesystem under ``path`` (None when it cannot be told)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check_file(storage: Storage, manifest, rel: str, chunks: Optional[list]) -> Optional[str]:
    """What is wrong with file ``rel`` of a staged step (None: it is good): size, then its checksums.

    An index file is checked against its CRC-32C in the manifest; a data file
    chunk by chunk (``chunks``: its ``(tensor name, chunk)`` pairs) (block CRCs from the index files, as ``shardckpt.verify``
    does, through ``_verify``). The manifest itself is checked when opened.
    """
    want = manifest.files.get(rel)
    if want is None:
        return f"{rel} is not a file of the checkpoint"
    try:
        size = os.path.getsize(storage.path(rel))
    except OSError as e:
        return f"{rel}: {e}"
    if size != want.size:
        return f"{rel} has {size} bytes, the manifest says {want.size}"
    if rel in manifest.indexes:
        with open(storage.path(rel), "rb") as f:
            got = crc32c(f.read())
        exp = manifest.indexes[rel].crc32c
        return None if got == exp else f"{rel} has crc32c {got:#010x}, the manifest says {exp:#010x}"
    errs = _check_file(storage, manifest, rel, list(chunks or []), None)
    return "; ".join(errs) if errs else None
