"""What the converters take and give back, besides tensors: their shared options, sizes, dtypes, file URLs, results, progress bars."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypedDict, Union

import torch

from shardckpt import _knobs
from shardckpt._format import DTYPES
from shardckpt._hf import KeyMap
from shardckpt.errors import StorageError, UnsupportedStateError, UsageError, format_offenders

__all__ = [
    "ConvertOptions", "SelectOptions", "Options", "parse_size", "parse_dtype", "out_dtype", "FLOAT_DTYPES",
    "ConvertResult", "Progress", "split_url", "check_apart",
]


class ConvertOptions(TypedDict, total=False):
    """The keyword options every converter takes (``**options``), all optional.

    Attributes:
        storage_options: fsspec options for the source (and for ``copy_from``).
        dst_storage_options: fsspec options for the destination.
        overwrite: replace what the destination holds: a committed checkpoint
            (native outputs), the weight files of a Hugging Face directory
            (its other files are kept), an existing file (``to_full``).
            Default False: an existing output raises ``CheckpointExistsError``.
        progress: show a progress bar (needs tqdm). Default False.
        io_threads: reads and writes in flight (default ``SHARDCKPT_IO_THREADS``,
            read at each call).

    Example:
        >>> converters.reshard("run/step-9", "s3://b/w8", world_size=8,     # doctest: +SKIP
        ...                    dst_storage_options={"anon": False}, overwrite=True, io_threads=16)
    """

    storage_options: Optional[Dict[str, Any]]
    dst_storage_options: Optional[Dict[str, Any]]
    overwrite: bool
    progress: bool
    io_threads: Optional[int]


class SelectOptions(ConvertOptions, total=False):
    """:class:`ConvertOptions` and the tensor selection of the converters that take one (all but ``reshard`` and ``consolidate``).

    Attributes:
        keys: names or glob patterns selecting tensors (which names they
            match, each converter says); a pattern matching nothing raises.
        key_map: renames: a dict ``{name: new}`` (unlisted names unchanged)
            or a callable returning the new name, or ``None`` to drop one.
    """

    keys: Union[str, Sequence[str], None]
    key_map: Optional[KeyMap]


@dataclass(frozen=True)
class Options:
    """A converter's :class:`ConvertOptions` / :class:`SelectOptions`, checked once (:meth:`of`): what it hands inward.

    ``io_threads`` is resolved (the knob read when the converter was called).
    """

    storage_options: Optional[Dict[str, Any]] = None
    dst_storage_options: Optional[Dict[str, Any]] = None
    overwrite: bool = False
    progress: bool = False
    io_threads: int = field(default_factory=lambda: _knobs.IO_THREADS)  # read at each call
    keys: Union[str, Sequence[str], None] = None
    key_map: Optional[KeyMap] = None

    @classmethod
    def of(cls, fn: str, given: Mapping[str, Any], *, select: bool = False) -> "Options":
        """The options ``given`` to the converter ``fn`` (``SelectOptions`` with ``select``).

        Raises:
            TypeError: a name ``fn`` does not take (all such names listed),
                as Python raises for an unknown keyword argument.

        Example:
            >>> Options.of("reshard", {"overwrite": True, "io_threads": 2}).io_threads
            2
        """
        allowed = (SelectOptions if select else ConvertOptions).__optional_keys__
        unknown = set(given) - allowed
        if unknown:
            raise TypeError(
                f"{fn}() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} {format_offenders(map(repr, unknown))} "
                f"(besides its own arguments it takes {', '.join(sorted(allowed))})"
            )
        return cls(**{k: v for k, v in given.items() if v is not None or k != "io_threads"})


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: Any) -> int:
    """Bytes from ``5_000_000``, ``"5GB"`` (10**9, as huggingface_hub reads it), ``"1GiB"`` (2**30)."""
    if isinstance(size, bool):
        raise ValueError(f"size must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        n = size
    elif isinstance(size, str):
        s = size.strip().upper().replace(" ", "")
        num = s.rstrip("KMGTIB")
        unit = s[len(num) :]
        if unit not in _SIZE_UNITS or not num:
            raise ValueError(f"cannot read size {size!r}; use an int or e.g. '500MB', '5GB', '1GiB'")
        try:
            val = float(num)
        except ValueError:
            raise ValueError(f"cannot read size {size!r}; use an int or e.g. '500MB', '5GB', '1GiB'") from None
        n = int(val * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"size must be an int or a string like '5GB', got {type(size).__name__}")
    if n <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return n


_DTYPE_ALIASES = {"fp32": "F32", "fp16": "F16", "half": "F16", "bf16": "BF16", "fp64": "F64", "double": "F64", "float": "F32",
                  "fp8": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def parse_dtype(dtype: Any) -> Optional[str]:
    """safetensors dtype name of a floating-point ``torch.dtype`` or name (``"bf16"``, ``"bfloat16"``, ``"BF16"``)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        name = dtype.strip()
    else:
        raise TypeError(f"dtype must be a torch.dtype or a name like 'bfloat16', got {dtype!r}")
    st = _DTYPE_ALIASES.get(name.lower())
    if st is None:
        st = name.upper() if name.upper() in DTYPES else next((k for k, (attr, _) in DTYPES.items() if attr == name.lower()), None)
    if st is None or st not in FLOAT_DTYPES:
        raise UnsupportedStateError(
            f"dtype {dtype!r} is not a floating-point type shardckpt can write; use one of "
            f"{', '.join(sorted(DTYPES[k][0] for k in FLOAT_DTYPES))}"
        )
    return st


