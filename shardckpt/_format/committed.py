"""The commit sequence and its mirror, opening a committed checkpoint.

:func:`commit` is the only code that makes a checkpoint exist: every writer
(``save``, ``async_save``, the converters) ends in it. :func:`open_manifest`
is the only code that reads one back (``load``, ``inspect``, ``verify``, the
CLI, the converters), and when there is nothing committed it says what *is*
there and which function to use instead.

Both take any object with the storage methods used here (``read_bytes``,
``read_range``, ``write_atomic``, ``exists``, ``size``, ``listdir``,
``remove``, ``url``, ``url_of``); neither imports torch.
"""

from __future__ import annotations

import difflib
import json
import posixpath
import time
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Tuple

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, UnsupportedStateError, format_offenders
from . import manifest as _manifest
from ._v2 import materialize
from .files import check_files
from .hf import MAX_INDEX_BYTES, hf_manifest
from .manifest import Manifest, check_relpath, manifest_from_bytes, manifest_to_bytes
from .naming import DATA_DIR, DATA_SUFFIX, HF_INDEX_NAME, INDEX_SUFFIX, MANIFEST_NAME, save_id_prefix
from .refs import follow
from .values import value_depth_problem

__all__ = ["commit", "commit_bytes", "open_manifest", "hf_index_bytes", "TORCH_SAVE_SUFFIXES", "NOT_FOUND_LISTED", "nearby_names"]

#: File suffixes ``torch.save`` output usually carries.
TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: Names a not-found message lists before "... (N more)".
NOT_FOUND_LISTED = 5
#: Bytes read from the start of a file to tell what it is (zip / pickle magic).
_MAGIC_BYTES = 8
#: How long a commit whose directory vanished right after the manifest write
#: waits for it to come back (``_settled``): a leftover removal's rename aside,
#: stat and rename back, each with a directory fsync, on a loaded disk.
MOVED_ASIDE_WAIT_S = 10.0
_MOVED_ASIDE_POLL_S = 0.02


