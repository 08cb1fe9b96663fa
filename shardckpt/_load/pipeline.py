"""The one load, collective: plan and check, agree, stream (or stage), agree, finish.

Here are the public :func:`load` (into a live state, in place) and
:func:`read` (whole CPU tensors and values, no live state), and the one load
they call, :func:`load_into` (the memory tier's restore calls it too), from
an open storage and comm:

  1. plan and check (:func:`~shardckpt._load.plan.plan_load`: the data
     files present at their recorded sizes too);
  2. agree: every rank's plan succeeded (``_collective.agree``, bounded by
     ``collective_timeout_s``) — the point of no return;
  3. stream (``stream.stream_into``; into staging tensors first with
     ``atomic=True``, ``stage.py``);
  4. agree: every rank streamed without error; then, for ``atomic=True``,
     the staged tensors are copied in; then created tensors and plain values
     are put back and stateful objects get ``load_state_dict``
     (:func:`_finish`, agreed too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union, overload

import torch

from .._collective import Comm, agree, open_comm
from .._format import Manifest, open_manifest, with_block_scales
from .._format.refs import follow
from .._format.values import TAG as _TAG
from .._format.values import decode_value, is_tensor_ref, tensor_names
from .._hf import select_paths, with_aliases
from .._storage import Storage, open_storage
from ..errors import CheckpointError, CorruptCheckpointError, LoadFailedError, StateMismatchError, format_offenders
from .plan import DEFAULT_CAST, KeyMap, LoadPlan, LoadResult, new_tensors, plan_load
from .stage import copy_staged, stage_targets
from .stream import StreamHook, stream_into

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["load", "read", "load_into"]


@overload
def load(
    state: None,
    url: Union[str, Storage],
    *,
    storage_options: Optional[Dict[str, Any]] = ...,
    strict: bool = ...,
    process_group: Optional["ProcessGroup"] = ...,
    io_threads: Optional[int] = ...,
    keys: Optional[Sequence[str]] = ...,
    key_map: Optional[KeyMap] = ...,
    collective_timeout_s: Optional[float] = ...,
    no_dist: bool = ...,
    atomic: bool = ...,
    buffer_bytes: Optional[int] = ...,
    cast: bool = ...,
    resize: bool = ...,
) -> Dict[str, Any]: ...


@overload
def load(
    state: Dict[str, Any],
    url: Union[str, Storage],
    *,
    storage_options: Optional[Dict[str, Any]] = ...,
    strict: bool = ...,
    process_group: Optional["ProcessGroup"] = ...,
    io_threads: Optional[int] = ...,
    keys: Optional[Sequence[str]] = ...,
    key_map: Optional[KeyMap] = ...,
    collective_timeout_s: Optional[float] = ...,
    no_dist: bool = ...,
    atomic: bool = ...,
    buffer_bytes: Optional[int] = ...,
    cast: bool = ...,
    resize: bool = ...,
) -> LoadResult: ...


def load(
    state: Optional[Dict[str, Any]],
    url: Union[str, Storage],
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    strict: bool = True,
    process_group: Optional["ProcessGroup"] = None,
    io_threads: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    collective_timeout_s: Optional[float] = None,
    no_dist: bool = False,
    atomic: bool = False,
    buffer_bytes: Optional[int] = None,
    cast: bool = DEFAULT_CAST,
    resize: bool = False,
) -> Union[LoadResult, Dict[str, Any]]:
    """Load a checkpoint into ``state`` in place, resharding to the live layout.

    Works at any world size and mesh, and in a single process with no process
    group. Collective when a process group is initialized: every rank of
    ``process_group`` calls it; to load in one process alone (evaluation on
    rank 0), pass ``no_dist=True``. Each rank reads only the byte ranges it
    needs (rounded to checksum blocks; whole saved chunks for format v1),
    through ``buffer_bytes`` of reused buffers, and copies each verified piece
    straight into its tensor. Tensors are filled with ``copy_`` into their
    existing storage (for a DTensor, its local tensor), so Parameters, their
    dtype, device and object identity are kept — FSDP2's all-gather buffers
    see the new values. Plain values are put back into their dicts; stateful
    objects get ``load_state_dict`` once every tensor is in.

    Everything that needs no tensor bytes is checked first, and all ranks
    agree on it before any tensor changes: names, shapes, dtypes (every
    offender of every kind in one error), self-overlapping targets, files
    present at their sizes. Every byte read is verified before it is copied.
    A block that fails its checksum part-way raises on every rank, naming the
    tensors already overwritten; ``atomic=True`` stages everything first (one
    extra copy of the rank's shard in host memory) so that a failed load
    leaves every tensor as it was.

    Args:
        state: the live state, same structure as when saved. Only the entries
            it names are loaded (a model alone from a full training checkpoint
            is fine).
        url: checkpoint directory or fsspec URL, or a :class:`Storage`
            object (then no ``storage_options``).
        storage_options: passed to fsspec.
        strict: if False, entries missing on either side are skipped and
            reported in the result instead of raising. With several ranks,
            a checkpoint entry counts as unexpected only if no rank's state
            holds it, so pipeline stages load a rank-union checkpoint
            strictly (each distinct list of unclaimed names goes to rank 0
            once).
        process_group: group the load runs over (default: the world).
        io_threads: reads in flight per rank (default: ``SHARDCKPT_LOAD_CPU_IO_THREADS``, at most one per usable core,
            or ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` when this rank's targets are
            CUDA tensors).
        keys: only these checkpoint tensors (names or glob patterns, matched
            against checkpoint names; a pattern that is a checkpoint name
            selects that name exactly, ``[``, ``*`` or ``?`` included); a
            pattern matching nothing raises.
            Usually with ``strict=False``.
        key_map: checkpoint name -> state name: a dict (unlisted names kept)
            or a callable (``None`` drops a tensor), e.g. to load Hugging Face
            names into a differently named model.
        collective_timeout_s: bound of the agreements between ranks (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``): a rank that does not call
            within it is named and the others raise ``LoadFailedError``.
        no_dist: this process alone, as if no process group existed; every
            tensor of ``state`` must be whole here (a sharded DTensor is refused).
        atomic: all-or-nothing: stage every piece, agree, then copy in.
        buffer_bytes: read buffers held at once (default
            ``SHARDCKPT_LOAD_BUFFER_BYTES``, 64 MiB; for CUDA targets
            ``SHARDCKPT_LOAD_CUDA_BUFFER_BYTES``, 512 MiB, pinned at exact size
            so that reads overlap the host-to-device copies; released before
            ``load`` returns).
        cast: True (default) lets a floating-point checkpoint tensor (F16,
            BF16, F32, F64, FP8) load into a live floating-point tensor of
            another precision, cast while copying (as ``tensor.to`` rounds);
            the live dtype is kept. Integer, bool and complex tensors never
            cast. False demands the exact dtype (``StateMismatchError``
            naming every differing tensor). The rule, in one place:
            ``docs/interop.md``, "Casting on load".
        resize: a plain tensor held in a dict (or list) of ``state`` whose
            shape differs from the checkpoint's — a placeholder such as
            ``torch.zeros(1)`` — is replaced by a new tensor of the stored
            shape, with the placeholder's dtype (cast as above) and device,
            once every tensor is read (DCP's Hugging Face reader calls this
            "allow tensor resize"). Never for a module's parameters or
            buffers, DTensors or tensor subclasses: their shape must match
            (the error says so). Default False: a shape mismatch is refused.

    ``url`` may also be a Hugging Face safetensors directory (with or without
    ``model.safetensors.index.json``) or one ``.safetensors`` file: its bare
    model keys go under the state's ``"model"`` entry (or its only entry),
    unless ``key_map`` says otherwise, and each rank reads only the rows of
    each tensor it holds (ranged reads). Safetensors files carry no
    checksums, so those bytes are checked for size and bounds only.
    Block-FP8 weights (``float8_e4m3fn`` with ``<name>_scale_inv``, the
    block from ``config.json``'s ``quantization_config``, DeepSeek-V3's
    layout) are dequantized into the live dtype as they stream: each rank
    reads only its rows of the weight and of the scales; the scale tensors
    are consumed (never "unexpected"). ``docs/interop.md``, "Block FP8".

        >>> shardckpt.load({"model": fsdp_model}, "Llama-3-8B/")   # doctest: +SKIP

    Without a live state (``state`` is ``None`` or ``{}``), on one process
    (not collective): the same as :func:`read` (``url, keys=,
    storage_options=, io_threads=``; the other options are not used). New
    code calls :func:`read`, whose return type says what comes back.

    Returns:
        LoadResult(missing_keys, unexpected_keys); without a live state, :func:`read`'s dict.

    Raises:
        CheckpointNotFoundError: no ``manifest.json`` at ``url``.
        StateMismatchError: names, shapes or dtypes disagree, a target
            tensor overlaps itself, or (strict) the live model ties two names
            the checkpoint holds as different tensors (all listed, one error);
            after the tensors are in, a stateful object refused its state.
        CorruptCheckpointError: files missing or truncated (nothing changed),
            or a block failing its checksum (``ChecksumMismatchError``; names
            the tensors already overwritten unless ``atomic=True``).
        LoadFailedError: a rank did not call within ``collective_timeout_s`` (named).
        UsageError: under torchrun (``WORLD_SIZE`` > 1) with no process group
            initialised and no ``no_dist=True``.

    Every rank raises the same error type and message (naming the ranks that
    found the problem).

    Limits: memory beyond the model is ``buffer_bytes`` (a v1 chunk larger
    than it is read into one buffer of its size), plus one copy of the rank's
    shard with ``atomic=True``. Byte ranges that several ranks load
    (replicas: HSDP, DDP, replicated parameters) are read by one of them and
    sent to the others over ``process_group`` (``SHARDCKPT_LOAD_READ_ONCE``,
    default on): that adds three buffers of about ``buffer_bytes / 2`` on
    the GPU (NCCL) or in host memory (gloo). A stateful object's ``load_state_dict`` runs
    after the tensors are in; if it raises, the tensors are already loaded: the
    load raises ``StateMismatchError`` (or our error the object raised) on
    every rank, naming them, with the object's exception as ``__cause__``.
    A live model that ties two names the checkpoint holds as different
    tensors is refused with ``strict=True`` (``strict=False``: a warning, the
    first name's values load).
    """
    if state is None or (isinstance(state, dict) and not state):
        return read(url, keys=keys, storage_options=storage_options, io_threads=io_threads)
    comm = open_comm(
        process_group, no_dist=no_dist, collective_timeout_s=collective_timeout_s, op="shardckpt.load", error=LoadFailedError
    )
    storage = follow(open_storage(url, storage_options=storage_options))  # format v4 references (_format.refs)
    return load_into(
        state, storage, comm=comm, process_group=process_group, strict=strict, io_threads=io_threads, keys=keys,
        key_map=key_map, atomic=atomic, buffer_bytes=buffer_bytes, cast=cast, resize=resize,
    )


def read(
    url: Union[str, Storage],
    *,
    keys: Union[str, Sequence[str], None] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: Optional[int] = None,
) -> Dict[str, Any]:
    """Read what ``keys`` ask of a checkpoint as new objects: whole CPU tensors and plain values (one process).

    Needs no live model and no process group (not collective; any rank, or
    a notebook, may call it). Every tensor is read through the same verified
    path as :func:`load` (each byte checked against its CRC-32C before it is
    used) and comes back whole — unsharded, whatever the saving world size
    — as a plain CPU tensor of the saved dtype. Values come back as Python
    values, containers holding both rebuilt as saved.

    Args:
        url: checkpoint directory or fsspec URL (a Hugging Face safetensors
            directory or file too), or a :class:`Storage` object.
        keys: what to read: tensor names or dotted paths into saved values
            (``"train_state.step"``), exact or glob patterns; a pattern
            matching nothing raises. Default (None): the top-level entries
            (the whole checkpoint).
        storage_options: passed to fsspec.
        io_threads: reads in flight (default ``SHARDCKPT_IO_THREADS``).

    Returns:
        ``{path: tensor or value}`` for each selected path, sorted by path.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``url``.
        StateMismatchError: a key matches nothing in the checkpoint.
        CorruptCheckpointError: a file missing or truncated, a block failing
            its checksum (``ChecksumMismatchError``), or a saved value that
            cannot be decoded (named by its path).

    Example:
        >>> import tempfile, torch, shardckpt
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = shardckpt.save({"model": {"w": torch.ones(2, 3)}, "step": 7}, d, no_dist=True)
        >>> got = shardckpt.read(d, keys=["model.w", "step"])
        >>> got["model.w"].shape, got["step"]
        (torch.Size([2, 3]), 7)

    Limits: the tensors asked are held in host memory at once (whole, not
    sharded): read a large model's tensors a few at a time with ``keys``.
    Reads on this process alone; with several ranks, each rank that calls
    it reads what it asks.
    """
    storage = follow(open_storage(url, storage_options=storage_options))  # format v4 references (_format.refs)
    manifest = with_block_scales(open_manifest(storage), storage)
    asked = select_paths(with_aliases(manifest), keys)
    template = _read_tensors(storage, manifest, asked, io_threads=io_threads)
    # Selected paths sorted (the values inside them keep their saved order).
    out = {}
    for path in sorted(asked):
        try:
            out[path] = _rebuild(asked[path], path, template)
        except (KeyError, TypeError, ValueError) as e:
            # A malformed container node ("items" missing or not pairs) is
            # damage too; our other errors pass unchanged.
            if isinstance(e, CheckpointError):
                raise
            raise CorruptCheckpointError(f"{path}: saved value cannot be decoded ({type(e).__name__}: {e})") from None
    return out


def _read_tensors(storage: Storage, manifest: Manifest, asked: Dict[str, Any], *, io_threads: Optional[int]) -> Dict[str, torch.Tensor]:
    """The tensors the ``asked`` nodes refer to, read whole into new CPU tensors through the one load.

    A flat template of new tensors named exactly as saved, loaded by
    :func:`load_into` alone on this process (verified reads), from the
    manifest already opened here.
    """
    # Every reference must name a saved tensor: one the checkpoint lacks is damage, not None.
    names = sorted({n for node in asked.values() for n in tensor_names(node)})
    template = new_tensors(storage, manifest, names)
    if names:
        comm = open_comm(None, no_dist=True, op="shardckpt.load", error=LoadFailedError)
        load_into(template, storage, comm=comm, process_group=None, io_threads=io_threads, keys=names, key_map={},
                  opened=manifest)
    return template


def _rebuild(node: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """A saved values-tree node as Python objects, tensor references replaced by ``tensors``."""
    if is_tensor_ref(node):
        return tensors.get(node.get("name"))
    if isinstance(node, dict) and _TAG in node and node[_TAG] in ("tuple", "dict"):
        if node[_TAG] == "tuple":
            return tuple(_rebuild(x, f"{path}.{i}", tensors) for i, x in enumerate(node["items"]))
        return {(key := _decoded(k, path)): _rebuild(v, f"{path}.{key}", tensors) for k, v in node["items"]}
    if isinstance(node, dict) and _TAG not in node:
        return {k: _rebuild(v, f"{path}.{k}", tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(x, f"{path}.{i}", tensors) for i, x in enumerate(node)]
    return _decoded(node, path)


def _decoded(node: Any, path: str) -> Any:
    try:
        return decode_value(node)
    except CorruptCheckpointError as e:
        # Damage named by its saved path, as the live-state path reports it.
        raise CorruptCheckpointError(f"{path}: {e}") from None


def load_into(
    state: Dict[str, Any],
    storage: Storage,
    *,
    comm: Comm,
    process_group: Optional["ProcessGroup"],
    strict: bool = True,
    io_threads: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    atomic: bool = False,
    buffer_bytes: Optional[int] = None,
    cast: bool = DEFAULT_CAST,
    held: Optional[Callable[[str], bool]] = None,
    stream: Optional[StreamHook] = None,
    opened: Optional[Manifest] = None,
    resize: bool = False,
) -> LoadResult:
    """:func:`load` from an open storage and comm (collective): plan and check, agree, stream, agree, finish.

    The one load; :func:`load` and the memory tier's restore call it. The
    memory tier passes ``held`` (which data files this rank's storage holds:
    only those are checked present; the others come from other ranks) and
    ``stream``, which runs the stream itself — ``stream(plan, run)``, ``run``
    being :func:`stream_into` bound to this load's plan and destinations,
    taking its ``sources=``/``read=`` options, and possibly run again after
    a damaged copy (the plan is made once; its ``cache`` holds the metadata
    it read). ``opened``: the storage's manifest, already opened and checked
    by the caller (not parsed again).

    Raises:
        As :func:`load`.
    """
    # Agree across ranks before touching any tensor: one rank's missing file
    # must not leave the others loaded and this one not. Strict with several
    # ranks: what a rank leaves unclaimed is unexpected only if every rank
    # leaves it (ranks of one pipeline stage send the same list, so each
    # distinct list travels once).
    with _gc_paused():  # (not around _finish: user code runs there)
        plan, staged = _plan_and_stream(state, storage, comm=comm, process_group=process_group, strict=strict,
                                        io_threads=io_threads, keys=keys, key_map=key_map, atomic=atomic,
                                        buffer_bytes=buffer_bytes, cast=cast, held=held, stream=stream, opened=opened,
                                        resize=resize)
    _finish(comm, storage.url, plan)
    return plan.result


#: Loads running now in this process, and whether the cyclic GC was on when the first began (:func:`_gc_paused`).
_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_on": False}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the load plans and streams, back as it was after.

    A load makes a few objects per tensor and no cycles worth collecting;
    with tens of thousands of tensors its allocations set off thousands of
    collections, each full one walking the whole process's heap: 40-50% of
    the CPU of a load of 20,000 small tensors (1,333 collections, 4-6 of them
    full, 1.2-1.7 s of 3.1-3.7 s), and the count of full ones varied from run
    to run. Nested or concurrent loads share one pause.
    """
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_on"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_on"]:
                gc.enable()


def _plan_and_stream(state: Dict[str, Any], storage: Storage, *, comm: Comm, process_group: Optional["ProcessGroup"],
                     strict: bool, io_threads: Optional[int], keys: Optional[Sequence[str]], key_map: Optional[KeyMap],
                     atomic: bool, buffer_bytes: Optional[int], cast: bool, held: Optional[Callable[[str], bool]],
                     stream: Optional[StreamHook], opened: Optional[Manifest], resize: bool) -> Tuple[LoadPlan, Any]:
    """The plan of :func:`load_into`, agreed, and its bytes streamed in (copied in from staging with ``atomic``)."""
    union = strict and comm.world > 1
    plan_and_check = functools.partial(
        plan_load, state, storage, rank=comm.rank, world=comm.world, strict=strict, keys=keys, key_map=key_map, cast=cast,
        local_only=comm.no_dist, union=union, opened=opened, held=held, resize=resize,
    )
    if union:
        plan, _ = agree(
            comm, plan_and_check, what=f"nothing was loaded from {storage.url}", mode="distinct",
            share=lambda p: p.result.unexpected_keys, decide=_nobody_holds,
        )
        # Every entry this rank left is another rank's: a strict load reports none.
        plan = dataclasses.replace(plan, result=LoadResult(plan.result.missing_keys, []))
    else:
        plan, _ = agree(comm, plan_and_check, what=f"nothing was loaded from {storage.url}")
    staged = stage_targets(plan) if atomic else None
    run = functools.partial(
        stream_into, storage, plan, staged, threads=io_threads, buffer_bytes=buffer_bytes, comm=comm, process_group=process_group
    )
    agree(
        comm,
        run if stream is None else functools.partial(stream, plan, run),
        what=f"nothing was loaded from {storage.url}" if atomic else
        f"the load from {storage.url} stopped part-way (ranks not named here loaded all their tensors)",
    )
    if staged is not None:
        copy_staged(plan, staged)
    return plan, staged


def _finish(comm: Comm, url: str, plan: LoadPlan) -> None:
    """Put created tensors and run the finalizers (``load_state_dict`` of stateful objects...), agreed by every rank.

    They run once every rank's tensors are in. One that raises (a user
    object refusing its saved state: its own version check) cannot be
    checked before: the object decides. The load then raises our error on
    every rank, naming the tensors this rank had already loaded and keeping
    the object's exception as ``__cause__`` (the streaming contract, as for a
    block that fails its checksum part-way).
    """
    original: List[BaseException] = []

    def run() -> None:
        for name, put in plan.creates.items():
            put(plan.created[name])
        for fn in plan.finalizers:
            try:
                fn()
            except Exception as e:
                cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
                original.append(cause)
                loaded = [t.name for t in plan.targets] + sorted(plan.created)
                cls = type(e) if isinstance(e, CheckpointError) else StateMismatchError
                text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
                msg = (f"{text}. The tensors were loaded before it (the live state now holds the checkpoint's "
                       f"values there; load again once this is fixed): {format_offenders(loaded) if loaded else 'none'}")
                try:
                    err = cls(msg)
                except Exception:  # a subclass with another signature
                    err = StateMismatchError(msg)
                raise err from cause

    try:
        agree(comm, run, what=f"the load from {url} stopped after the tensors were loaded", error=LoadFailedError)
    except CheckpointError as e:
        if original and e.__cause__ is not original[0]:
            e.__cause__ = original[0]  # the object's own exception, not our wrapper of it
        raise


def _nobody_holds(groups) -> Tuple[None, List[None]]:
    """Rank 0 of a strict multi-rank load: refuse the checkpoint entries that no rank's state holds.

    ``groups``: ``_collective.Group``s whose values are the ranks' unclaimed
    names (sorted lists). Raises ``StateMismatchError`` (on every rank).
    """
    nobody = set(groups[0].value)
    for g in groups[1:]:
        nobody &= set(g.value)
    if nobody:
        raise StateMismatchError(
            "cannot load, state and checkpoint disagree: in the checkpoint but not in the state of any rank: "
            f"{format_offenders(sorted(nobody))}. Pass strict=False to load the common entries."
        )
    return None, [None] * len(groups)