def out_dtype(src: str, cast: Optional[str]) -> str:
    """``cast`` for floating-point sources; integer and bool tensors keep their dtype."""
    return cast if cast is not None and src in FLOAT_DTYPES else src


class ConvertResult(NamedTuple):
    """What a conversion wrote."""

    url: str
    files: List[str]  # paths relative to ``url`` (or the file name for a single file)
    tensors: int
    nbytes: int  # tensor bytes written
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


def split_url(url: str) -> Tuple[str, str]:
    """``(parent URL, base name)`` of a file URL or path."""
    if "://" in url and not url.startswith("file://"):
        head, _, base = url.rstrip("/").rpartition("/")
        if not base or head.endswith(":/"):
            raise StorageError(f"{url!r} does not name a file")
        return head, base
    path = url[len("file://") :] if url.startswith("file://") else url
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


class Progress:
    """A tqdm bar when asked and available; otherwise nothing."""

    _warned = False

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if not Progress._warned:
                Progress._warned = True
                print("shardckpt: progress bars need tqdm (pip install tqdm)", file=sys.stderr)
            return
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _place(url: str) -> str:
    """``url`` as a comparable place: a local path resolved (symlinks, ``..``), a URL without its trailing slashes."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    path = url[len("file://") :] if url.startswith("file://") else url
    return os.path.realpath(os.path.abspath(path))


def check_apart(src: str, dst: str) -> None:
    """Refuse a conversion whose output is its input, lies inside it, or holds it.

    Writing (with ``overwrite``, removing the replaced weight files) under the
    source would destroy the source while it is read; writing into a
    directory that holds the source could remove the source's files too.

    Raises:
        UsageError: ``dst`` is ``src``, inside it, or above it.

    Example:
        >>> check_apart("ckpt", "ckpt/data")
        Traceback (most recent call last):
        ...
        shardckpt.errors.UsageError: the output ckpt/data is inside the input ckpt; ...
    """
    if not isinstance(src, str) or not isinstance(dst, str):
        return
    s, d = _place(src), _place(dst)
    sep = "/" if "://" in s else os.sep
    if d == s:
        why = "is the input"
    elif d.startswith(s.rstrip(sep) + sep):
        why = f"is inside the input {src}"
    elif s.startswith(d.rstrip(sep) + sep):
        why = f"holds the input {src}"
    else:
        return
    raise UsageError(f"the output {dst} {why}; a conversion would overwrite what it reads. Write the output elsewhere")