def hf_index_bytes(m: Manifest) -> Optional[bytes]:
    """``model.safetensors.index.json`` for ``m`` when every tensor is whole (HF layout), else ``None``."""
    if not m.tensors or any(len(t.chunks) != 1 or t.chunks[0].key != name for name, t in m.tensors.items()):
        return None
    if any(rel.startswith("@") for rel in m.files):
        return None  # references another checkpoint's files (format v4): not a Hugging Face directory
    index = {
        # save_id marks the index as part of a native save: without the
        # manifest (written right after) readers must not take it as HF.
        "metadata": {"total_size": m.total_bytes, "format": "pt", "shardckpt_save_id": m.save_id},
        "weight_map": {name: t.chunks[0].file for name, t in sorted(m.tensors.items())},
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def commit(
    storage: Any, manifest: Manifest, *, replace: bool = False, progress: Optional[Callable[[str], None]] = None,
    files_here: bool = True, keep: AbstractSet[str] = frozenset(),
) -> None:
    """Commit ``manifest`` at ``storage``: the HF index (when whole), then ``manifest.json`` last, atomically.

    Every data file the manifest names must already be written and durable;
    :func:`commit_bytes` checks they are, right before and right after the
    manifest write (another process's ``cleanup()``, an object lifecycle
    rule or an emptied bucket may have removed them since): a commit naming
    missing files would be a checkpoint that cannot be restored. The step
    directory is never re-created: if it vanished, the commit fails. If the
    manifest write fails, the HF index is put back as it was (removed when
    there was none), so a previous checkpoint at ``storage`` stays intact and
    loadable. After a successful commit with ``replace``, data files of the
    replaced checkpoint (other save ids) are removed, except those in
    ``keep``, and an HF index naming removed files too.

    Args:
        storage: where the checkpoint lives.
        manifest: the complete manifest (``save_id`` set; chunks tile their tensors).
        replace: a committed checkpoint may be there and is being replaced.
        progress: told how far the commit got (:func:`commit_bytes`).
        files_here: check the data files at ``storage`` (False only for
            the memory tier and per-node disks, whose files are on other hosts).
        keep: paths (``data/...``) of the replaced checkpoint that a replace
            leaves in place: files other checkpoints reference (incremental
            steps of a manager's root).

    Raises:
        CorruptCheckpointError: a named data file is missing or of the wrong
            size (nothing committed; :func:`commit_bytes`).
        UnsupportedStateError: the values tree nests deeper than
            ``MAX_VALUE_DEPTH`` (it could not be loaded back).
        OSError / StorageError: the manifest could not be written, e.g. the
            directory vanished (nothing committed).

    Example:
        >>> commit(storage, manifest, replace=True)     # doctest: +SKIP
    """
    deep = value_depth_problem(manifest.values)
    if deep:
        raise UnsupportedStateError(f"{storage.url}: cannot save this state: {deep}; flatten the nested values")
    files = {rel: fm.size for rel, fm in manifest.files.items()}
    commit_bytes(storage, manifest_to_bytes(manifest), files if files_here else None, index=hf_index_bytes(manifest),
                 progress=progress, create_dirs=not manifest.files)
    if replace:
        _remove_stale(storage, manifest.save_id, keep)


def commit_bytes(
    storage: Any, body: bytes, files: Optional[Dict[str, int]], *, index: Optional[bytes] = None,
    progress: Optional[Callable[[str], None]] = None, create_dirs: bool = False,
) -> None:
    """The commit point of every writer: check ``files``, write the HF ``index`` and the manifest ``body`` last, check again.

    The one mechanism behind "committed means loadable": :func:`commit`
    (``save``, ``async_save``, the converters, the memory tier) and the
    flusher of ``CheckpointManager(local=)`` (the remote commit, the local
    manifest's bytes) end here. ``files`` (``{path: size}``, references
    ``@<dir>/<path>`` included: they are checked in the sibling directory)
    are checked with :func:`~shardckpt._format.files.check_files` (one
    listing per directory where the storage lists consistently) before
    anything is written, so a missing file leaves a previous checkpoint
    untouched. They are checked again once the manifest landed: a file
    deleted in between (an object lifecycle rule, another tool) makes the
    commit put the previous manifest back (or remove the new one) and
    raise, instead of leaving a committed checkpoint that cannot be loaded.

    Args:
        storage: the checkpoint's directory.
        body: the manifest's bytes.
        files: the files it names and their sizes; None: not checked (the
            memory tier and per-node disks: the files are on other hosts).
        index: the Hugging Face index to write before the manifest, or None.
        progress: told ``"writing"`` right before the manifest write (an error
            from here on may come after the manifest landed), ``"committed"``
            once it landed and checked out, ``"incomplete"`` when the second
            check failed (the manifest is not this commit's any more),
            ``"vanished"`` when the directory vanished right after the
            manifest write and did not come back (outcome unknown).
        create_dirs: the manifest write may create the directory (a
            values-only checkpoint: no data file could have vanished with it).

    Raises:
        CorruptCheckpointError: a file is missing or of the wrong size, each
            named (the first ``errors.MAX_OFFENDERS``); nothing is committed.
        OSError / StorageError: a write failed (nothing committed).

    Example:
        >>> commit_bytes(storage, manifest_to_bytes(m), {"data/x.safetensors": 96})   # doctest: +SKIP

    Limits: a file deleted after the second check is damage to a committed
    checkpoint (``verify`` and ``restore`` see it); between the manifest
    write and the put-back a reader may see the step committed.
    """
    checked = follow(storage)  # references are checked where they point
    if files is not None:
        check_files(checked, files)
    # Before the commit the index is just another file, but it must keep
    # naming the old checkpoint's files if the commit fails: keep it.
    prev = _read_optional(storage, HF_INDEX_NAME) if index is not None else None
    if index is not None:
        storage.write_atomic(HF_INDEX_NAME, index, create_dirs=create_dirs)
    # The manifest being replaced (a re-save): put back if the second check fails.
    before = _read_optional(storage, MANIFEST_NAME, limit=_manifest.MAX_MANIFEST_BYTES) if files else None
    if progress is not None:
        progress("writing")
    try:
        storage.write_atomic(MANIFEST_NAME, body, create_dirs=create_dirs)
    except BaseException:
        if index is not None:
            _restore(storage, HF_INDEX_NAME, prev)
        raise
    if files:
        try:
            try:
                check_files(checked, files)
            except CorruptCheckpointError:
                _settled(storage)
                check_files(checked, files)  # the directory may have come back meanwhile (a leftover removal found this manifest)
        except _Vanished as e:
            # Moved aside and not back within the wait: whether it comes back
            # (then committed, whole) is not ours to know; nothing is removed.
            if progress is not None:
                progress("vanished")
            raise StorageError(str(e)) from None
        except CorruptCheckpointError as e:
            _restore(storage, MANIFEST_NAME, before)
            if index is not None:
                _restore(storage, HF_INDEX_NAME, prev)
            if progress is not None:
                progress("incomplete")
            raise CorruptCheckpointError(
                f"not committed: files were removed while the manifest was written ({e}); "
                + ("the previous manifest is back" if before is not None else "the manifest is removed again")
                + "; something deletes objects under this root (a lifecycle rule, another tool, cleanup() of another "
                "process): stop it and save again") from None
    if progress is not None:
        progress("committed")


class _Vanished(Exception):
    """The manifest just written is gone with its directory, and stayed gone (:func:`_settled`)."""


def _settled(storage: Any) -> None:
    """After the second check failed: wait while the manifest just written is gone with its directory.

    Another process's leftover removal (``_managed.retention.remove_leftover``)
    moves a step directory aside while it is being committed and, finding
    this manifest there, puts it back. Waiting for that (at most
    ``MOVED_ASIDE_WAIT_S``) keeps both honest: a commit declared failed
    here would remove its files, and the directory would then come back
    committed with files missing. Returns at once when the manifest is there.

    Raises:
        _Vanished: still gone after the wait.
    """
    deadline = time.monotonic() + MOVED_ASIDE_WAIT_S
    while not storage.exists(MANIFEST_NAME):
        if time.monotonic() >= deadline:
            raise _Vanished(
                f"{storage.url_of(MANIFEST_NAME)} vanished with its directory right after it was written and did not "
                f"come back within {MOVED_ASIDE_WAIT_S:g} s (another process removing leftovers moved it aside: two "
                "writers under one root?); whether it is committed cannot be told, the files are kept"
            )
        time.sleep(_MOVED_ASIDE_POLL_S)


def _read_optional(storage: Any, rel: str, *, limit: int = MAX_INDEX_BYTES) -> Optional[bytes]:
    try:
        return storage.read_bytes(rel, limit=limit)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except CorruptCheckpointError:
        # Not a file we could put back (a FIFO, over the limit): a failed
        # commit then leaves no index rather than a damaged one.
        return None


def _restore(storage: Any, rel: str, data: Optional[bytes]) -> None:
    """Put ``rel`` back as it was (``None``: it did not exist); best effort, the caller is raising."""
    try:
        if data is None:
            storage.remove(rel)
        else:
            storage.write_atomic(rel, data, create_dirs=False)
    except Exception:
        pass


def _remove_stale(storage: Any, save_id: str, keep: AbstractSet[str] = frozenset()) -> None:
    """After a replacing commit, drop data files of the replaced checkpoint but those in ``keep``; best effort."""
    prefix = save_id_prefix(save_id)
    for name in storage.listdir(DATA_DIR):
        if f"{DATA_DIR}/{name}" in keep:
            continue
        if name.endswith((DATA_SUFFIX, INDEX_SUFFIX)) and not name.startswith(prefix):
            try:
                storage.remove(f"{DATA_DIR}/{name}")
            except Exception:
                pass
    # A sharded save over a whole one leaves the old HF index naming files
    # just removed: drop it rather than leave a broken HF directory.
    try:
        index = json.loads(storage.read_bytes(HF_INDEX_NAME, limit=MAX_INDEX_BYTES))
        named = set(index.get("weight_map", {}).values()) if isinstance(index, dict) else set()
        for rel in named:
            check_relpath(rel, where=HF_INDEX_NAME)
        dangling = any(not storage.exists(rel) for rel in named)
    except FileNotFoundError:
        return
    except Exception:
        dangling = True
    if dangling:
        try:
            storage.remove(HF_INDEX_NAME)
        except Exception:
            pass


# --------------------------------------------------------------------------
# open


def open_manifest(target: Any, *, storage_options: Optional[Dict[str, Any]] = None, chunks: bool = True) -> Manifest:
    """Read and validate the committed checkpoint at ``target`` (a URL or a storage object).

    The manifest's own checksum (v2) is checked before anything in it is
    used. With ``chunks`` (the default), every tensor's chunk list is filled
    in: for v2, from every rank's index file (each checked against its CRC in
    the manifest). A load passes ``chunks=False`` and resolves only the chunks
    it needs (:func:`~shardckpt._format.resolve.resolve_chunks`).

    Without ``manifest.json``, safetensors files there (a Hugging Face
    directory, with or without its index, or one ``.safetensors`` file) read
    as a checkpoint of whole tensors without checksums.

    Raises:
        CheckpointNotFoundError: nothing committed there. The message says
            what is there instead: nothing (a typo? close names are listed),
            the ``step-*`` directories of a run root (use CheckpointManager or
            a step directory), a DCP directory (``converters.from_dcp``), a
            ``torch.save`` file (``converters.from_torch_save``), another
            file, an unfinished save, or the names a directory holds.
        CorruptCheckpointError / UnsafeMetadataError: the manifest (or an
            HF index / header) is damaged or unsafe.

    Example:
        >>> open_manifest("run/step-00000100").world_size     # doctest: +SKIP
        8
    """
    storage = _as_storage(target, storage_options)
    try:
        data = storage.read_bytes(MANIFEST_NAME, limit=_manifest.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        pass
    else:
        m = manifest_from_bytes(data, url=storage.url)
        if chunks:
            materialize(m, storage)
        return m
    kind, names, magic = _probe(storage)
    if kind == "file" and not storage.url.endswith(DATA_SUFFIX):
        raise CheckpointNotFoundError(_not_found(storage, _file_advice(storage.url, magic)))
    if kind != "missing":
        hf = hf_manifest(storage)
        if hf is not None:
            return hf
    raise CheckpointNotFoundError(_not_found(storage, _advice(storage, kind, names)))


def _as_storage(target: Any, storage_options: Optional[Dict[str, Any]]) -> Any:
    if isinstance(target, str):
        # The storage backends (S3 clients) cost more to import than the format: only for a URL.
        from .._storage import Storage

        return Storage(target, storage_options=storage_options)
    return target


def _probe(storage: Any) -> Tuple[str, List[str], bytes]:
    """``("missing" | "file" | "dir", names under it, first bytes of a file)``."""
    try:
        magic = storage.read_range("", 0, _MAGIC_BYTES)
    except OSError:
        # A directory; or an object store prefix (not an object); or nothing.
        magic = None
    if magic is not None:
        return "file", [], bytes(magic)
    try:
        names = storage.listdir("")
    except (NotADirectoryError, FileNotFoundError):
        names = []
    if not names:
        try:
            if not storage.exists(""):
                return "missing", [], b""
        except OSError:
            pass
    return "dir", names, b""


def _not_found(storage: Any, why: str) -> str:
    return f"no committed checkpoint at {storage.url}: {why}"


def _file_advice(url: str, magic: bytes) -> str:
    lower = url.lower()
    # torch.save writes a zip archive (since torch 1.6) or, legacy, a pickle (protocol 2+ starts 0x80).
    if magic.startswith(b"PK\x03\x04") or magic[:1] == b"\x80" or lower.endswith(TORCH_SAVE_SUFFIXES):
        return (
            "it is a torch.save file, not a checkpoint directory; "
            "convert it with shardckpt.converters.from_torch_save(src, dst) "
            "(or `shardckpt import SRC DST`), then load DST"
        )
    return (
        "it is a file, not a checkpoint directory; pass the directory that holds manifest.json "
        "(or a .safetensors file)"
    )


def _advice(storage: Any, kind: str, names: List[str]) -> str:
    if kind == "missing":
        return f"{storage.url} does not exist (so {MANIFEST_NAME} is missing); check the path for a typo{nearby_names(storage)}"
    visible = [n for n in names if not n.startswith(".") or n == ".metadata"]
    if ".metadata" in names:
        return (
            "this is a torch.distributed.checkpoint (DCP) directory (it has .metadata); convert it with "
            "shardckpt.converters.from_dcp(src, dst) (or `shardckpt import SRC DST`), then load DST"
        )
    steps = sorted(n for n in names if n.startswith("step-"))
    if steps:
        return (
            f"this looks like a run root of shardckpt.CheckpointManager, with {len(steps)} step "
            f"director{'y' if len(steps) == 1 else 'ies'}: {format_offenders(steps, limit=NOT_FOUND_LISTED)}; "
            f"use CheckpointManager(root).restore(state) for the latest, or pass one step directory "
            f"(e.g. {storage.url_of(steps[-1])})"
        )
    if DATA_DIR in names:
        return (
            f"{MANIFEST_NAME} is missing (the save never finished, or was interrupted before its commit; "
            "its data files are not a checkpoint)"
        )
    if not visible:
        return f"the directory is empty ({MANIFEST_NAME} is missing)"
    return (
        f"{MANIFEST_NAME} is missing; the directory holds {format_offenders(visible, limit=NOT_FOUND_LISTED)}, "
        "which is not a shardckpt checkpoint, a safetensors directory, a DCP directory or a run root"
    )


def nearby_names(storage: Any) -> str:
    """``"; nearby: a, b"``: names next to a missing path that look like it (typos)."""
    url = storage.url.rstrip("/")
    parent_url, _, base = url.rpartition("/")
    if not base or not parent_url:
        return ""
    try:
        names = _as_storage(parent_url, getattr(storage, "storage_options", None) or None).listdir("")
    except Exception:
        return ""
    close = difflib.get_close_matches(base, names, n=NOT_FOUND_LISTED, cutoff=0.6)
    return f"; nearby: {', '.join(posixpath.join(parent_url, n) for n in close)}" if close else ""
